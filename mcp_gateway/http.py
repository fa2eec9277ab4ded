"""MCP's streamable HTTP transport, answered by the Django view from the database: any web process answers any session.

A session is its `McpSession` row, nothing else: `initialize` writes it and answers its id in `Mcp-Session-Id`;
every later request (on any gunicorn worker, on any machine, after any restart) reads the row by that id, checks
that the request's agent holds it and that it was not ended, and carries on with the same run. DELETE ends it.

2026-07-28 requests (stateless, no session) are answered by mcp_gateway/modern.py, which shares `call` below.

The protocol is the handshake revisions' (2024-11-05 to 2025-11-25, `mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS`):
one JSON-RPC message per POST. A request is answered on its own response, as JSON (`application/json`) when the
client accepts it; the one call that waits (`unwind_status` with `wait`, from a client that sent a `progressToken`
and accepts `text/event-stream`) is answered as an event stream: `notifications/progress` about once a second, then
the result. A notification or a response from the client is acknowledged 202. The server sends no requests of its
own and offers no standalone GET stream (the view answers 405, as the spec allows).

Methods: `initialize`, `ping`, `tools/list` and `tools/call` (what the server's `tools` capability promises); any
other answers the JSON-RPC error "method not found". Params are validated with the SDK's own models (`mcp_types`),
and results are built and serialised with them, so the official client reads them as it reads the SDK server's.
Errors of the transport (no session id, an unknown or ended session, a body that is not one JSON-RPC message, an
unsupported `Mcp-Protocol-Version`) answer 4xx with a JSON-RPC error, as the SDK's server does.
"""
from __future__ import annotations

import json
import time

import mcp_types as types
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils import timezone
from mcp.server.streamable_http import check_accept_headers
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION
from pydantic import ValidationError

from ledger.db import sql
from ledger import tracing
from ledger.api import waits
from ledger.api.problems import PROBLEM_JSON, problem
from ledger.models import Agent
from mcp_gateway import gateway, sessions
from mcp_gateway.gateway import Caller
from mcp_gateway.models import McpSession
from mcp_gateway.server import INSTRUCTIONS, NAME, VERSION

SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "Mcp-Protocol-Version"
JSON, SSE = "application/json", "text/event-stream"
CAPABILITIES = types.ServerCapabilities(tools=types.ToolsCapability(list_changed=False))


def dump(model) -> dict:
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def encoded(message: dict) -> bytes:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()


def result(request_id, value: dict) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "result": value}


