"""How a tool is actually called: over HTTP, as an in-process Python callable, or by the agent itself.

Every executor answers with a ToolOutcome or raises ToolError; the engine decides what happens next
(retry, fail, unwind, or answer the agent) from the error's `transient` and `refused` flags, never from the
executor's internals.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import requests
from django.conf import settings

from ledger.executors import egress, signing
from ledger.db import received
from ledger.policy import registry
from ledger import tracing


class ToolError(Exception):
    """A tool call did not succeed. `transient` errors are retried with the same idempotency key."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None, body: Any = None,
                 not_sent: bool = False, applied: bool | None = None, refused: bool = False):
        # The message is stored on the action and shown to the agent: one bounded line, whatever a tool sent.
        message = egress.clean_message(message)
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.status = status
        self.body = body
        self.not_sent = not_sent
        self.applied = applied
        # The tool answered "not carried out, and asking again the same way will not change that" (a 4xx but
        # 408/425/429, or ToolRefused): nothing happened, so the agent may try otherwise (see `Tool.on_refusal`).
        self.refused = refused and not transient

    @property
    def maybe_applied(self) -> bool:
        """Could the tool have acted before this error? A 5xx (but 503) or a timeout leaves it unknown; a 4xx (408
        and 429 included), a 503, a refused connection or a connect timeout mean the request was not carried out.
        An answer refused after the tool acted (a 2xx too large to keep) says so with `applied`."""
        if self.applied is not None:
            return self.applied
        if self.status is not None:
            return self.status >= 500 and self.status != 503
        return self.transient and not self.not_sent

    @property
    def error_class(self) -> str:
        if self.status:
            return f"http_{self.status}"
        if self.refused:
            return "refused"
        if self.transient and self.not_sent:
            # A refused connection, a connect timeout: retried like a timeout, but known not to have acted.
            return "not_sent"
        return "transient" if self.transient else "permanent"


class ToolRefused(ToolError):
    """What an in-process tool raises to say "not carried out": the request was understood and turned down
    ("insufficient funds", "seat taken"), nothing happened, and the same call would be turned down again.

    The in-process twin of an HTTP 4xx (but 408/425/429): the agent is answered with `message` and may
    propose again with other arguments, unless the tool's policy says `on_refusal: unwind`.
    """

    def __init__(self, message: str, *, status: int | None = 422, body: Any = None):
        super().__init__(message, transient=False, status=status, body=body, refused=True)


class UpstreamIsError(ToolError):
    """An upstream MCP tool answered `isError: true`: a refusal, like an HTTP 4xx. Its error class, where it is not
    answered to the agent as `refused` (attempts, `on_refusal: unwind`), is `mcp_is_error`."""

    def __init__(self, message: str, *, body: Any = None):
        super().__init__(message, transient=False, body=body, refused=True)

    @property
    def error_class(self) -> str:
        return "mcp_is_error"


def refusal_status(status: int) -> bool:
    """A 4xx that says the request was not carried out for good (408, 425 and 429 ask to try again later)."""
    return 400 <= status < 500 and status not in (408, 425, 429)


@dataclass(frozen=True)
class ToolOutcome:
    result: Any
    status: int | None = None
    read_back: Any = None  # an `readback.ReadBack` when the result was read back, not answered


def resolve_url(url: str, **fields: str) -> str:
    """Relative tool URLs ("/sandbox/hr/users") are resolved against UNWIND_TOOL_BASE_URL.

    `{target}`-style fields are substituted literally (str.replace, never str.format), so a target id
    cannot reach into anything but its own slot.
    """
    for key, value in fields.items():
        url = url.replace("{" + key + "}", requests.utils.quote(str(value), safe=""))
    if url.startswith("/"):
        url = settings.UNWIND_TOOL_BASE_URL.rstrip("/") + url
    return url


_session = egress.session()


