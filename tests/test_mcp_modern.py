"""MCP 2026-07-28 beside the handshake revisions on one `/mcp` (issue 41): the official SDK client, in 2026-07-28
mode (`server/discover`, no session, the run as a handle) and in handshake mode, against the production server
(gunicorn, four ASGI workers) shared by the module.

Over 2026-07-28 with the Tasks extension, a step that waits for a person is a task: `input_required` while an
approval is pending, `working` while held; `tasks/get` ends with the result, the rejection or the stop, and
`tasks/cancel` during an undo window is the agent's cancel. A task handle is bound to the agent key that made it.
People decide through the approvals service; the worker's clock is `sweep()` in this process.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime
from typing import Any, Literal

import httpx2
import pytest
import requests
from django.utils import timezone
from mcp import Client
from mcp.client.extension import ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ElicitResult, Request, Result, TextContent
from pydantic import TypeAdapter

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.engine.sweep import sweep
from ledger.models import Action, AuditEvent, Run
from ledger.policy.versions import tool_upsert
from ledger.tenancy import agent_create
from mcp_gateway import gateway as gateway_module
from mcp_gateway.models import McpSession
from sandbox.selectors import world_state
from tests.api_support import effects
from tests.conftest import in_process_policy
from tests.helpers import acme
from tests.live_processes import Served

pytest_plugins = ["tests.api_fixtures"]
pytestmark = pytest.mark.slow

USER = {"email": "ashu@example.com", "name": "Ashu Kumar"}
CHARGE = {"customer": "cus_1", "amount_cents": 4900}
TASKS = "io.modelcontextprotocol/tasks"
RAW = TypeAdapter(dict[str, Any])


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory):
    """The production command on the test database, shared by every test of the module."""
    served = Served("gunicorn", tmp_path_factory.mktemp("mcp") / "gunicorn.log", UNWIND_THROTTLE_RATE="100000/min")
    try:
        yield served.start()
    finally:
        served.stop()


@pytest.fixture
def live(api, server):
    api.url = f"{server.url}/mcp"
    api.server = server
    return api


# --- the client's side of the Tasks extension -----------------------------------------------------------------

class CreatedTask(Result):
    """A task handle answered to tools/call (`resultType: "task"`)."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None


class TaskRequest(Request[dict[str, Any], str]):
    """tasks/get, tasks/update, tasks/cancel: the handle goes in Mcp-Name too (the extension's routing header)."""

    name_param = "taskId"


class Tasks(ClientExtension):
    """Declares the extension; a claimed handle is polled to its end (what `Client.call_tool` then answers)."""

    identifier = TASKS

    def claims(self):
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=self.resolve)]

    async def resolve(self, created: CreatedTask, ctx) -> CallToolResult:
        while True:
            task = await task_call(ctx.session, "tasks/get", created.task_id)
            if task["status"] == "completed":
                return CallToolResult.model_validate(task["result"])
            if task["status"] in ("cancelled", "failed"):
                return CallToolResult(content=[TextContent(type="text", text=task.get("statusMessage", ""))],
                                      is_error=True)
            await asyncio.sleep(task["pollIntervalMs"] / 1000)


async def task_call(session, method: str, task_id: str) -> dict:
    return await session.send_request(TaskRequest(method=method, params={"taskId": task_id}), RAW)


@contextlib.asynccontextmanager
async def connected(url: str, key: str, mode: str, *, tasks: bool = True, elicitation=None):
    """The official client: `auto` probes server/discover (2026-07-28 here), `legacy` sends initialize. With an
    `elicitation` callback it declares elicitation (form and URL mode)."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                  timeout=httpx2.Timeout(30, read=60)) as http:
        client = Client(streamable_http_client(url, http_client=http), mode=mode,
                        extensions=[Tasks()] if tasks else None, elicitation_callback=elicitation)
        async with client:
            yield client


def session(live, script, *, mode: str = "auto", key: str | None = None, tasks: bool = True, elicitation=None):
    async def main():
        async with connected(live.url, key or live.world.key, mode, tasks=tasks, elicitation=elicitation) as client:
            return await script(client)
    return asyncio.run(main())


async def in_thread(work, *args, **kwargs):
    """ORM work from the client's event loop, in a thread whose database connection is closed after."""
    return await asyncio.to_thread(gateway_module.in_thread, work, *args, **kwargs)


