"""MCP 2026-07-28 on the same `/mcp` endpoint: stateless requests, beside the handshake revisions (mcp_gateway/http.py).

A request is 2026-07-28's when it carries no `Mcp-Session-Id` and its `Mcp-Protocol-Version` header names no
handshake revision (the official client's probe, `server/discover`, sends `2026-07-28`). There is no `initialize`
and no session: each request carries its protocol version, client info and capabilities in `params._meta`, checked
by the SDK's own ladder (`mcp.shared.inbound.classify_inbound_request`: the `_meta` envelope, the routing headers
equal to the body, a supported version). The run is the client's handle (mcp_gateway/gateway.py).

Policy reads the routing headers before the body: a `tools/call` names its tool in `Mcp-Name`, and a name that is
not a tool this agent may call here (unknown, another tenant's, client-executed, or reserved) is refused before the
body is read, so nothing in its arguments is parsed. The body must then name the same tool (else the ladder's
HEADER_MISMATCH), so the header cannot smuggle a call past the check.

Methods: `server/discover`, `tools/list`, `tools/call`, and the Tasks extension's `tasks/get`, `tasks/update` and
`tasks/cancel` (mcp_gateway/tasks.py). Errors use the spec's status table (`ERROR_CODE_HTTP_STATUS`): 400 for a bad
envelope, a header mismatch, bad params or an unknown task, 404 for an unknown method. Trace context comes from
`_meta`, as over the handshake revisions.
"""
from __future__ import annotations

import json
from functools import partial

import mcp_types as types
from django.http import HttpResponse
from mcp.server.streamable_http import check_accept_headers
from mcp.shared.inbound import ERROR_CODE_HTTP_STATUS, InboundLadderRejection, classify_inbound_request, \
    decode_header_value, validate_mcp_param_headers
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from ledger.api import waits
from ledger.errors import UnwindError
from ledger.models import Agent, Tool
from mcp_gateway import gateway, http, tasks
from mcp_gateway.gateway import Caller
from mcp_gateway.server import INSTRUCTIONS, NAME, VERSION

METHOD_HEADER, NAME_HEADER = "Mcp-Method", "Mcp-Name"
SUPPORTED = [*MODERN_PROTOCOL_VERSIONS, *HANDSHAKE_PROTOCOL_VERSIONS]
CAPABILITIES = types.ServerCapabilities(tools=types.ToolsCapability(list_changed=False),
                                        extensions={tasks.EXTENSION: {}})
SERVER_INFO = {types.SERVER_INFO_META_KEY: {"name": NAME, "version": VERSION}}
TASK_METHODS = ("tasks/get", "tasks/update", "tasks/cancel")


def is_modern(request) -> bool:
    """Whether the request is 2026-07-28's: no session, and a protocol version header that is no handshake one."""
    version = request.headers.get(http.VERSION_HEADER)
    return version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS and \
        http.SESSION_HEADER not in request.headers


def rejected(code: int, message: str, request_id=None, data=None) -> HttpResponse:
    body = http.error(request_id, code, message)
    if data is not None:
        body["error"]["data"] = data
    return http.answer(body, status=ERROR_CODE_HTTP_STATUS.get(code, 200))


def refused_by_name(request, agent: Agent) -> HttpResponse | Tool | bool:
    """The policy the routing headers allow before the body is read: a tools/call names a tool this agent may
    call here (answered with its row, or True for the gateway's own), else it is refused now (INVALID_PARAMS, the
    spec's unknown-tool error) and its body is never parsed. False for any other method."""
    if request.headers.get(METHOD_HEADER) != "tools/call":
        return False
    name = decode_header_value(request.headers.get(NAME_HEADER))
    if not name:
        return rejected(types.HEADER_MISMATCH, "a tools/call needs the tool's name in the Mcp-Name header")
    tool = gateway.callable_tool(agent, name)
    if tool is False:
        return rejected(types.INVALID_PARAMS, f"Unknown tool: {name[:200]} (no tool of that name may be called here)")
    return tool