def _send(method: str, url: str, *, timeout: float, **kwargs) -> tuple[requests.Response, bytes]:
    """One request to an allowed origin, no redirects followed, the body read up to the cap within `timeout`.

    Raises ToolError for everything but an answer; a refusal (origin, address, redirect) is permanent
    and means nothing was sent.
    """
    try:
        egress.check_url(url)
    except egress.Refused as why:
        raise ToolError(f"{url} {why}", transient=False, not_sent=True) from None
    deadline = time.monotonic() + timeout
    try:
        response = _session.request(method, url, timeout=timeout, allow_redirects=False, stream=True, **kwargs)
    except egress.Refused as why:
        raise ToolError(f"{url} refused: {why}", transient=False, not_sent=True) from None
    except requests.ConnectTimeout:
        raise ToolError(f"{url} could not be reached within {timeout:g}s", transient=True, not_sent=True) from None
    except requests.Timeout:
        raise ToolError(f"{url} did not answer within {timeout:g}s", transient=True) from None
    except requests.ConnectionError as exc:
        refused = "NewConnectionError" in repr(exc) or "Connection refused" in str(exc)
        raise ToolError(f"{url} could not be reached: {exc.__class__.__name__}", transient=True, not_sent=refused) from None
    except requests.RequestException as exc:
        raise ToolError(f"{url} could not be reached: {exc.__class__.__name__}", transient=True) from None
    if response.is_redirect or 300 <= response.status_code < 400:
        response.close()
        raise ToolError(f"{url} answered {response.status_code}, a redirect: Unwind does not follow redirects "
                        f"(point the policy at the final URL)", transient=False, status=response.status_code)
    try:
        content = egress.read_capped(response, deadline=deadline)
    except egress.TooLarge as cap:
        raise ToolError(f"{url} answered {response.status_code} with a body larger than {cap} "
                        f"(UNWIND_TOOL_MAX_RESPONSE_BYTES); it was not kept", transient=False,
                        status=response.status_code, applied=200 <= response.status_code < 300 or None) from None
    except egress.TooSlow:
        raise ToolError(f"{url} did not finish answering within {timeout:g}s", transient=True) from None
    except requests.RequestException as exc:
        raise ToolError(f"{url} broke off its answer: {exc.__class__.__name__}", transient=True) from None
    return response, content


def _json(content: bytes):
    """The body as JSON, or ValueError (a body nested too deep to parse is no JSON worth keeping either)."""
    try:
        return json.loads(content)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def http_call(
    *, url: str, args: dict, idempotency_key: str, timeout: float, tenant: str, method: str = "POST"
) -> ToolOutcome:
    """POST the args as JSON with an Idempotency-Key header, signed for `tenant`, and classify the answer.

    The body is the args as the agent wrote them (`received.dumps`): `500.0` stays `500.0`, text is not normalised.

    2xx is done; 408, 425, 429, 5xx, timeouts and connection errors are transient; 3xx (never followed)
    and other 4xx are permanent (the same request will never succeed), and a 4xx is a refusal: not carried out.
    """
    body = received.dumps(args).encode()
    headers = {"Idempotency-Key": idempotency_key, "Accept": "application/json", "Content-Type": "application/json",
               **signing.sign(tenant=tenant, method=method, url=url, body=body)}
    tracing.inject(headers)  # the tool's own spans join the step's trace
    response, content = _send(method, url, timeout=timeout, data=body, headers=headers)
    try:
        answer = _json(content) if content else None
    except ValueError:
        answer = {"text": content[:2000].decode("utf-8", "replace")}
    if 200 <= response.status_code < 300:
        return ToolOutcome(result=answer if answer is not None else {}, status=response.status_code)
    transient = response.status_code in (408, 425, 429) or response.status_code >= 500
    detail = ""
    if isinstance(answer, dict):
        detail = str(answer.get("detail") or answer.get("error") or answer.get("title") or "")
    message = f"{url} answered {response.status_code}" + (f": {detail}" if detail else "")
    raise ToolError(message, transient=transient, status=response.status_code, body=answer,
                    refused=refusal_status(response.status_code))


def http_read(*, url: str, timeout: float, tenant: str) -> Any:
    """GET a target's current state (for snapshots and verification), signed for `tenant`. None when it does not exist."""
    headers = {"Accept": "application/json", **signing.sign(tenant=tenant, method="GET", url=url)}
    response, content = _send("GET", url, timeout=timeout, headers=headers)
    if response.status_code in (404, 410):
        return None
    if not 200 <= response.status_code < 300:
        transient = response.status_code in (408, 429) or response.status_code >= 500
        raise ToolError(f"reading {url} answered {response.status_code}", transient=transient, status=response.status_code)
    try:
        return _json(content) if content else None
    except ValueError:
        raise ToolError(f"reading {url} answered {response.status_code} with a body that is not JSON",
                        transient=False, status=response.status_code) from None


def registered(key: str, kind: str):
    """The registered callable policy names by `key`. Nothing is ever imported from a policy string: a key no
    deployer registered (a dotted path written before this rule, say) fails the call for good."""
    try:
        return registry.get(key, kind)
    except registry.NotRegistered as why:
        raise ToolError(str(why), transient=False, not_sent=True) from None