async def call(client, name, args=None, **options):
    result = await client.call_tool(name, args or {}, **options)
    return result.is_error, result.structured_content


async def call_for_task(client, name, args):
    """A tools/call whose answer may be a task handle (returned as it came) or a tool result."""
    return await client.session.call_tool(name, args, allow_claimed=True)


def decide(world, action_id: int, *, approve: bool, reason: str = "") -> None:
    """A person decides in the inbox: the approvals service, as alice."""
    request = ApprovalRequest.objects.get(action_id=action_id, status="pending")
    approval_decide(request=request, user=world.alice, approve=approve, reason=reason)


def hold(world, tool: str, value) -> None:
    """The tenant's admin gives `tool` an undo window (and no approval)."""
    spec = dict(in_process_policy()["tools"][tool], hold=value, approval="auto")
    tool_upsert(tenant=world.acme, name=tool, spec=spec, actor="test")


def sweep_after(action_id: int) -> dict:
    """Past the step's window, the worker's clock (its queued work runs at commit, in this process)."""
    until = AuditEvent.objects.get(action_ref=action_id, kind="forward.held").data["executes_at"]
    time.sleep(max(0.0, (datetime.fromisoformat(until) - timezone.now()).total_seconds()) + 0.1)
    return sweep()


# --- discover, list, call ---------------------------------------------------------------------------------------

def test_the_official_client_discovers_lists_and_calls_over_2026_07_28_with_no_session(live):
    async def script(client):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        _, begun = await call(client, "unwind_begin", {"goal": "Onboard Ashu", "on_behalf_of": "carol@example.com"})
        _, created = await call(client, "hr.create_user", {**USER, "unwind_run": begun["run_id"]})
        _, again = await call(client, "hr.create_user", USER, meta={"dev.unwind/run": begun["run_id"]})
        refused = await call(client, "hr.create_user", {"email": "b@example.com", "name": "B"})
        _, committed = await call(client, "unwind_commit", {"run_id": begun["run_id"]})
        return client.protocol_version, client.server_capabilities, tools, begun, created, again, refused, committed

    version, capabilities, tools, begun, created, again, refused, committed = session(live, script)
    assert version == "2026-07-28" and TASKS in capabilities.extensions
    assert {"hr.create_user", "payments.charge", "unwind_begin", "unwind_commit"} <= set(tools)
    assert tools["hr.create_user"].input_schema["properties"]["unwind_run"]["type"] == "integer"
    assert tools["unwind_commit"].input_schema["required"] == ["run_id"]
    run = Run.objects.get(pk=begun["run_id"])
    assert run.goal == "Onboard Ashu" and run.agent == live.world.agent
    # The handle as an argument (taken out before the tool saw it) and in _meta: one run, one effect.
    assert created["status"] == "succeeded" and created["run_id"] == run.pk
    assert Action.objects.get(pk=created["action_id"]).args == USER
    assert again["action_id"] == created["action_id"] and again["replayed"] is True
    assert refused == (True, refused[1]) and refused[1]["code"] == "run_required"
    assert committed["run_status"] == "completed" and len(effects("hr.create_user")) == 1
    assert not McpSession.objects.exists()  # nothing of the conversation is kept by a process or a row


def test_the_official_client_in_handshake_mode_is_answered_as_before(live):
    async def script(client):
        tools = [tool.name for tool in (await client.list_tools()).tools]
        return client.protocol_version, tools, await call(client, "hr.create_user", USER)

    version, tools, (is_error, created) = session(live, script, mode="legacy")
    assert version == "2025-11-25" and "unwind_begin" in tools
    assert not is_error and created["status"] == "succeeded"
    assert McpSession.objects.get().run_id == created["run_id"]


# --- a step that waits for a person -------------------------------------------------------------------------------

