"""Unwind as an MCP server (issue 16): the real `mcp` client over streamable HTTP against the live server.

The agent's MCP client lists its tenant's tools and calls them; each call is a proposed action in the session's
run, under the same policy, approvals and unwind as the REST API. Attacks (another tenant's key, a bad key, a
person or a deploy key, another agent on a stolen session id) are refused over HTTP, and nothing changes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
import requests
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from approvals.models import ApprovalRequest
from ledger.models import Action, Run
from ledger.services.runs import run_expire_idle
from ledger.services.tenancy import agent_revoke, deploy_key_create
from mcp_gateway.models import McpSession
from sandbox.selectors import world_state
from tests.api_support import effects
from tests.helpers import acme, fault

pytest_plugins = ["tests.api_fixtures"]  # the api fixture: acme and globex with the sandbox tools, transactional

USER = {"email": "ashu@example.com", "name": "Ashu Kumar"}
CHARGE = {"customer": "cus_1", "amount_cents": 4900}


@pytest.fixture
def gateway(api, live_server, settings):
    """The api world, served by the live server, with a short approval wait so pending answers come quickly."""
    settings.UNWIND_MCP_APPROVAL_WAIT = 2.0
    settings.UNWIND_BASE_URL = live_server.url
    api.url = f"{live_server.url}/mcp"
    return api


@contextlib.asynccontextmanager
async def connected(url: str, key: str, *, terminate: bool = True):
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as http:
        async with streamable_http_client(url, http_client=http, terminate_on_close=terminate) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


def session(url: str, key: str, script, **options):
    """Run `script(session)` in a fresh MCP session and return what it returns."""
    async def main():
        async with connected(url, key, **options) as mcp:
            return await script(mcp)
    return asyncio.run(main())


async def call(mcp, name, args=None, **options):
    result = await mcp.call_tool(name, args or {}, **options)
    return result.is_error, result.structured_content, json.loads(result.content[0].text)


def test_lists_the_tenants_tools_with_schema_role_and_approval(gateway):
    async def script(mcp):
        return (await mcp.list_tools()).tools

    tools = {tool.name: tool for tool in session(gateway.url, gateway.world.key, script)}
    assert {"hr.create_user", "payments.charge", "unwind_begin", "unwind_commit", "unwind_rollback",
            "unwind_status"} <= set(tools)
    create = tools["hr.create_user"]
    assert create.input_schema["required"] == ["email", "name"]
    assert "Create a user in the HR directory." in create.description
    assert "saga role compensatable" in create.description and "runs without approval" in create.description
    charge = tools["payments.charge"].description
    assert "saga role pivot" in charge and "needs approval" in charge


def test_a_call_is_a_proposed_action_in_the_sessions_run(gateway):
    async def script(mcp):
        return await call(mcp, "hr.create_user", USER)

    is_error, payload, text = session(gateway.url, gateway.world.key, script)
    assert not is_error and payload == text
    assert payload["status"] == "succeeded" and payload["result"]["email"] == USER["email"]
    action = Action.objects.get(pk=payload["action_id"])
    assert action.run.agent == gateway.world.agent and action.run.goal.startswith("MCP session")
    assert action.run.idle_timeout_seconds == 900  # UNWIND_MCP_SESSION_IDLE's default
    mapped = McpSession.objects.get(run=action.run)
    assert mapped.agent == gateway.world.agent and mapped.transport == "http"
    assert len(effects("hr.create_user")) == 1
