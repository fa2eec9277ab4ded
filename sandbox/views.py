"""HTTP form of the sandbox: JSON in, JSON out, machine clients only (hence csrf_exempt).

Views only translate HTTP; tools go through `sandbox.tools.call_tool`, reads through `sandbox.selectors`.
"""
import json
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from sandbox import selectors, services
from sandbox.errors import InvalidArgument, NotFound, SandboxError
from sandbox.faults import fault_add, faults_clear
from sandbox.models import ToolName
from sandbox.serializers import fault_json
from sandbox.tools import call_tool

PROBLEM_JSON = "application/problem+json"


def _error(error: SandboxError) -> JsonResponse:
    return JsonResponse(error.as_body(), status=error.status, headers=error.headers, content_type=PROBLEM_JSON)


def _endpoint(**handlers: Callable[..., JsonResponse]):
    """A view that dispatches on the HTTP method and answers refusals as JSON."""

    @csrf_exempt
    def view(request: HttpRequest, **kwargs: Any) -> JsonResponse:
        handler = handlers.get(request.method)
        if handler is None:
            error = SandboxError(
                f"{request.method} is not allowed here; use {', '.join(handlers)}",
                status=405,
                code="method_not_allowed",
                headers={"Allow": ", ".join(handlers)},
            )
            return _error(error)
        try:
            _refuse_nul(request, kwargs)
            return handler(request, **kwargs)
        except SandboxError as error:
            return _error(error)

    return view


def _refuse_nul(request: HttpRequest, path_values: dict[str, str]) -> None:
    """No id or filter contains a NUL character; PostgreSQL could not even compare one."""
    values = [*path_values.values(), *(value for _, values in request.GET.lists() for value in values)]
    if any("\x00" in value for value in values):
        raise InvalidArgument("the path and query must not contain NUL characters")


def _json_body(request: HttpRequest) -> Any:
    if not request.body:
        return {}
    try:
        return json.loads(request.body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidArgument("the request body must be JSON") from None


def _tool(name: str) -> Callable[[HttpRequest], JsonResponse]:
    """POST a tool's arguments as JSON, optionally with an Idempotency-Key header."""

    def post(request: HttpRequest) -> JsonResponse:
        response = call_tool(name, _json_body(request), idempotency_key=request.headers.get("Idempotency-Key"))
        content_type = "application/json" if response.ok else PROBLEM_JSON
        return JsonResponse(response.body, status=response.status, headers=response.headers, content_type=content_type)

    return post


def tool_endpoint(name: str):
    return _endpoint(POST=_tool(name))


def record_endpoint(kind: str, noun: str):
    """GET one record; 404 when it does not exist."""

    def get(request: HttpRequest, record_id: str) -> JsonResponse:
        record = selectors.record_get(kind, record_id)
        if record is None:
            raise NotFound(f"{noun} {record_id} does not exist")
        return JsonResponse(record)

    return _endpoint(GET=get)


def _list_messages(request: HttpRequest) -> JsonResponse:
    messages = selectors.message_list(to=request.GET.get("to"), idempotency_key=request.GET.get("idempotency_key"))
    return JsonResponse({"results": messages})


def _list_tickets(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"results": selectors.record_list("tickets")})


def _state(request: HttpRequest) -> JsonResponse:
    return JsonResponse(selectors.world_state())


def _reset(request: HttpRequest) -> JsonResponse:
    services.sandbox_reset()
    return JsonResponse(selectors.world_state())


def _list_calls(request: HttpRequest) -> JsonResponse:
    raw_limit = request.GET.get("limit", str(selectors.DEFAULT_CALLS_LIMIT))
    if not raw_limit.isdigit() or int(raw_limit) < 1:
        raise InvalidArgument(f"limit must be a positive whole number, not {raw_limit!r}")
    listing = selectors.call_list(
        tool=request.GET.get("tool"), idempotency_key=request.GET.get("idempotency_key"), limit=int(raw_limit)
    )
    return JsonResponse(listing)


def _list_faults(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"results": selectors.record_list("faults")})


def _add_fault(request: HttpRequest) -> JsonResponse:
    return JsonResponse(fault_json(fault_add(_json_body(request))), status=201)


def _clear_faults(request: HttpRequest) -> JsonResponse:
    tool = request.GET.get("tool")
    if tool is None and request.method == "POST":
        body = _json_body(request)
        tool = body.get("tool") if isinstance(body, dict) else None
    return JsonResponse({"cleared": faults_clear(tool=tool or None)})


messages = _endpoint(GET=_list_messages)
tickets = _endpoint(GET=_list_tickets, POST=_tool(ToolName.CRM_CREATE_TICKET))
state = _endpoint(GET=_state)
reset = _endpoint(POST=_reset)
calls = _endpoint(GET=_list_calls)
faults = _endpoint(GET=_list_faults, POST=_add_fault, DELETE=_clear_faults)
faults_clear_view = _endpoint(POST=_clear_faults)
