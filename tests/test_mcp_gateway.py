"""Unwind as an MCP server (issue 16): the real `mcp` client over streamable HTTP against the live server.

The agent's MCP client lists its tenant's tools and calls them; each call is a proposed action in the session's
run, under the same policy, approvals and unwind as the REST API. Attacks (another tenant's key, a bad key, a
person or a deploy key, another agent on a stolen session id) are refused over HTTP, and nothing changes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx2
import pytest
import requests
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from approvals.models import ApprovalRequest
from ledger.models import Action, Run
from ledger.engine.runs import run_expire_idle
from ledger.tenancy import agent_revoke, deploy_key_create
from mcp_gateway import gateway as gateway_module
from mcp_gateway.models import McpSession
from sandbox.selectors import world_state
from tests.api_support import effects
from tests.helpers import acme, fault

pytest_plugins = ["tests.api_fixtures"]  # the api fixture: acme and globex with the sandbox tools, transactional

USER = {"email": "ashu@example.com", "name": "Ashu Kumar"}
CHARGE = {"customer": "cus_1", "amount_cents": 4900}


@pytest.fixture
def gateway(api, live_server, settings):
    """The api world, served by the live server."""
    settings.UNWIND_BASE_URL = live_server.url
    api.url = f"{live_server.url}/mcp"
    return api


@contextlib.asynccontextmanager
async def connected(url: str, key: str, *, terminate: bool = True, transport=None):
    """An official-SDK client session, configured through its public API only (an httpx2 client of our own)."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, transport=transport,
                                  timeout=httpx2.Timeout(30, read=300)) as http:
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


async def in_thread(work, *args, **kwargs):
    """ORM work from the client's event loop, in a thread whose database connection is closed after."""
    return await asyncio.to_thread(gateway_module.in_thread, work, *args, **kwargs)


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


def approve(base_url: str, approval_id: int) -> None:
    """What a person does in the inbox (here through the approvals API)."""
    approved = requests.post(f"{base_url}/api/v1/approvals/{approval_id}/approve", json={},
                             auth=("alice", "pw-alice"), timeout=10)
    assert approved.status_code == 200, approved.text


def test_a_step_awaiting_approval_answers_pending_at_once_and_status_waits_with_progress(gateway, live_server):
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))
        if len(progress) == 1:  # a person decides while the agent waits on unwind_status
            approval = await in_thread(ApprovalRequest.objects.get, action_id=pending["action_id"])
            await asyncio.to_thread(approve, live_server.url, approval.pk)

    pending, took = {}, []

    async def first(mcp):
        started = time.monotonic()
        is_error, answered, _ = await call(mcp, "payments.charge", CHARGE, progress_callback=on_progress)
        took.append(time.monotonic() - started)
        pending.update(answered)
        assert not is_error and progress == []  # nothing waited for a person
        assert await in_thread(effects, "payments.charge") == []
        return await call(mcp, "unwind_status", {"action_id": answered["action_id"], "wait": 10},
                          progress_callback=on_progress)

    is_error, done, _ = session(gateway.url, gateway.world.key, first, terminate=False)
    # The call answered at once (no web thread parked on a person: parked even for the UNWIND_INLINE_WAIT of 5 s a
    # step is waited for, it would take longer than this bound, whose margin is a loaded CI machine's), with the
    # approval and how to wait.
    assert took[0] < 3.5 and pending["pending"] is True and pending["status"] == "awaiting_approval"
    approval = ApprovalRequest.objects.get(action_id=pending["action_id"])
    assert pending["approval"]["url"] == f"{live_server.url}/approvals/{approval.pk}/"
    assert "unwind_status" in pending["message"] and pending["approval"]["url"] in pending["message"]
    # unwind_status waited, sending progress on its own response, and answered with the approved step's outcome.
    assert progress and progress[0][1] == 10 and "approval" in progress[0][2]
    assert not is_error and done["status"] == "succeeded" and done["result"]["charge_id"]
    session_id = McpSession.objects.get(run_id=pending["run_id"]).session_id

    async def again(mcp):
        await call(mcp, "unwind_begin", {"run_id": pending["run_id"]})
        return await call(mcp, "payments.charge", CHARGE)

    resent_error, resent, _ = session(gateway.url, gateway.world.key, again)
    assert not resent_error and resent["action_id"] == pending["action_id"] and resent["replayed"] is True
    assert len(effects("payments.charge")) == 1
    # Both sessions are mapped to the run: the second took it up with unwind_begin(run_id).
    assert set(McpSession.objects.filter(run_id=pending["run_id"]).values_list("session_id", flat=True)) > {session_id}