def test_a_rejected_approval_is_a_task_that_ends_rejected_and_the_run_is_unwound(live):
    async def script(client):
        _, begun = await call(client, "unwind_begin", {"goal": "Onboard and charge"})
        run = {"unwind_run": begun["run_id"]}
        _, created = await call(client, "hr.create_user", {**USER, **run})
        handle = await call_for_task(client, "payments.charge", {**CHARGE, **run})
        polled = await task_call(client.session, "tasks/get", handle.task_id)
        action = await in_thread(Action.objects.get, tool__name="payments.charge")
        await in_thread(decide, live.world, action.pk, approve=False, reason="too much")
        return created, handle, polled, await task_call(client.session, "tasks/get", handle.task_id)

    created, handle, polled, ended = session(live, script)
    approval = ApprovalRequest.objects.get()
    assert isinstance(handle, CreatedTask) and handle.status == "input_required"
    assert f"{live.server.url}/approvals/{approval.pk}/" in handle.status_message
    assert polled["status"] == "input_required" and polled["inputRequests"] == {}
    assert ended["status"] == "completed" and ended["resultType"] == "complete"
    assert ended["result"]["isError"] is True
    outcome = ended["result"]["structuredContent"]
    assert outcome["code"] == "rejected" and "too much" in outcome["message"]
    assert outcome["run_status"] == "compensated"
    assert effects("payments.charge") == []
    assert created["result"]["id"] not in {u["id"] for u in world_state(tenant=acme())["users"]}


def test_an_approved_task_ends_with_the_tools_result(live):
    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        handle = await call_for_task(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})
        action = await in_thread(Action.objects.get, tool__name="payments.charge")
        await in_thread(decide, live.world, action.pk, approve=True)
        return handle, await task_call(client.session, "tasks/get", handle.task_id)

    handle, ended = session(live, script)
    assert handle.status == "input_required"
    assert ended["status"] == "completed" and ended["result"]["isError"] is False
    assert ended["result"]["structuredContent"]["result"]["charge_id"]
    assert len(effects("payments.charge")) == 1


def test_a_held_step_is_a_working_task_and_tasks_cancel_is_the_agents_stop(live):
    hold(live.world, "payments.charge", "30s")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        run = {"unwind_run": begun["run_id"]}
        _, created = await call(client, "hr.create_user", {**USER, **run})
        handle = await call_for_task(client, "payments.charge", {**CHARGE, **run})
        cancelled = await task_call(client.session, "tasks/cancel", handle.task_id)
        ended = await task_call(client.session, "tasks/get", handle.task_id)
        with pytest.raises(MCPError) as again:
            await task_call(client.session, "tasks/cancel", handle.task_id)
        return created, handle, cancelled, ended, again.value

    created, handle, cancelled, ended, again = session(live, script)
    assert handle.status == "working" and "held until" in handle.status_message
    assert cancelled == {"resultType": "complete"}
    charge = Action.objects.get(tool__name="payments.charge")
    assert charge.status == "skipped" and charge.stopped_by == "agent"
    assert ended["status"] == "cancelled" and "compensated" in ended["statusMessage"]
    assert charge.run.status == "compensated" and created["result"]["id"] not in {
        u["id"] for u in world_state(tenant=acme())["users"]}
    assert "already ended" in again.error.message
    assert effects("payments.charge") == []


def test_a_held_step_released_ends_its_task_with_the_result_across_a_restart(live):
    """The task and the run live in the ledger only: the server restarted between the call and the polls, and a
    new client (a new connection, no state) carries on with the handles it kept."""
    hold(live.world, "payments.charge", "2s")

    async def first(client):
        _, begun = await call(client, "unwind_begin", {})
        return begun, await call_for_task(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})

    begun, handle = session(live, first)
    live.server.stop()
    live.server.start()

    async def after(client):
        held = await task_call(client.session, "tasks/get", handle.task_id)
        released = await in_thread(sweep_after, (await in_thread(Action.objects.get, tool__name="payments.charge")).pk)
        ended = await task_call(client.session, "tasks/get", handle.task_id)
        return held, released, ended, await call(client, "unwind_commit", {"run_id": begun["run_id"]})

    held, released, ended, (_, committed) = session(live, after)
    assert handle.status == held["status"] == "working" and released["released"] == 1
    assert ended["status"] == "completed" and ended["result"]["structuredContent"]["status"] == "succeeded"
    assert committed["run_status"] == "completed" and len(effects("payments.charge")) == 1


