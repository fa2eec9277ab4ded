"""An MCP session's place in the ledger: which agent holds it and which run its tool calls go into.

The MCP SDK keeps a streamable-HTTP session's protocol state in the serving process's memory; what Unwind needs to
know about the session (its agent, its run, when it was last used) is kept here instead, so it outlives the process
and can be read by any of them (docs/mcp.md, "Sessions and runs").
"""
from django.db import models

from ledger.models import Agent, Run, Tenant


class McpSession(models.Model):
    HTTP, STDIO = "http", "stdio"

    session_id = models.CharField(max_length=128, unique=True,
                                  help_text="The Mcp-Session-Id the SDK issued (HTTP), or one per stdio process.")
    transport = models.CharField(max_length=8, choices=[(HTTP, "streamable HTTP"), (STDIO, "stdio")])
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="mcp_sessions")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="mcp_sessions")
    run = models.ForeignKey(Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="mcp_sessions",
                            help_text="The run the session's tool calls go into; empty until the first call, and "
                                      "again after unwind_commit or unwind_rollback.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_activity_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["agent", "-last_activity_at"], name="mcp_session_agent_recent")]

    def __str__(self):
        return f"MCP session {self.session_id[:12]} ({self.transport})"