def test_a_rejected_step_is_a_tool_error_with_its_code(gateway, live_server):
    async def first(mcp):
        return await call(mcp, "payments.charge", CHARGE)

    _, pending, _ = session(gateway.url, gateway.world.key, first)
    approval = ApprovalRequest.objects.get(action_id=pending["action_id"])
    rejected = requests.post(f"{live_server.url}/api/v1/approvals/{approval.pk}/reject", json={"reason": "too much"},
                             auth=("alice", "pw-alice"), timeout=10)
    assert rejected.status_code == 200, rejected.text

    async def look(mcp):
        return await call(mcp, "unwind_status", {"action_id": pending["action_id"]})

    is_error, payload, _ = session(gateway.url, gateway.world.key, look)
    assert is_error and payload["code"] == "rejected" and "too much" in payload["message"]
    assert effects("payments.charge") == []


def test_a_failed_step_unwinds_the_run_and_the_sandbox_shows_it(gateway):
    fault("email.send", "status", status=504, times=0)  # every attempt: the step fails for good
    welcome = {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"}

    async def script(mcp):
        created = await call(mcp, "hr.create_user", USER)
        await call(mcp, "licenses.provision", {"user_id": created[1]["result"]["id"], "sku": "pro"})
        failed = await call(mcp, "email.send", welcome)
        after = await call(mcp, "hr.create_user", {"email": "x@example.com", "name": "X"})
        return failed, after

    (is_error, failed, _), (after_error, after, _) = session(gateway.url, gateway.world.key, script)
    assert is_error and failed["code"] == "step_failed" and failed["run_status"] == "compensated", failed
    assert "email.send failed" in failed["message"] and "undid" in failed["message"]
    assert failed["undone"] == [{"step": 2, "undone_by": "licenses.revoke", "status": "succeeded"},
                                {"step": 1, "undone_by": "hr.delete_user", "status": "succeeded"}]
    state = world_state(tenant=acme())
    assert state["users"] == [] and [lic["status"] for lic in state["licenses"]] == ["revoked"]
    # The unwound run takes no more steps; the model is told to begin a new one.
    assert after_error and after["code"] == "run_not_active" and "unwind_begin" in after["hint"]


def test_an_ordering_violation_is_a_tool_error(gateway, settings):
    async def script(mcp):
        await call(mcp, "email.send", {"to": "a@example.com", "subject": "hi", "body": "hello"})
        return await call(mcp, "hr.create_user", USER)

    is_error, payload, _ = session(gateway.url, gateway.world.key, script)
    assert is_error and payload["code"] == "ordering_violation" and payload["rule"] == "compensatable_before_pivot"
    assert effects("hr.create_user") == []


def test_rollback_undoes_what_the_run_did(gateway):
    async def script(mcp):
        begun = await call(mcp, "unwind_begin", {"goal": "Onboard Ashu", "on_behalf_of": "carol@example.com"})
        created = await call(mcp, "hr.create_user", USER)
        rolled = await call(mcp, "unwind_rollback", {"reason": "wrong person"})
        status = await call(mcp, "unwind_status")
        return begun, created, rolled, status

    (_, begun, _), (_, created, _), (is_error, rolled, _), (_, status, _) = session(
        gateway.url, gateway.world.key, script)
    run = Run.objects.get(pk=begun["run_id"])
    assert run.goal == "Onboard Ashu" and run.on_behalf_of == "carol@example.com" and created["run_id"] == run.pk
    assert not is_error and rolled["run_status"] == "compensated" and run.status == "compensated"
    assert rolled["undone"] == [{"step": 1, "undone_by": "hr.delete_user", "status": "succeeded"}]
    assert world_state(tenant=acme())["users"] == [] or created["result"]["id"] not in {
        u["id"] for u in world_state(tenant=acme())["users"]}
    assert status["run_id"] is None  # the next call opens a new run


def test_commit_completes_the_run(gateway):
    async def script(mcp):
        created = await call(mcp, "hr.create_user", USER)
        committed = await call(mcp, "unwind_commit")
        return created, committed

    (_, created, _), (is_error, committed, _) = session(gateway.url, gateway.world.key, script)
    assert not is_error and committed["run_status"] == "completed"
    assert Run.objects.get(pk=created["run_id"]).status == "completed"


def raw_call(url: str, key: str, session_id: str, request_id: int, name: str, args: dict):
    """A tools/call as a reconnecting client sends it: a new connection, the session's id, a new request id."""
    from mcp_types.version import LATEST_HANDSHAKE_VERSION

    response = requests.post(url, timeout=30, json={
        "jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": name, "arguments": args}},
        headers={"Authorization": f"Bearer {key}", "Mcp-Session-Id": session_id,
                 "Mcp-Protocol-Version": LATEST_HANDSHAKE_VERSION, "Accept": "application/json, text/event-stream"})
    if response.headers.get("Content-Type", "").startswith("application/json"):
        messages = [response.json()]
    else:
        messages = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    return response.status_code, [m for m in messages if "result" in m and m.get("id") == request_id]