def test_the_client_resolves_a_task_to_the_tools_result(live):
    """`Client.call_tool` with the extension polls the handle itself and answers the final result."""
    hold(live.world, "payments.charge", "1s")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        resolving = asyncio.ensure_future(call(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]}))
        action = None
        while action is None:
            await asyncio.sleep(0.1)
            action = await in_thread(Action.objects.filter(tool__name="payments.charge").first)
        await in_thread(sweep_after, action.pk)
        return await resolving

    is_error, outcome = session(live, script)
    assert not is_error and outcome["status"] == "succeeded" and len(effects("payments.charge")) == 1


def test_without_the_extension_a_waiting_step_answers_pending_as_today(live):
    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        return await call(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})

    is_error, pending = session(live, script, tasks=False)
    approval = ApprovalRequest.objects.get()
    assert not is_error and pending["pending"] is True and pending["status"] == "awaiting_approval"
    assert pending["approval"]["url"] == f"{live.server.url}/approvals/{approval.pk}/"


# --- handshake mode, the same steps ---------------------------------------------------------------------------------

def test_handshake_mode_a_rejection_unwinds_an_approval_runs_a_held_step_stops_or_runs(live):
    """The same end to end over the handshake revisions: pending answers, unwind_status, unwind_rollback."""
    async def rejected(client):
        _, created = await call(client, "hr.create_user", USER)
        _, pending = await call(client, "payments.charge", CHARGE)
        await in_thread(decide, live.world, pending["action_id"], approve=False, reason="not today")
        return created, pending, await call(client, "unwind_status", {"action_id": pending["action_id"]})

    created, pending, (is_error, outcome) = session(live, rejected, mode="legacy")
    assert pending["pending"] is True and is_error and outcome["code"] == "rejected"
    assert outcome["run_status"] == "compensated" and effects("payments.charge") == []
    assert created["result"]["id"] not in {u["id"] for u in world_state(tenant=acme())["users"]}

    async def approved(client):
        _, pending = await call(client, "payments.charge", CHARGE)
        await in_thread(decide, live.world, pending["action_id"], approve=True)
        return await call(client, "unwind_status", {"action_id": pending["action_id"], "wait": 5})

    is_error, outcome = session(live, approved, mode="legacy")
    assert not is_error and outcome["status"] == "succeeded" and len(effects("payments.charge")) == 1

    hold(live.world, "payments.charge", "1s")

    async def held(client):
        _, stopped = await call(client, "payments.charge", {**CHARGE, "amount_cents": 100})
        _, rolled = await call(client, "unwind_rollback", {"reason": "changed my mind"})
        _, released = await call(client, "payments.charge", {**CHARGE, "amount_cents": 200})
        await in_thread(sweep_after, released["action_id"])
        return stopped, rolled, await call(client, "unwind_status", {"action_id": released["action_id"]})

    stopped, rolled, (is_error, ran) = session(live, held, mode="legacy")
    assert stopped["status"] == "held" and rolled["run_status"] == "compensated"
    assert Action.objects.get(pk=stopped["action_id"]).status == "skipped"
    assert not is_error and ran["status"] == "succeeded" and len(effects("payments.charge")) == 2


# --- attacks ------------------------------------------------------------------------------------------------------

def modern_headers(key: str, method: str, name: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "Mcp-Protocol-Version": "2026-07-28", "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def modern_body(method: str, params: dict, request_id: int = 1) -> dict:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}},
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}}
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**params, "_meta": meta}}


