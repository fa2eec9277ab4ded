"""`manage.py mcp` (issue 16): the real `mcp` client over stdio, against the command started as a subprocess.

The process is one MCP session of one agent of one tenant; it shares the test database (a file) with this test.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from ledger.models import Action, Run
from ledger.tenancy import deploy_key_create
from mcp_gateway.models import McpSession
from sandbox.selectors import world_state
from tests.api_support import effects
from tests.helpers import acme, fault
from tests.test_g05_crash_safety import database_url

pytest_plugins = ["tests.api_fixtures"]
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
USER = {"email": "ashu@example.com", "name": "Ashu Kumar"}


def environment(**extra) -> dict:
    env = dict(os.environ, DATABASE_URL=database_url(), PYTHONPATH=str(ROOT))
    env.pop("UNWIND_AGENT_KEY", None)
    env.update(extra)
    return env


def stdio_session(key: str, script, *, tenant: str = "acme"):
    params = StdioServerParameters(command=sys.executable, args=["manage.py", "mcp", "--tenant", tenant],
                                   env=environment(UNWIND_AGENT_KEY=key), cwd=str(ROOT))

    async def main():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                return await script(mcp)
    return asyncio.run(main())


async def call(mcp, name, args=None):
    result = await mcp.call_tool(name, args or {})
    return result.is_error, json.loads(result.content[0].text)


def test_stdio_lists_calls_and_unwinds_a_failure(api):
    fault("email.send", "status", status=504, times=0)

    async def script(mcp):
        listed = [tool.name for tool in (await mcp.list_tools()).tools]
        begun = await call(mcp, "unwind_begin", {"goal": "Onboard Ashu", "on_behalf_of": "carol@example.com"})
        created = await call(mcp, "hr.create_user", USER)
        failed = await call(mcp, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
        return listed, begun, created, failed

    listed, (_, begun), (created_error, created), (is_error, failed) = stdio_session(api.world.key, script)
    assert "hr.create_user" in listed and "unwind_rollback" in listed
    assert not created_error and created["status"] == "succeeded" and created["run_id"] == begun["run_id"]
    run = Run.objects.get(pk=begun["run_id"])
    assert run.goal == "Onboard Ashu" and run.agent == api.world.agent
    assert McpSession.objects.get(run=run).transport == "stdio"
    assert is_error and failed["code"] == "step_failed" and failed["run_status"] == "compensated"
    assert world_state(tenant=acme())["users"] == []


def test_stdio_rollback_and_a_pending_approval(api, settings):
    async def script(mcp):
        created = await call(mcp, "hr.create_user", USER)
        pending = await call(mcp, "payments.charge", {"customer": "cus_1", "amount_cents": 4900})
        rolled = await call(mcp, "unwind_rollback", {"reason": "changed my mind"})
        return created, pending, rolled

    (_, created), (pending_error, pending), (_, rolled) = stdio_session(api.world.key, script)
    assert not pending_error and pending["status"] == "awaiting_approval"
    assert pending["approval"]["url"].startswith(settings.UNWIND_BASE_URL)
    assert rolled["run_status"] == "compensated" and Action.objects.get(pk=pending["action_id"]).status == "skipped"
    assert effects("payments.charge") == [] and world_state(tenant=acme())["users"] == []


@pytest.mark.parametrize("who", ["another tenant's agent", "bad key", "deploy key"])
def test_stdio_refuses_a_key_that_is_not_an_agent_of_the_tenant(api, who):
    key = {"another tenant's agent": api.world.other_key, "bad key": "uw_nope_notakey"}.get(who)
    if who == "deploy key":
        _, key = deploy_key_create(tenant=acme(), name="pipeline")
    ended = subprocess.run([sys.executable, "manage.py", "mcp", "--tenant", "acme", "--agent-key", key], cwd=ROOT,
                           env=environment(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert ended.returncode != 0 and ended.stdout == ""
    assert "agent key" in ended.stderr or "deploy key" in ended.stderr
    assert not McpSession.objects.exists() and not Run.objects.exists()