def test_a_call_resent_after_a_reconnect_has_one_effect(gateway):
    async def script(mcp):
        return await call(mcp, "hr.create_user", USER)

    _, first, _ = session(gateway.url, gateway.world.key, script, terminate=False)
    session_id = McpSession.objects.get(run_id=first["run_id"]).session_id
    status, [answer] = raw_call(gateway.url, gateway.world.key, session_id, 99, "hr.create_user", USER)
    assert status == 200
    resent = answer["result"]["structuredContent"]
    assert resent["action_id"] == first["action_id"] and resent["replayed"] is True
    assert resent["result"] == first["result"]
    assert Action.objects.get(pk=first["action_id"]).key_source == "derived"  # from the content, not the request id
    assert len(effects("hr.create_user")) == 1 and Action.objects.filter(tool__name="hr.create_user").count() == 1


def test_another_tenants_key_lists_none_of_the_tools_and_cannot_call_them(gateway):
    from ledger.tenancy import agent_create, tenant_create

    initech = tenant_create(slug="initech", name="Initech")
    _, key = agent_create(tenant=initech, name="stranger")

    async def script(mcp):
        listed = [tool.name for tool in (await mcp.list_tools()).tools]
        called = await call(mcp, "hr.create_user", USER)
        return listed, called

    listed, (is_error, payload, _) = session(gateway.url, key, script)
    assert listed == ["unwind_begin", "unwind_commit", "unwind_rollback", "unwind_status"]
    assert is_error and payload["code"] == "unknown_tool"
    assert effects("hr.create_user") == [] and not Action.objects.filter(tenant=acme()).exists()


def test_another_agent_cannot_use_a_sessions_id(gateway):
    async def script(mcp):
        return await call(mcp, "hr.create_user", USER)

    _, first, _ = session(gateway.url, gateway.world.key, script, terminate=False)
    session_id = McpSession.objects.get(run_id=first["run_id"]).session_id
    status, answers = raw_call(gateway.url, gateway.world.other_key, session_id, 7, "hr.create_user",
                               {"email": "evil@example.com", "name": "Evil"})
    assert status == 404 and answers == []
    assert Action.objects.count() == 1 and len(effects("hr.create_user")) == 1