def test_another_agents_key_cannot_poll_or_cancel_a_task(live):
    hold(live.world, "payments.charge", "30s")
    _, neighbour = agent_create(tenant=live.world.acme, name="neighbour")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        return await call_for_task(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})

    handle = session(live, script)
    before = (list(Action.objects.values_list("pk", "status")), list(Run.objects.values_list("pk", "status")),
              AuditEvent.objects.count())
    for key in (neighbour, live.world.other_key):
        for method in ("tasks/cancel", "tasks/get", "tasks/update"):
            params = {"taskId": handle.task_id, **({"inputResponses": {}} if method == "tasks/update" else {})}
            answered = requests.post(live.url, json=modern_body(method, params),
                                     headers=modern_headers(key, method, handle.task_id), timeout=10)
            assert answered.status_code == 400, answered.text
            assert answered.json()["error"] == {"code": -32602, "message": "Task not found"}
    altered = handle.task_id[:-2] + ("AA" if not handle.task_id.endswith("AA") else "BB")
    answered = requests.post(live.url, json=modern_body("tasks/cancel", {"taskId": altered}),
                             headers=modern_headers(live.world.key, "tasks/cancel", altered), timeout=10)
    assert answered.status_code == 400 and answered.json()["error"]["message"] == "Task not found"
    after = (list(Action.objects.values_list("pk", "status")), list(Run.objects.values_list("pk", "status")),
             AuditEvent.objects.count())
    assert after == before and Action.objects.get(tool__name="payments.charge").status == "held"


