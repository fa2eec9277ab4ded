"""An MCP session: which agent holds it, which run its tool calls go into, and whether it was ended.

This row is the whole session. Over HTTP nothing about it lives in a process's memory: `initialize` writes the row
and every later request (on any web process, on any machine, after any restart) reads it by its `Mcp-Session-Id`
(docs/mcp.md, "Sessions and runs"). An agent holds at most UNWIND_MCP_MAX_SESSIONS_PER_AGENT of them, and the sweep
removes ended and long-idle ones (mcp_gateway/sessions.py).
"""
from django.db import models

from ledger.models import Agent, Run, Tenant


class McpSession(models.Model):
    HTTP, STDIO = "http", "stdio"

    session_id = models.CharField(max_length=128, unique=True,
                                  help_text="The Mcp-Session-Id issued at initialize (HTTP), or one per stdio process.")
    transport = models.CharField(max_length=8, choices=[(HTTP, "streamable HTTP"), (STDIO, "stdio")])
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="mcp_sessions")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="mcp_sessions")
    run = models.ForeignKey(Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="mcp_sessions",
                            help_text="The run the session's tool calls go into; empty until the first call, and "
                                      "again after unwind_commit or unwind_rollback.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_activity_at = models.DateTimeField(auto_now=True,
                                            help_text="When a request last used the session (to the minute).")
    ended_at = models.DateTimeField(null=True, blank=True,
                                    help_text="When the client ended the session (HTTP DELETE); its id answers 404 "
                                              "after.")

    class Meta:
        indexes = [models.Index(fields=["agent", "-last_activity_at"], name="mcp_session_agent_recent"),
                   models.Index(fields=["last_activity_at"], name="mcp_session_idle")]  # the sweep's scan

    def __str__(self):
        return f"MCP session {self.session_id[:12]} ({self.transport})"