@pytest.mark.parametrize("who", ["bad key", "no key", "person", "deploy key", "revoked agent"])
def test_who_may_not_connect_gets_no_session(gateway, live_server, who):
    headers = {"Accept": "application/json, text/event-stream"}
    auth = None
    if who == "bad key":
        headers["Authorization"] = "Bearer uw_nope_notakey"
    elif who == "person":
        auth = ("alice", "pw-alice")
    elif who == "deploy key":
        _, deploy = deploy_key_create(tenant=acme(), name="pipeline")
        headers["Authorization"] = f"Bearer {deploy}"
    elif who == "revoked agent":
        agent_revoke(agent=gateway.world.agent, actor="test")
        headers["Authorization"] = f"Bearer {gateway.world.key}"
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}
    response = requests.post(gateway.url, json=initialize, headers=headers, auth=auth, timeout=10)
    expected = 403 if who == "deploy key" else 401
    assert response.status_code == expected, response.text
    assert response.headers["Content-Type"].startswith("application/problem+json")
    assert "mcp-session-id" not in {k.lower() for k in response.headers}
    if expected == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert not McpSession.objects.exists() and not Run.objects.exists()


def test_a_revoked_key_stops_an_open_session(gateway):
    async def script(mcp):
        first = await call(mcp, "hr.create_user", USER)
        await in_thread(agent_revoke, agent=gateway.world.agent, actor="test")
        try:
            return first, await call(mcp, "hr.create_user", {"email": "b@example.com", "name": "B"})
        except Exception as refused:  # the next request's 401 ends the session on the client's side
            return first, refused

    _, outcome = session(gateway.url, gateway.world.key, script, terminate=False)
    assert isinstance(outcome, Exception), outcome  # the call after the revocation was refused (401)
    assert len(effects("hr.create_user")) == 1


def test_an_idle_session_is_unwound(gateway, settings):
    settings.UNWIND_MCP_SESSION_IDLE = 120

    async def script(mcp):
        return await call(mcp, "hr.create_user", USER)

    _, created, _ = session(gateway.url, gateway.world.key, script, terminate=False)
    run = Run.objects.get(pk=created["run_id"])
    assert run.idle_timeout_seconds == 120
    from datetime import timedelta

    from django.utils import timezone
    past = timezone.now() - timedelta(seconds=300)
    Run.objects.filter(pk=run.pk).update(updated_at=past, idle_deadline=past)
    Action.objects.filter(run=run).update(updated_at=past)
    assert run_expire_idle(run_id=run.pk)
    run.refresh_from_db()
    assert run.status == "compensated"
    assert created["result"]["id"] not in {u["id"] for u in world_state(tenant=acme())["users"]}