def error(request_id, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def event(message: dict) -> bytes:
    return b"event: message\ndata: " + encoded(message) + b"\n\n"


def answer(message: dict, *, status: int = 200, wants_json: bool = True, session_id: str | None = None) -> HttpResponse:
    """One JSON-RPC message as the response: JSON, or a one-event stream for a client that takes only SSE."""
    response = (HttpResponse(encoded(message), status=status, content_type=JSON) if wants_json else
                HttpResponse(event(message), status=status, content_type=SSE))
    if session_id is not None:
        response[SESSION_HEADER] = session_id
    return response


def refuse(status: int, code: int, message: str, request_id=None) -> HttpResponse:
    return answer(error(request_id, code, message), status=status)


def serve(request, agent: Agent) -> HttpResponse:
    """A POST (one JSON-RPC message) or DELETE (end the session) of an authenticated agent."""
    if request.method == "DELETE":
        return end(request, agent)
    if request.content_type != JSON:
        return refuse(415, types.INVALID_REQUEST, "Unsupported Media Type: Content-Type must be application/json")
    wants_json, takes_sse = check_accept_headers(request)
    if not (wants_json or takes_sse):
        return refuse(406, types.INVALID_REQUEST, "Not Acceptable: accept application/json or text/event-stream")
    try:
        message = json.loads(request.body)
    except ValueError:
        return refuse(400, types.PARSE_ERROR, "Parse error: the body is not JSON")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return refuse(400, types.INVALID_REQUEST, "Invalid Request: send one JSON-RPC 2.0 message per POST (no "
                                                  "batches)")
    request_id, method = message.get("id"), message.get("method")
    if "id" in message and (isinstance(request_id, bool) or not isinstance(request_id, (str, int))):
        return refuse(400, types.INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    params = message.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return refuse(400, types.INVALID_PARAMS, "Invalid params: params must be an object", request_id)
    if method == "initialize" and "id" in message:
        return initialize(request, agent, request_id, params, wants_json)
    version = request.headers.get(VERSION_HEADER)
    if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return refuse(400, types.INVALID_REQUEST, f"Bad Request: unsupported protocol version {version!r} (supported: "
                                                  f"{', '.join(HANDSHAKE_PROTOCOL_VERSIONS)})", request_id)
    session = session_for(request, agent)
    if isinstance(session, HttpResponse):
        return session
    if "id" not in message or not isinstance(method, str):
        return HttpResponse(status=202)  # a notification, or a client's response: nothing to answer
    caller = Caller(agent_id=agent.pk, session_id=session.session_id, transport=McpSession.HTTP,
                    base_url=f"{request.scheme}://{request.get_host()}",
                    agent=agent, session=session)
    if method == "tools/call":
        return call(caller, request_id, params, wants_json=wants_json, takes_sse=takes_sse,
                    on_loop=waits.served_async(request))
    if method == "tools/list":
        listed = types.ListToolsResult(tools=gateway.tool_list(caller))
        return answer(result(request_id, dump(listed)), wants_json=wants_json)
    if method == "ping":
        return answer(result(request_id, {}), wants_json=wants_json)
    return answer(error(request_id, types.METHOD_NOT_FOUND, f"Method not found: {method}"), wants_json=wants_json)


def initialize(request, agent: Agent, request_id, params: dict, wants_json: bool) -> HttpResponse:
    """Open a session: its row is written (within the agent's cap, mcp_gateway/sessions.py), and its id goes back in
    Mcp-Session-Id for every later request."""
    try:
        offered = types.InitializeRequestParams.model_validate(params)
    except ValidationError as invalid:
        return refuse(400, types.INVALID_PARAMS, f"Invalid params: {invalid.errors()[0]['msg']}", request_id)
    version = offered.protocol_version if offered.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS else \
        LATEST_HANDSHAKE_VERSION
    session = sessions.session_open(agent=agent)  # past the agent's cap, its least recently used session ends
    opened = types.InitializeResult(protocol_version=version, capabilities=CAPABILITIES, instructions=INSTRUCTIONS,
                                    server_info=types.Implementation(name=NAME, version=VERSION))
    return answer(result(request_id, dump(opened)), wants_json=wants_json, session_id=session.session_id)


def session_for(request, agent: Agent) -> McpSession | HttpResponse:
    """The request's session: its row, if this agent holds it and it was not ended. Another agent's session, an
    ended one and an unknown id are told apart to no one: 404, as the spec says for a session that is gone."""
    session_id = request.headers.get(SESSION_HEADER)
    if not session_id:
        return refuse(400, types.INVALID_REQUEST, "Bad Request: Missing Mcp-Session-Id (send initialize first)")
    session = sql.get(McpSession, session_id=session_id)
    if session is None or session.agent_id != agent.pk or session.transport != McpSession.HTTP or \
            session.ended_at is not None:
        return refuse(404, types.INVALID_REQUEST, "Session not found")
    return session


def end(request, agent: Agent) -> HttpResponse:
    """DELETE: the session ends; its id answers 404 after. Its run stays as it is: take it up in a new session with
    unwind_begin {run_id}, or leave it to the idle sweep (docs/mcp.md)."""
    session = session_for(request, agent)
    if isinstance(session, HttpResponse):
        return session
    McpSession.objects.filter(pk=session.pk, ended_at__isnull=True).update(ended_at=timezone.now())
    return HttpResponse(status=204)


def call(caller: Caller, request_id, params: dict, *, wants_json: bool, takes_sse: bool,
         on_loop: bool, instead=None, called: types.CallToolRequestParams | None = None) -> HttpResponse:
    """tools/call: the gateway's dispatch, answered at once; only unwind_status {wait} waits for its step, holding one
    of the agent's wait slots (429 too_many_waits past UNWIND_MAX_WAITS_PER_AGENT), on the event loop under the ASGI
    server (`on_loop`), in this thread under WSGI. `instead` (2026-07-28, mcp_gateway/modern.py) may answer a step
    that waits otherwise: a task handle, or a request to open the approval page (mcp_gateway/tasks.py)."""
    try:
        called = called or types.CallToolRequestParams.model_validate(params)
    except ValidationError as invalid:
        return answer(error(request_id, types.INVALID_PARAMS, f"Invalid params: {invalid.errors()[0]['msg']}"),
                      wants_json=wants_json)
    with tracing.mcp_call(params.get("_meta"), called.name):
        outcome = gateway.dispatch(caller, called.name, called.arguments)
    replaced = instead(called, outcome) if instead is not None and outcome.waiting is not None else None
    if replaced is not None:
        return answer(result(request_id, replaced), wants_json=wants_json)
    bound = gateway.waiting_bound(called.name, called.arguments)
    if outcome.waiting is None or bound <= 0:
        return answer(result(request_id, dump(gateway.result_of(outcome))), wants_json=wants_json)
    try:
        slot = waits.wait_slot_take(holder=waits.holder_of(caller), seconds=bound)
    except waits.TooManyWaits as refused:
        return too_many_waits(refused)

    def settled_answer(_settled: bool = True) -> HttpResponse:
        final = gateway.answer_for(caller, outcome.waiting)
        return answer(result(request_id, dump(gateway.result_of(final))), wants_json=wants_json)

    token = (params.get("_meta") or {}).get("progressToken")
    if token is None or not takes_sse:
        if on_loop:
            waits.wait_started()
            return waits.pending(action_id=outcome.waiting, deadline=time.monotonic() + bound, slot=slot,
                                 answer=settled_answer)
        try:
            for _ in gateway.progress(caller, outcome, bound):
                pass
        finally:
            waits.wait_slot_release(slot)
        return settled_answer()

    def notice(waited: float, total: float, message: str) -> bytes:
        return event({"jsonrpc": "2.0", "method": "notifications/progress", "params": {
            "progressToken": token, "progress": waited, "total": total, "message": message}})

    def final_event() -> bytes:
        return event(result(request_id, dump(gateway.result_of(gateway.answer_for(caller, outcome.waiting)))))

    def events():
        try:
            for step in gateway.progress(caller, outcome, bound):
                yield notice(*step)
        finally:
            waits.wait_slot_release(slot)
        yield final_event()

    async def events_on_loop():
        waits.let_go_of_the_request_thread()  # streamed after the view returned, in the request's context
        try:
            async for step in gateway.progress_on_loop(outcome, bound):
                yield notice(*step)
        finally:
            await waits.in_lane(waits.wait_slot_release)(slot)
        yield await waits.in_lane(final_event)()

    if on_loop:
        waits.wait_started()
    response = StreamingHttpResponse(events_on_loop() if on_loop else events(), content_type=SSE)
    response["Cache-Control"] = "no-cache, no-transform"
    response["X-Accel-Buffering"] = "no"  # progress is sent as it comes, not after the answer (nginx)
    return response


def too_many_waits(refused: waits.TooManyWaits) -> HttpResponse:
    """429 problem+json with Retry-After, as the agent key's throttle answers (mcp_gateway/views.py)."""
    body = problem(status=refused.status, code=refused.code, title=refused.title, detail=refused.detail,
                   instance="/mcp", **refused.extra)
    response = JsonResponse(body, status=refused.status, content_type=PROBLEM_JSON)
    response["Retry-After"] = str(refused.extra["retry_after"])
    return response
