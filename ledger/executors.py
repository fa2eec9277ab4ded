"""How a tool is actually called: over HTTP, as an in-process Python callable, or by the agent itself.

Every executor answers with a ToolOutcome or raises ToolError; the engine decides what happens next
(retry, fail, unwind) from the error's `transient` flag, never from the executor's internals.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import requests
from django.conf import settings

from ledger import signing


class ToolError(Exception):
    """A tool call did not succeed. `transient` errors are retried with the same idempotency key."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None, body: Any = None,
                 not_sent: bool = False):
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.status = status
        self.body = body
        self.not_sent = not_sent

    @property
    def maybe_applied(self) -> bool:
        """Could the tool have acted before this error? A 5xx (but 503) or a timeout leaves it unknown; a 4xx (408
        and 429 included), a 503, a refused connection or a connect timeout mean the request was not carried out."""
        if self.status is not None:
            return self.status >= 500 and self.status != 503
        return self.transient and not self.not_sent

    @property
    def error_class(self) -> str:
        if self.status:
            return f"http_{self.status}"
        return "transient" if self.transient else "permanent"


@dataclass(frozen=True)
class ToolOutcome:
    result: Any
    status: int | None = None


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


_session = requests.Session()


def http_call(
    *, url: str, args: dict, idempotency_key: str, timeout: float, tenant: str, method: str = "POST"
) -> ToolOutcome:
    """POST the args as JSON with an Idempotency-Key header, signed for `tenant`, and classify the answer.

    2xx is done; 408, 425, 429, 5xx, timeouts and connection errors are transient; other 4xx are
    permanent (the same request will never succeed).
    """
    body = json.dumps(args, allow_nan=False).encode()
    headers = {"Idempotency-Key": idempotency_key, "Accept": "application/json", "Content-Type": "application/json",
               **signing.sign(tenant=tenant, method=method, url=url, body=body)}
    try:
        response = _session.request(method, url, data=body, headers=headers, timeout=timeout)
    except requests.ConnectTimeout:
        raise ToolError(f"{url} could not be reached within {timeout:g}s", transient=True, not_sent=True) from None
    except requests.Timeout:
        raise ToolError(f"{url} did not answer within {timeout:g}s", transient=True) from None
    except requests.ConnectionError as exc:
        refused = "NewConnectionError" in repr(exc) or "Connection refused" in str(exc)
        raise ToolError(f"{url} could not be reached: {exc.__class__.__name__}", transient=True, not_sent=refused) from None
    except requests.RequestException as exc:
        raise ToolError(f"{url} could not be reached: {exc.__class__.__name__}", transient=True) from None
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = {"text": response.text[:2000]}
    if 200 <= response.status_code < 300:
        return ToolOutcome(result=body if body is not None else {}, status=response.status_code)
    transient = response.status_code in (408, 425, 429) or response.status_code >= 500
    detail = ""
    if isinstance(body, dict):
        detail = str(body.get("detail") or body.get("error") or body.get("title") or "")
    message = f"{url} answered {response.status_code}" + (f": {detail}" if detail else "")
    raise ToolError(message, transient=transient, status=response.status_code, body=body)


def http_read(*, url: str, timeout: float, tenant: str) -> Any:
    """GET a target's current state (for snapshots and verification), signed for `tenant`. None when it does not exist."""
    headers = {"Accept": "application/json", **signing.sign(tenant=tenant, method="GET", url=url)}
    try:
        response = _session.get(url, headers=headers, timeout=timeout)
    except requests.Timeout:
        raise ToolError(f"{url} did not answer within {timeout:g}s", transient=True) from None
    except requests.RequestException as exc:
        raise ToolError(f"{url} could not be reached: {exc.__class__.__name__}", transient=True) from None
    if response.status_code in (404, 410):
        return None
    if not 200 <= response.status_code < 300:
        transient = response.status_code in (408, 429) or response.status_code >= 500
        raise ToolError(f"reading {url} answered {response.status_code}", transient=transient, status=response.status_code)
    return response.json() if response.content else None


def python_callable(dotted_path: str):
    """Import `package.module:function` or `package.module.function`."""
    module_path, sep, attr = dotted_path.partition(":")
    if not sep:
        module_path, _, attr = dotted_path.rpartition(".")
    try:
        return getattr(import_module(module_path), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ToolError(f"callable {dotted_path!r} cannot be imported: {exc}", transient=False) from None


def python_call(*, path: str, args: dict, idempotency_key: str, target: str | None, tenant: str) -> ToolOutcome:
    """Call an in-process tool: fn(args, *, idempotency_key, target, tenant) -> JSON-able result.

    The callable raises ToolError for failures it can classify; anything else it raises is treated
    as permanent, because a bug will not fix itself on retry.
    """
    fn = python_callable(path)
    try:
        result = fn(dict(args), idempotency_key=idempotency_key, target=target, tenant=tenant)
    except ToolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tool's own bug, recorded as a permanent failure
        raise ToolError(f"{path} raised {exc.__class__.__name__}: {exc}", transient=False) from None
    return ToolOutcome(result=result if result is not None else {})


def python_read(*, path: str, target: str, tenant: str) -> Any:
    fn = python_callable(path)
    return fn(target, tenant=tenant)