def test_the_example_session_runs_against_the_server(gateway):
    """examples/mcp_session.py, as a newcomer runs it against `make demo` (here: the live server and acme's people)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    ended = subprocess.run(
        [sys.executable, "examples/mcp_session.py", "--url", gateway.url, "--key", gateway.world.key,
         "--approver", "alice:pw-alice", "--operator", "oscar:pw-oscar"],
        cwd=root, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert "send the welcome email (the email service is down): TOOL ERROR" in ended.stdout
    assert "still holds that user: False" in ended.stdout
    runs = list(Run.objects.order_by("pk").values_list("status", flat=True))
    assert runs == ["completed", "compensated", "compensated"], ended.stdout
    assert len(effects("payments.charge")) == 1
    assert [u["email"] for u in world_state(tenant=acme())["users"]] == [USER["email"]]  # the committed run's user


def test_an_agent_key_over_its_rate_is_throttled(gateway, settings):
    settings.UNWIND_THROTTLE_RATE = "3/min"
    headers = {"Authorization": f"Bearer {gateway.world.key}", "Accept": "application/json, text/event-stream"}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}
    answers = [requests.post(gateway.url, json=initialize, headers=headers, timeout=10) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[-1].json()["code"] == "throttled" and int(answers[-1].headers["Retry-After"]) >= 1
    assert "mcp-session-id" not in {k.lower() for k in answers[-1].headers}


def test_first_calls_sent_at_once_share_one_run(gateway):
    async def script(mcp):
        return await asyncio.gather(*[call(mcp, "hr.create_user", {"email": f"u{n}@example.com", "name": f"U{n}"})
                                      for n in range(4)])

    answers = session(gateway.url, gateway.world.key, script)
    assert all(not is_error for is_error, _, _ in answers)
    assert len({payload["run_id"] for _, payload, _ in answers}) == 1 and Run.objects.count() == 1


def initialized(url: str, key: str) -> dict:
    """The headers of a session opened by a raw initialize, as a client sends them afterwards."""
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream"}
    opened = requests.post(url, timeout=10, headers=headers, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}})
    assert opened.status_code == 200 and opened.headers["Content-Type"] == "application/json", opened.text
    assert opened.json()["result"]["protocolVersion"] == "2025-06-18"  # the client's version, when known
    assert opened.json()["result"]["capabilities"] == {"tools": {"listChanged": False}}
    return {**headers, "Mcp-Session-Id": opened.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": "2025-06-18"}


@pytest.mark.parametrize("case, status, code", [
    ("no session id", 400, -32600), ("unknown session id", 404, -32600), ("a batch", 400, -32600),
    ("not JSON", 400, -32700), ("text/plain", 415, -32600), ("unknown protocol version", 400, -32600),
    ("an unknown method", 200, -32601), ("tools/call without a name", 200, -32602),
    ("accepts neither JSON nor SSE", 406, -32600)])
def test_the_transport_refuses_what_is_not_a_json_rpc_request_of_a_live_session(gateway, case, status, code):
    headers = initialized(gateway.url, gateway.world.key)
    body: object = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                    "params": {"name": "hr.create_user", "arguments": USER}}
    data = None
    if case == "no session id":
        del headers["Mcp-Session-Id"]
    elif case == "unknown session id":
        headers["Mcp-Session-Id"] = "0" * 32
    elif case == "a batch":
        body = [body]
    elif case == "not JSON":
        body, data = None, b"{not json"
        headers["Content-Type"] = "application/json"
    elif case == "text/plain":
        body, data = None, json.dumps(body).encode()
        headers["Content-Type"] = "text/plain"
    elif case == "unknown protocol version":
        headers["Mcp-Protocol-Version"] = "1999-01-01"
    elif case == "an unknown method":
        body = {"jsonrpc": "2.0", "id": 2, "method": "resources/list", "params": {}}
    elif case == "tools/call without a name":
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"arguments": USER}}
    elif case == "accepts neither JSON nor SSE":
        headers["Accept"] = "text/html"
    answered = requests.post(gateway.url, json=body, data=data, headers=headers, timeout=10)
    assert answered.status_code == status, answered.text
    assert answered.json()["error"]["code"] == code and "result" not in answered.json()
    assert not Run.objects.exists() and effects("hr.create_user") == []


def test_ping_a_notification_and_delete_on_a_live_session(gateway):
    headers = initialized(gateway.url, gateway.world.key)
    pinged = requests.post(gateway.url, json={"jsonrpc": "2.0", "id": "p", "method": "ping"}, headers=headers,
                           timeout=10)
    assert pinged.status_code == 200 and pinged.json() == {"jsonrpc": "2.0", "id": "p", "result": {}}
    noted = requests.post(gateway.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                          headers=headers, timeout=10)
    assert noted.status_code == 202 and noted.content == b""
    assert requests.delete(gateway.url, headers=headers, timeout=10).status_code == 204
    gone = requests.post(gateway.url, json={"jsonrpc": "2.0", "id": 3, "method": "ping"}, headers=headers, timeout=10)
    assert gone.status_code == 404 and McpSession.objects.get().ended_at is not None
