"""HTTP form of the sandbox: JSON in, JSON out (hence csrf_exempt; `sandbox.access` checks CSRF itself for
requests a browser session makes).

Views only translate HTTP; who may call what, and in which tenant's world, is decided by `sandbox.access`
before any handler runs; tools go through `sandbox.tools.call_tool`, reads through `sandbox.selectors`.
"""
import functools
import json
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from ledger.models import Role, Tenant
from sandbox import access, selectors, services
from sandbox.errors import InvalidArgument, NotFound, SandboxError
from sandbox.faults import fault_add, faults_clear
from sandbox.models import ToolName
from sandbox.serializers import fault_json
from sandbox.tools import call_tool

PROBLEM_JSON = "application/problem+json"

# Who may call a handler, as the function that finds the tenant it acts in (or refuses).
TOOL = access.tool_caller_tenant
READER = access.reader_tenant
VIEWER = functools.partial(access.person_tenant, role=Role.VIEWER)
OPERATOR = functools.partial(access.person_tenant, role=Role.OPERATOR)


def _error(error: SandboxError) -> JsonResponse:
    return JsonResponse(error.as_body(), status=error.status, headers=error.headers, content_type=PROBLEM_JSON)


def _endpoint(**handlers: tuple[Callable[[HttpRequest], Tenant], Callable[..., JsonResponse]]):
    """A view that dispatches on the HTTP method, finds the caller's tenant, and answers refusals as JSON.

    Each handler is (who may call it, the handler); the handler gets the tenant as `tenant=`.
    """

    @csrf_exempt
    def view(request: HttpRequest, **kwargs: Any) -> JsonResponse:
        try:
            access.require_sandbox_on()
        except SandboxError as error:
            return _error(error)
        allowed = handlers.get(request.method)
        if allowed is None:
            error = SandboxError(
                f"{request.method} is not allowed here; use {', '.join(handlers)}",
                status=405,
                code="method_not_allowed",
                headers={"Allow": ", ".join(handlers)},
            )
            return _error(error)
        who, handler = allowed
        try:
            _refuse_nul(request, kwargs)
            return handler(request, tenant=who(request), **kwargs)
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

    def post(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
        response = call_tool(name, _json_body(request), tenant=tenant,
                             idempotency_key=request.headers.get("Idempotency-Key"))
        content_type = "application/json" if response.ok else PROBLEM_JSON
        return JsonResponse(response.body, status=response.status, headers=response.headers, content_type=content_type)

    return post


def tool_endpoint(name: str):
    return _endpoint(POST=(TOOL, _tool(name)))


def record_endpoint(kind: str, noun: str):
    """GET one record; 404 when it does not exist."""

    def get(request: HttpRequest, record_id: str, *, tenant: Tenant) -> JsonResponse:
        record = selectors.record_get(kind, record_id, tenant=tenant)
        if record is None:
            raise NotFound(f"{noun} {record_id} does not exist")
        return JsonResponse(record)

    return _endpoint(GET=(READER, get))


def _list_messages(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    messages = selectors.message_list(tenant=tenant, to=request.GET.get("to"),
                                      idempotency_key=request.GET.get("idempotency_key"))
    return JsonResponse({"results": messages})


def _list_tickets(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    return JsonResponse({"results": selectors.record_list("tickets", tenant=tenant)})


def _state(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    return JsonResponse(selectors.world_state(tenant=tenant))


def _reset(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    services.sandbox_reset(tenant=tenant)
    return JsonResponse(selectors.world_state(tenant=tenant))


def _list_calls(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    raw_limit = request.GET.get("limit", str(selectors.DEFAULT_CALLS_LIMIT))
    if not raw_limit.isdigit() or int(raw_limit) < 1:
        raise InvalidArgument(f"limit must be a positive whole number, not {raw_limit!r}")
    listing = selectors.call_list(
        tenant=tenant,
        tool=request.GET.get("tool"), idempotency_key=request.GET.get("idempotency_key"), limit=int(raw_limit)
    )
    return JsonResponse(listing)


def _list_faults(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    return JsonResponse({"results": selectors.record_list("faults", tenant=tenant)})


def _add_fault(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    return JsonResponse(fault_json(fault_add(_json_body(request), tenant=tenant)), status=201)


def _clear_faults(request: HttpRequest, *, tenant: Tenant) -> JsonResponse:
    tool = request.GET.get("tool")
    if tool is None and request.method == "POST":
        body = _json_body(request)
        tool = body.get("tool") if isinstance(body, dict) else None
    return JsonResponse({"cleared": faults_clear(tenant=tenant, tool=tool or None)})


messages = _endpoint(GET=(READER, _list_messages))
tickets = _endpoint(GET=(READER, _list_tickets), POST=(TOOL, _tool(ToolName.CRM_CREATE_TICKET)))
state = _endpoint(GET=(VIEWER, _state))
reset = _endpoint(POST=(OPERATOR, _reset))
calls = _endpoint(GET=(VIEWER, _list_calls))
faults = _endpoint(GET=(VIEWER, _list_faults), POST=(OPERATOR, _add_fault), DELETE=(OPERATOR, _clear_faults))
faults_clear_view = _endpoint(POST=(OPERATOR, _clear_faults))
