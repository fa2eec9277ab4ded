"""`manage.py mcp --tenant T --agent-key KEY`: Unwind's MCP server over stdio, for a desktop client.

The client starts this command and speaks MCP on its stdin/stdout. The process is one MCP session of one agent:
the key (or `UNWIND_AGENT_KEY`, so it need not sit in a config file's command line) must be a valid agent key of
the named tenant; a deploy key or another tenant's agent is refused before anything is served. Everything else is
the HTTP gateway's: the same tools, runs, approvals and errors (docs/mcp.md).
"""
from __future__ import annotations

import os
from importlib import import_module
from uuid import uuid4

import anyio
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from mcp.server.stdio import stdio_server

from ledger.tenancy import DEPLOY_KEY_PREFIX, agent_authenticate
from mcp_gateway.gateway import Caller
from mcp_gateway.models import McpSession
from mcp_gateway.server import build_server


class Command(BaseCommand):
    help = "Serve MCP over stdio (for desktop clients) as one agent of one tenant."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="The tenant's slug.")
        parser.add_argument("--agent-key", default=None,
                            help="The agent's key (uw_…); default: the UNWIND_AGENT_KEY environment variable.")

    def handle(self, *args, tenant: str, agent_key: str | None, **options):
        caller = self.caller(tenant, agent_key or os.environ.get("UNWIND_AGENT_KEY", ""))
        import_module(settings.ROOT_URLCONF)  # the approvals app registers its approval links with the URLconf
        connections.close_all()  # the ledger work runs in worker threads, each with its own connection
        server = build_server(caller)

        async def serve():
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(serve)

    @staticmethod
    def caller(tenant: str, key: str) -> Caller:
        if not key:
            raise CommandError("give the agent's key with --agent-key or UNWIND_AGENT_KEY")
        if key.startswith(DEPLOY_KEY_PREFIX):
            raise CommandError("a deploy key cannot act: give an agent's key (manage.py create_agent prints one)")
        agent = agent_authenticate(key)
        if agent is None or agent.tenant.slug != tenant:
            raise CommandError(f"that is not a valid agent key of tenant {tenant!r}")
        return Caller(agent_id=agent.pk, session_id=f"stdio-{uuid4().hex}", transport=McpSession.STDIO,
                      base_url=settings.UNWIND_BASE_URL)