def python_call(*, path: str, args: dict, idempotency_key: str, target: str | None, tenant: str) -> ToolOutcome:
    """Call a registered in-process tool: fn(args, *, idempotency_key, target, tenant) -> JSON-able result.

    The callable raises ToolError for failures it can classify (ToolRefused, or a ToolError with a 4xx status
    but 408/425/429, for a refusal); anything else it raises is treated as permanent, because a bug will not fix
    itself on retry.
    """
    fn = registered(path, "tool")
    try:
        result = fn(dict(args), idempotency_key=idempotency_key, target=target, tenant=tenant)
    except ToolError as error:
        if not error.refused and not error.transient and error.status is not None and refusal_status(error.status):
            error.refused = True
        raise
    except Exception as exc:  # noqa: BLE001 - the tool's own bug, recorded as a permanent failure
        raise ToolError(f"{path} raised {exc.__class__.__name__}: {exc}", transient=False) from None
    return ToolOutcome(result=result if result is not None else {})


def python_read(*, path: str, target: str, tenant: str) -> Any:
    """Call a registered reader: fn(target, *, tenant) -> JSON-able state or None."""
    fn = registered(path, "reader")
    try:
        return fn(target, tenant=tenant)
    except ToolError as error:
        error.refused = False  # a reader that cannot read is no step turned down: only a tool call refuses
        raise
    except Exception as exc:  # noqa: BLE001 - the reader's own bug: the target cannot be read
        raise ToolError(f"{path} raised {exc.__class__.__name__}: {exc}", transient=False) from None


def mcp_call(*, endpoint: str, args: dict, idempotency_key: str, timeout: float, tenant: str) -> ToolOutcome:
    """Call a tool of an upstream MCP server (policy `executor: {kind: mcp, server, tool}`, ledger/executors/mcp.py).

    The args go as the agent sent them; Unwind's idempotency key travels in the request's `_meta` as
    `unwind/idempotency_key` (an upstream that reads it can deduplicate; one that does not declares
    `idempotency.honours_key: false`, the default for MCP tools, and a lost outcome goes to a person).

    A result with `isError: true` is a refusal: the tool answered and did not do it. No session (the origin or
    address refused, nothing listening, a command that will not start) is permanent or transient but never
    sent; a timeout or a connection lost after the request left leaves the outcome unknown (transient).
    A JSON-RPC error (an unknown tool, arguments the server rejects) is permanent: the same call fails again.
    """
    from mcp.shared.exceptions import MCPError
    from mcp_types.jsonrpc import CONNECTION_CLOSED, INTERNAL_ERROR, REQUEST_TIMEOUT

    from ledger.executors import mcp as mcp_upstream

    server_name, tool = mcp_upstream.split_endpoint(endpoint)
    where = f"MCP server {server_name!r} tool {tool!r}"
    try:
        server = mcp_upstream.server(server_name)
    except mcp_upstream.NotDeclared as why:
        raise ToolError(str(why), transient=False, not_sent=True) from None
    if not server.serves(tenant):
        raise ToolError(f"{where} is not declared for tenant {tenant!r}", transient=False, not_sent=True)
    meta = {"unwind/idempotency_key": idempotency_key}
    try:
        result = mcp_upstream.call_tool(server, tool, dict(args), meta=meta, timeout=timeout)
    except mcp_upstream.Unreachable as why:
        raise ToolError(f"{where} could not be reached: {why}", transient=not why.refused, not_sent=True) from None
    except TimeoutError:
        raise ToolError(f"{where} did not answer within {timeout:g}s", transient=True) from None
    except MCPError as exc:
        # The connection closed, the request timed out or the server failed inside: the tool may have acted.
        unknown = exc.error.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT, INTERNAL_ERROR)
        raise ToolError(f"{where} answered error {exc.error.code}: {exc.error.message}", transient=unknown,
                        applied=None if unknown else False) from None
    except Exception as exc:  # noqa: BLE001 - the connection broke after the request may have left
        raise ToolError(f"{where} broke off: {mcp_upstream._describe(exc)}", transient=True) from None
    if result.is_error:
        raise UpstreamIsError(f"{endpoint}: {mcp_upstream.error_text(result)}", body=mcp_upstream.result_value(result))
    value = mcp_upstream.result_value(result)
    cap = settings.UNWIND_TOOL_MAX_RESPONSE_BYTES
    if len(json.dumps(value, ensure_ascii=False).encode()) > cap:
        raise ToolError(f"{where} answered with a result larger than {cap} bytes (UNWIND_TOOL_MAX_RESPONSE_BYTES); "
                        f"it was not kept", transient=False, applied=True)
    return ToolOutcome(result=value)
