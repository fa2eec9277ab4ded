"""RFC 9457 problem details: one exception handler for the whole API, and their place in the schema.

Every refusal answers `application/problem+json` with `type`, `title`, `status`, `detail` and a stable
machine `code`, plus what the client needs to act on it (`field` and `errors` for validation, the
conflicting `action_id`, the ordering `rule`…). A database that stops answering mid-request (a restart, a
failover, a connection cut) answers 503 with Retry-After: the request's transaction either committed or did not,
and sending it again with the same Idempotency-Key gets what the ledger holds. Anything else not handled here is a
genuine server error.
"""
from __future__ import annotations

import logging

from django.core.exceptions import BadRequest, SuspiciousOperation
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404
from django.http.multipartparser import MultiPartParserError
from drf_spectacular.utils import OpenApiResponse
from django.http import HttpResponse, JsonResponse
from django.template import loader
from django.views.defaults import page_not_found
from rest_framework import exceptions, serializers
from rest_framework.response import Response

from ledger.errors import UnwindError

log = logging.getLogger("unwind.api")

PROBLEM_JSON = "application/problem+json"
DATABASE_RETRY_AFTER = 1  # seconds: a new connection is opened on the next request
STANDARD = ("type", "title", "status", "detail", "code", "instance")

DRF_TITLES = {
    exceptions.ParseError: "Malformed request body",
    exceptions.AuthenticationFailed: "Authentication failed",
    exceptions.NotAuthenticated: "Authentication required",
    exceptions.PermissionDenied: "Not allowed",
    exceptions.NotFound: "Not found",
    exceptions.MethodNotAllowed: "Method not allowed",
    exceptions.NotAcceptable: "Not acceptable",
    exceptions.UnsupportedMediaType: "Unsupported media type",
    exceptions.Throttled: "Too many requests",
}


def problem_type(code: str) -> str:
    return f"urn:unwind:problem:{code}"


def problem(*, status: int, code: str, title: str, detail: str, instance: str = "", **extra) -> dict:
    body = {"type": problem_type(code), "title": title, "status": status, "detail": detail, "code": code}
    if instance:
        body["instance"] = instance
    body.update({key: value for key, value in extra.items() if key not in STANDARD})
    return body


def flatten_errors(detail, prefix: str = "") -> list[dict]:
    """DRF's nested validation detail as a flat list of {field, message, code}."""
    if isinstance(detail, dict):
        found = []
        for key, value in detail.items():
            name = "" if key == "non_field_errors" else str(key)
            found += flatten_errors(value, f"{prefix}.{name}" if prefix and name else prefix or name)
        return found
    if isinstance(detail, list):
        found = []
        for index, value in enumerate(detail):
            nested = isinstance(value, (dict, list))
            found += flatten_errors(value, f"{prefix}[{index}]" if nested else prefix)
        return found
    return [{"field": prefix or None, "message": str(detail), "code": getattr(detail, "code", "invalid")}]


def _validation_problem(exc: exceptions.ValidationError, instance: str) -> dict:
    errors = flatten_errors(exc.detail)
    first = errors[0] if errors else {"field": None, "message": "invalid input"}
    detail = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    return problem(status=400, code="validation_error", title="Invalid input", detail=detail, instance=instance,
                   field=first["field"], errors=errors)


DATABASE_GONE = (OperationalError, InterfaceError)


def database_unavailable(request, exc: Exception) -> dict:
    """The problem for a request the database stopped answering (logged as the server error it is). Its connection
    is marked unusable and closed when the request ends, so the next request opens a new one."""
    instance = request.path if request is not None else ""
    log.error("the database stopped answering during %s %s", getattr(request, "method", ""), instance, exc_info=exc)
    return problem(status=503, code="database_unavailable", title="Database unavailable",
                   detail="the ledger's database stopped answering during this request, so it may or may not have "
                          "been recorded: send it again (with the same Idempotency-Key, where it has one) and the "
                          "ledger answers with what it holds", instance=instance, retry_after=DATABASE_RETRY_AFTER)