def test_a_tool_the_agent_may_not_call_is_refused_from_its_headers_before_the_body_is_read(live):
    """Mcp-Name is read before the body: an unknown tool, or another tenant's, is refused even with a body that is
    not JSON (it was never parsed); a body naming another tool than its header is refused by the ladder."""
    from ledger.tenancy import tenant_create

    initech = tenant_create(slug="initech", name="Initech")
    _, stranger = agent_create(tenant=initech, name="stranger")
    cases = [(live.world.key, "no.such_tool"), (live.world.key, "unwind_secret"), (stranger, "hr.create_user")]
    for key, name in cases:
        answered = requests.post(live.url, data=b"{not json", headers=modern_headers(key, "tools/call", name),
                                 timeout=10)
        assert answered.status_code == 400, answered.text
        error = answered.json()["error"]
        assert error["code"] == -32602 and error["message"].startswith(f"Unknown tool: {name}"), error
    smuggled = modern_body("tools/call", {"name": "hr.create_user", "arguments": USER})
    answered = requests.post(live.url, json=smuggled, headers=modern_headers(live.world.key, "tools/call",
                                                                               "unwind_status"), timeout=10)
    assert answered.status_code == 400 and answered.json()["error"]["code"] == -32020  # HEADER_MISMATCH
    unknown = requests.post(live.url, json=modern_body("resources/list", {}),
                            headers=modern_headers(live.world.key, "resources/list"), timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == -32601
    assert not Run.objects.exists() and not Action.objects.exists() and effects("hr.create_user") == []


def test_a_run_handle_of_another_agent_is_not_found(live):
    _, neighbour = agent_create(tenant=live.world.acme, name="neighbour")

    async def mine(client):
        return await call(client, "unwind_begin", {})

    _, begun = session(live, mine)

    async def theirs(client):
        return (await call(client, "hr.create_user", {**USER, "unwind_run": begun["run_id"]}),
                await call(client, "unwind_rollback", {"run_id": begun["run_id"]}),
                await call(client, "hr.create_user", {**USER, "unwind_run": True}))

    (error1, called), (error2, rolled), (error3, bad) = session(live, theirs, key=neighbour)
    assert error1 and called["code"] == "not_found" and error2 and rolled["code"] == "not_found"
    assert error3 and bad["code"] == "validation_error"
    assert Run.objects.get(pk=begun["run_id"]).status == "running" and effects("hr.create_user") == []


@pytest.mark.parametrize("case, status, code", [
    ("no _meta", 400, -32602), ("a version the body does not carry", 400, -32020),
    ("an unsupported version", 400, -32022), ("params not an object", 400, -32602),
    ("a boolean id", 400, -32600), ("a batch", 400, -32600), ("tasks/get without a task", 400, -32602),
    ("tools/call without Mcp-Name", 400, -32020), ("a run handle that is an object", 200, None),
    ("arguments that are a list", 400, -32602)])
def test_the_stateless_transport_refuses_bad_requests_with_a_json_rpc_error(live, case, status, code):
    method, name = ("tasks/get", None) if case == "tasks/get without a task" else ("tools/call", "hr.create_user")
    headers = modern_headers(live.world.key, method, name)
    body = modern_body(method, {} if method == "tasks/get" else {"name": "hr.create_user", "arguments": USER})
    if case == "no _meta":
        del body["params"]["_meta"]
    elif case == "a version the body does not carry":
        body["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = "2025-06-18"
    elif case == "an unsupported version":
        headers["Mcp-Protocol-Version"] = "2099-01-01"
        body["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = "2099-01-01"
    elif case == "params not an object":
        body["params"] = ["x"]
    elif case == "a boolean id":
        body["id"] = True
    elif case == "a batch":
        body = [body]
    elif case == "tools/call without Mcp-Name":
        del headers["Mcp-Name"]
    elif case == "a run handle that is an object":
        body["params"]["_meta"]["dev.unwind/run"] = {"pk": 1}
    elif case == "arguments that are a list":
        body["params"]["arguments"] = [1]
    answered = requests.post(live.url, json=body, headers=headers, timeout=10)
    assert answered.status_code == status, answered.text
    if code is None:  # a tool error the model can read
        assert answered.json()["result"]["structuredContent"]["code"] == "validation_error"
    else:
        assert answered.json()["error"]["code"] == code, answered.json()
    if case == "an unsupported version":
        assert "2026-07-28" in answered.json()["error"]["data"]["supported"]
    assert not Run.objects.exists() and effects("hr.create_user") == []


def test_a_notification_is_acknowledged_and_a_delete_is_refused(live):
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    noted = requests.post(live.url, json=note, headers=modern_headers(live.world.key, "notifications/cancelled"),
                          timeout=10)
    assert noted.status_code == 202 and noted.content == b""
    deleted = requests.delete(live.url, headers=modern_headers(live.world.key, "tools/call"), timeout=10)
    assert deleted.status_code == 405


NUL_NAME = "=?base64?" + __import__("base64").b64encode("hr.create_user\x00x".encode()).decode() + "?="


@pytest.mark.parametrize("case", ["NUL in Mcp-Name", "NUL in an argument", "NUL in the goal", "a huge run handle",
                                  "NUL in a task handle"])
def test_hostile_values_are_refused_never_a_500(live, case):
    method = "tasks/get" if case == "NUL in a task handle" else "tools/call"
    name, params = "hr.create_user", {"name": "hr.create_user", "arguments": {**USER, "unwind_run": 1}}
    if case == "NUL in Mcp-Name":
        name = NUL_NAME
    elif case == "NUL in an argument":
        params["arguments"]["name"] = "Ashu\x00"
    elif case == "NUL in the goal":
        name, params = "unwind_begin", {"name": "unwind_begin", "arguments": {"goal": "x\x00y"}}
    elif case == "a huge run handle":
        params["arguments"]["unwind_run"] = 10 ** 30
    else:
        name, params = "abc\x00".encode().hex(), {"taskId": "abc\x00:def"}
    answered = requests.post(live.url, json=modern_body(method, params),
                             headers=modern_headers(live.world.key, method, name), timeout=10)
    assert answered.status_code < 500, answered.text
    body = answered.json()
    assert "error" in body or body["result"]["isError"] is True, body
    assert not Run.objects.exists() and effects("hr.create_user") == []


def test_a_nul_in_a_tool_name_over_the_handshake_is_a_tool_error(live):
    headers = {"Authorization": f"Bearer {live.world.key}", "Accept": "application/json, text/event-stream"}
    opened = requests.post(live.url, timeout=10, headers=headers, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}})
    headers.update({"Mcp-Session-Id": opened.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": "2025-06-18"})
    answered = requests.post(live.url, timeout=10, headers=headers, json={
        "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "hr.create_user\x00", "arguments": USER}})
    assert answered.status_code == 200, answered.text
    assert answered.json()["result"]["structuredContent"]["code"] == "unknown_tool"
    assert not Run.objects.exists() and effects("hr.create_user") == []


# --- the person at the client (URL-mode elicitation) -------------------------------------------------------------

async def opens_nothing(context, params):
    raise AssertionError(f"the client was asked to open {getattr(params, 'url', params)}")


@pytest.mark.parametrize("person, offered", [("alice", True), ("victor", False), (None, False)])
def test_the_approval_page_is_offered_in_the_task_only_to_a_person_who_may_decide(live, person, offered):
    """The tenant maps the agent's client to a person: an approver (alice) is asked, in the task's input requests,
    to open the approval page; a viewer (victor), or nobody mapped, is not: the approval goes to the approvers."""
    from ledger.tenancy import agent_person_set

    if person is not None:
        agent_person_set(agent=live.world.agent, person=getattr(live.world, person), actor="test")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        handle = await call_for_task(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})
        return handle, await task_call(client.session, "tasks/get", handle.task_id)

    handle, polled = session(live, script, elicitation=opens_nothing)
    approval = ApprovalRequest.objects.get()
    assert handle.status == polled["status"] == "input_required"
    if offered:
        assert polled["inputRequests"] == {f"approval-{approval.pk}": {"method": "elicitation/create", "params": {
            "mode": "url", "url": f"{live.server.url}/approvals/{approval.pk}/",
            "message": "payments.charge waits for your approval. Open the approval page to decide: you decide "
                       "there, signed in as yourself, for exactly these arguments."}}}
    else:
        assert polled["inputRequests"] == {}
    assert approval.status == "pending" and effects("payments.charge") == []


def test_without_tasks_the_client_opens_the_page_and_the_person_decides_there(live):
    """The client is asked once to open the approval page (input required); "accept" means only that it opened:
    the call's retry answers the step as it stands, which is what the person decided on the page."""
    from ledger.tenancy import agent_person_set

    agent_person_set(agent=live.world.agent, person=live.world.alice, actor="test")
    opened = []

    async def person_at_the_client(context, params):
        opened.append(params)
        action = await in_thread(Action.objects.get, tool__name="payments.charge")
        await in_thread(decide, live.world, action.pk, approve=True)  # on the page, signed in as alice
        return ElicitResult(action="accept")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        return await call(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})

    is_error, done = session(live, script, tasks=False, elicitation=person_at_the_client)
    approval = ApprovalRequest.objects.get()
    assert [(p.mode, p.url) for p in opened] == [("url", f"{live.server.url}/approvals/{approval.pk}/")]
    assert not is_error and done["status"] == "succeeded" and done["replayed"] is True
    assert len(effects("payments.charge")) == 1


def test_accepting_without_deciding_leaves_the_step_pending(live):
    from ledger.tenancy import agent_person_set

    agent_person_set(agent=live.world.agent, person=live.world.alice, actor="test")

    async def accepts(context, params):
        return ElicitResult(action="accept")

    async def script(client):
        _, begun = await call(client, "unwind_begin", {})
        return await call(client, "payments.charge", {**CHARGE, "unwind_run": begun["run_id"]})

    is_error, pending = session(live, script, tasks=False, elicitation=accepts)
    assert not is_error and pending["pending"] is True and pending["status"] == "awaiting_approval"
    assert ApprovalRequest.objects.get().status == "pending" and effects("payments.charge") == []


@pytest.mark.django_db
def test_only_a_member_of_the_tenant_can_be_mapped_to_an_agents_client(tools):
    from django.core.management import CommandError, call_command

    from ledger.errors import ValidationFailed
    from ledger.tenancy import agent_person_set

    with pytest.raises(ValidationFailed, match="mallory is not a member of acme"):
        agent_person_set(agent=tools.agent, person=tools.mallory, actor="test")  # globex's admin
    agent = agent_person_set(agent=tools.agent, person=tools.alice, actor="user:ada")
    assert agent.person == tools.alice
    event = AuditEvent.objects.filter(kind="agent.person_set").get()
    assert event.actor == "user:ada" and event.data["person"] == "alice"
    with pytest.raises(CommandError, match="there is no user 'mallory' in acme"):
        call_command("create_agent", "acme", "desktop", "--person", "mallory")
    call_command("create_agent", "acme", "desktop", "--person", "ben")
    assert agent_named("desktop").person == tools.ben


def agent_named(name: str):
    from ledger.models import Agent

    return Agent.objects.select_related("person").get(name=name)