def serve(request, agent: Agent) -> HttpResponse:
    """One 2026-07-28 POST of an authenticated agent: one JSON-RPC request (or a notification, acknowledged)."""
    if request.method != "POST":
        return http.refuse(405, types.INVALID_REQUEST, "a 2026-07-28 request is a POST (there is no session to end)")
    if request.content_type != http.JSON:
        return http.refuse(415, types.INVALID_REQUEST, "Unsupported Media Type: Content-Type must be application/json")
    wants_json, takes_sse = check_accept_headers(request)
    if not (wants_json or takes_sse):
        return http.refuse(406, types.INVALID_REQUEST, "Not Acceptable: accept application/json or text/event-stream")
    tool = refused_by_name(request, agent)
    if isinstance(tool, HttpResponse):
        return tool
    try:
        message = json.loads(request.body)
    except (ValueError, RecursionError):
        return rejected(types.PARSE_ERROR, "Parse error: the body is not JSON")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or not isinstance(message.get("method"), str):
        return rejected(types.INVALID_REQUEST, "the body must be one JSON-RPC 2.0 request or notification")
    if "id" not in message:
        return HttpResponse(status=202)  # a notification: this revision defines none a server acts on
    request_id = message["id"]
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        return rejected(types.INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    params = message.get("params")
    if not isinstance(params, dict):
        return rejected(types.INVALID_PARAMS, "params must be an object carrying _meta", request_id)
    verdict = classify_inbound_request(message, headers={k.lower(): v for k, v in request.headers.items()})
    if isinstance(verdict, InboundLadderRejection):
        return rejected(verdict.code, verdict.message, request_id, verdict.data)
    meta = params["_meta"]
    caller = Caller(agent_id=agent.pk, session_id="", transport=gateway.STATELESS,
                    base_url=f"{request.scheme}://{request.get_host()}", agent=agent,
                    run_handle=meta.get(gateway.RUN_META_KEY), tool=tool if isinstance(tool, Tool) else None,
                    url_elicitation=takes_url_elicitation(verdict.client_capabilities))
    method = message["method"]
    if method == "server/discover":
        found = types.DiscoverResult(supported_versions=SUPPORTED, capabilities=CAPABILITIES,
                                     instructions=INSTRUCTIONS, _meta=SERVER_INFO)
        return http.answer(http.result(request_id, http.dump(found)), wants_json=wants_json)
    if method == "tools/list":
        listed = types.ListToolsResult(tools=gateway.tool_list(caller))
        return http.answer(http.result(request_id, http.dump(listed)), wants_json=wants_json)
    if method == "tools/call":
        try:
            called = types.CallToolRequestParams.model_validate(params)
        except ValidationError as invalid:
            return rejected(types.INVALID_PARAMS, f"Invalid params: {invalid.errors()[0]['msg']}", request_id)
        if isinstance(tool, Tool):  # `Mcp-Param-*` headers equal the arguments marked `x-mcp-header` (a MUST)
            mismatch = validate_mcp_param_headers(tool.args_schema, called.arguments or {}, request.headers)
            if mismatch is not None:
                return rejected(mismatch.code, mismatch.message, request_id)
        as_task = tasks.declared(verdict.client_capabilities)
        return http.call(caller, request_id, params, wants_json=wants_json, takes_sse=takes_sse,
                         on_loop=waits.served_async(request), instead=partial(instead_of_pending, caller, as_task),
                         called=called)
    if method in TASK_METHODS:
        return task_method(caller, method, params, request_id, wants_json)
    return rejected(types.METHOD_NOT_FOUND, f"Method not found: {method[:100]}", request_id)


def takes_url_elicitation(capabilities) -> bool:
    elicitation = capabilities.get("elicitation") if isinstance(capabilities, dict) else None
    return isinstance(elicitation, dict) and isinstance(elicitation.get("url"), dict)


def instead_of_pending(caller: Caller, as_task: bool, called, outcome) -> dict | None:
    """What a 2026-07-28 tools/call whose step waits answers instead of the pending result: a task handle when the
    client declared the Tasks extension; else, once, a request to open the approval page when the person at the
    client may decide it (mcp_gateway/tasks.py); else nothing (the pending result, as over the handshake)."""
    if called.name == "unwind_status":
        return None
    if as_task:
        return tasks.created(caller, outcome)
    if called.request_state is None:
        return tasks.input_required(caller, outcome)
    return None


def task_method(caller: Caller, method: str, params: dict, request_id, wants_json: bool) -> HttpResponse:
    """tasks/get, tasks/update, tasks/cancel of a task this agent key made; any other is not found."""
    agent = gateway.agent_of(caller)
    try:
        action = tasks.action_of(agent, params.get("taskId"))
    except tasks.TaskNotFound:
        return rejected(types.INVALID_PARAMS, "Task not found", request_id)
    if method == "tasks/cancel":
        try:
            tasks.cancel(caller, action)
        except UnwindError as refused:
            return rejected(types.INVALID_PARAMS, refused.detail, request_id)
    if method == "tasks/get":
        found = {**tasks.task_of(caller, action, params["taskId"]), "resultType": "complete"}
        return http.answer(http.result(request_id, found), wants_json=wants_json)
    return http.answer(http.result(request_id, {"resultType": "complete"}), wants_json=wants_json)