class DatabaseUnavailableMiddleware:
    """The same answer for every other view (pages, and the agents' MCP endpoint outside DRF): a problem for the
    API's paths and /mcp, a short page for people, both 503 with Retry-After. The page is rendered without context
    processors, which would ask the database again."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, DATABASE_GONE):
            return None
        body = database_unavailable(request, exception)
        headers = {"Retry-After": str(DATABASE_RETRY_AFTER)}
        if request.path.startswith((*API_PREFIXES, "/mcp")):
            return JsonResponse(body, status=503, content_type=PROBLEM_JSON, headers=headers)
        page = loader.get_template("database_unavailable.html").render({"retry_after": DATABASE_RETRY_AFTER})
        return HttpResponse(page, status=503, headers=headers)


def problem_exception_handler(exc, context):
    request = context.get("request")
    instance = request.path if request is not None else ""
    headers = {}
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("nothing here with that id")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(*exc.args)

    if isinstance(exc, UnwindError):
        body = problem(status=exc.status, code=exc.code, title=exc.title, detail=exc.detail, instance=instance,
                       **exc.extra)
        status = exc.status
        if "retry_after" in exc.extra:
            headers["Retry-After"] = str(exc.extra["retry_after"])
    elif isinstance(exc, exceptions.ValidationError):
        body = _validation_problem(exc, instance)
        status = 400
    elif isinstance(exc, DATABASE_GONE):
        status, body = 503, database_unavailable(request, exc)
        headers["Retry-After"] = str(DATABASE_RETRY_AFTER)
    elif isinstance(exc, exceptions.APIException):
        status = exc.status_code
        code = exc.get_codes() if isinstance(exc.detail, str) else exc.default_code
        title = next((t for cls, t in DRF_TITLES.items() if isinstance(exc, cls)), "Request refused")
        extra = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            retry_after = max(1, int(exc.wait + 0.999))
            headers["Retry-After"] = str(retry_after)
            extra["retry_after"] = retry_after
        if isinstance(exc, exceptions.MethodNotAllowed):
            view = context.get("view")
            if view is not None:
                headers["Allow"] = ", ".join(view.allowed_methods)
        body = problem(status=status, code=str(code), title=title, detail=str(exc.detail), instance=instance, **extra)
    else:
        return None
    return Response(body, status=status, headers=headers)


# --- the schema side ----------------------------------------------------------------------------------

class FieldErrorSerializer(serializers.Serializer):
    field = serializers.CharField(allow_null=True, help_text="Dotted path of the offending field, e.g. args.email.")
    message = serializers.CharField()
    code = serializers.CharField(required=False)


class ProblemSerializer(serializers.Serializer):
    """An RFC 9457 problem: what went wrong, in words and as a stable machine code."""

    type = serializers.CharField(help_text="urn:unwind:problem:<code>")
    title = serializers.CharField()
    status = serializers.IntegerField()
    detail = serializers.CharField(help_text="A sentence saying what was refused and what to do instead.")
    code = serializers.CharField(help_text="Stable machine code (see docs/api.md, Errors).")
    instance = serializers.CharField(required=False, help_text="The request path.")
    field = serializers.CharField(required=False, allow_null=True, help_text="The field a validation error is about.")
    errors = FieldErrorSerializer(many=True, required=False, help_text="Every validation error, per field.")
    action_id = serializers.IntegerField(required=False, help_text="The action an idempotency conflict (or a write to "
                                                                   "an archived run's step) is about.")
    run_id = serializers.IntegerField(required=False, help_text="run_archived: the archived run the write named.")
    archived = serializers.DictField(child=serializers.CharField(), required=False, help_text=(
        "run_archived: when the run was archived (`at`) and the SHA-256 of its segment (`segment`)."))
    rule = serializers.CharField(required=False, help_text="The ordering-law rule that was broken.")
    conflicts_with = serializers.DictField(required=False, help_text="The earlier step it conflicts with: seq, tool.")
    retry_after = serializers.IntegerField(required=False, help_text="Seconds to wait before retrying (429).")


STATUS_CODES = {
    400: "validation_error, parse_error",
    401: "not_authenticated, authentication_failed",
    403: "permission_denied",
    404: "not_found",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "throttled, locked_out (HTTP Basic after too many failed logins)",
}


# Where an archived run is read from its segment (docs/archive.md).
ARCHIVE_UNAVAILABLE = {503: "archive_unavailable: the archived run's segment is missing or no longer hashes to its "
                            "name (run `manage.py verify_audit`); nothing of it is shown"}


def problems(*statuses: int, codes: dict[int, str] | None = None, body: bool = False) -> dict:
    """Schema responses for the problems an endpoint can answer, keyed (status, problem+json).

    Every endpoint can answer 401, 403 and 429; `body=True` adds the request-body problems (400, 413, 415).
    `codes` names the machine codes of endpoint-specific statuses (404, 409, 422…).
    """
    wanted = {401, 403, 429, *statuses}
    if body:
        wanted |= {400, 413, 415}
    described = {**STATUS_CODES, **(codes or {})}
    return {
        (status, PROBLEM_JSON): OpenApiResponse(ProblemSerializer, description=f"Problem; code: {described.get(status, 'see detail')}")
        for status in sorted(wanted)
    }


API_PREFIXES = ("/api/", "/healthz", "/metrics")


def not_found(request, exception=None):
    """Django's 404 for any path: a problem for the API (even a path no route matches), the usual page elsewhere."""
    if request.path.startswith(API_PREFIXES):
        body = problem(status=404, code="not_found", title="Not found",
                       detail=f"{request.path} names nothing here: check the path and the id", instance=request.path)
        return JsonResponse(body, status=404, content_type="application/problem+json")
    return page_not_found(request, exception)


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _nul_in(request) -> tuple[str, str] | None:
    """Where the request carries a NUL character (U+0000) that would reach the database, which PostgreSQL refuses
    in text (a 500) and SQLite would store: ("path", "path"), or ("parameter", its name) for a query parameter's
    name or value or a form field's."""
    if "\x00" in request.path:
        return "path", "path"
    for name, values in request.GET.lists():
        if "\x00" in name or any("\x00" in value for value in values):
            return "parameter", name.replace("\x00", "?")
    # Forms are the pages' (the API takes JSON only and answers any other body 415). A body Django cannot parse is
    # left to the view, which answers it as it always has.
    if request.method not in ("GET", "HEAD", "OPTIONS") and request.content_type in FORM_TYPES \
            and not request.path.startswith(API_PREFIXES):
        try:
            fields = list(request.POST.lists())  # the files' bytes are the files': only the fields are text
        except (MultiPartParserError, SuspiciousOperation, BadRequest):
            return None
        for name, values in fields:
            if "\x00" in name or any("\x00" in value for value in values):
                return "parameter", name.replace("\x00", "?")
    return None


class NulRefusedMiddleware:
    """Every page and endpoint answers a NUL character in its path, query or form with 400 `validation_error` (its
    `field`: the parameter's name, or `path`), before any view or middleware gives it to the database (a JSON body's
    NUL is the parser's parse_error already)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        found = _nul_in(request)
        if found is None:
            return self.get_response(request)
        kind, where = found
        what = "path" if kind == "path" else f"parameter {where!r}"
        detail = (f"the request's {what} holds a NUL character (U+0000), which no value Unwind keeps may contain; "
                  "nothing was done")
        if request.path.startswith((*API_PREFIXES, "/mcp")):
            body = problem(status=400, code="validation_error", title="Invalid input", detail=detail,
                           instance=request.path.replace("\x00", "%00"), field=where)
            return JsonResponse(body, status=400, content_type=PROBLEM_JSON)
        return HttpResponse(f"Bad request: {detail}.", status=400, content_type="text/plain; charset=utf-8")
