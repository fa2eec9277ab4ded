"""The Unwind client: every state-changing tool call of an agent goes through `Run.act`.

    unwind = Unwind("http://127.0.0.1:8000", api_key="uw_…")
    with unwind.run(goal="Onboard Ashu", on_behalf_of="carol@company.com") as run:
        user = run.act("hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
        run.act("licenses.provision", {"user_id": user["id"]})

Leaving the block normally completes the run; leaving it with an exception cancels it, which unwinds
what was done. Network failures are retried with the same idempotency key, so a retried call never
acts twice: without an explicit `idempotency_key`, Unwind derives the key from the call's content.
"""
from __future__ import annotations

import json as jsonlib
import logging
import random
import uuid
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from decimal import Decimal
from email.utils import parsedate_to_datetime
from typing import Any

import requests

try:  # the caller's trace continues through Unwind when it traces with OpenTelemetry (docs/observability.md)
    from opentelemetry import propagate as _propagate
except ImportError:  # the client needs only requests
    _propagate = None

from unwind_client.errors import (
    ActionError,
    ApprovalPending,
    InFlight,
    Refused,
    Rejected,
    ReportRequired,
    Unavailable,
    UnwindClientError,
    Unwound,
)

log = logging.getLogger("unwind_client")

RETRY_STATUSES = {502, 503, 504}
MAX_RETRY_AFTER = 30.0  # seconds: a longer Retry-After is waited this long, then asked again
MAX_LONG_POLL = 30.0
PENDING = {"planned", "approved", "running", "retry_scheduled", "held"}
REFUSED_BY_PERSON = {"rejected", "expired"}
FINISHED = {"completed", "compensated", "closed"}


def encode(value: Any) -> bytes:
    """JSON that writes every number as the caller wrote it: a float as Python writes it (`500.0` stays `500.0`), an
    int in full however large, and a `Decimal` with its own digits (`Decimal("0.10")` → `0.10`), so a tool receives
    exactly the number the agent meant. Text is sent as is (UTF-8, never normalised)."""
    parts: list[str] = []
    _encode(value, parts)
    return "".join(parts).encode()


def _encode(value: Any, parts: list[str]) -> None:
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        parts.append(str(value))
    elif isinstance(value, dict):
        parts.append("{")
        for index, (key, item) in enumerate(value.items()):
            parts.append(("," if index else "") + jsonlib.dumps(str(key), ensure_ascii=False) + ":")
            _encode(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _encode(item, parts)
        parts.append("]")
    else:
        parts.append(jsonlib.dumps(value, ensure_ascii=False, allow_nan=False))


class Unwind:
    """A connection to an Unwind server with one agent's API key (or, for `put_tool`/`load_policy`, a deploy key)."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0, retries: int = 4, backoff: float = 0.25,
                 session: requests.Session | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = max(1, retries)
        self.backoff = backoff
        self.session = session or requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {api_key}", "Accept": "application/json",
                                     "User-Agent": "unwind-client/1"})

    # --- transport ------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                headers: dict | None = None, idempotent: bool = True, timeout: float | None = None) -> requests.Response:
        """Send a request, retrying what is safe to retry; raise Refused for a problem answer.

        `idempotent` requests (reads, and writes Unwind deduplicates) are retried after connection errors,
        timeouts and 502/503/504; others only when the request cannot have reached the server. 429 is
        always retried after its Retry-After.
        """
        url = path if path.startswith(("http://", "https://")) else self.base_url + path
        headers = with_trace_context(headers)
        data = None
        if json is not None:
            data = encode(json)
            headers = {"Content-Type": "application/json", **(headers or {})}
        for attempt in range(1, self.retries + 1):
            last = attempt == self.retries
            try:
                response = self.session.request(method, url, data=data, params=params, headers=headers,
                                                 timeout=timeout or self.timeout)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as exc:
                # A body cut off mid-answer (a server process killed while writing it) is a lost answer too.
                if last or not (idempotent or _not_sent(exc)):
                    raise Unavailable(f"{method} {url}: {exc}") from exc
                self._pause(attempt)
                continue
            retryable = response.status_code == 429 or (idempotent and response.status_code in RETRY_STATUSES)
            if retryable and not last:
                self._pause(attempt, response.headers.get("Retry-After"))
                continue
            if response.status_code in RETRY_STATUSES:
                raise Unavailable(f"{method} {url}: HTTP {response.status_code}")
            if response.status_code >= 400:
                raise self._refusal(response)
            return response
        raise Unavailable(f"{method} {url}: no answer")  # the loop always returns or raises before this

    def _pause(self, attempt: int, retry_after: str | None = None) -> None:
        delay = self.backoff * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        asked = retry_after_seconds(retry_after)
        if asked is not None:
            delay = max(delay, min(asked, MAX_RETRY_AFTER))
        time.sleep(delay)

    def _refusal(self, response: requests.Response) -> Refused:
        try:
            problem = response.json()
        except ValueError:
            problem = {}
        if not isinstance(problem, dict):
            problem = {}
        code = problem.get("code") or f"http_{response.status_code}"
        message = problem.get("detail") or response.text[:300] or response.reason
        if code == "in_flight":
            action_id = problem.get("action_id")
            return InFlight(code, message, response.status_code, problem,
                            settle=lambda timeout: self.settle(self.action(action_id), timeout=timeout))
        return Refused(code, message, response.status_code, problem)

    # --- runs ----------------------------------------------------------------------------------

    def run(self, *, goal: str = "", on_behalf_of: str = "", plan: list[str] | None = None,
            intent: dict | None = None) -> Run:
        """Open a run (a declared `plan` of tool names is checked against the ordering law first)."""
        body: dict[str, Any] = {"goal": goal, "on_behalf_of": on_behalf_of}
        if plan is not None:
            body["plan"] = plan
        if intent is not None:
            body["intent"] = intent
        # One key per run() call, reused on our own retries: a retry after a lost answer gets the same run.
        headers = {"Idempotency-Key": f"run-{uuid.uuid4()}"}
        return Run(self, self.request("POST", "/api/v1/runs", json=body, headers=headers).json())

    def get_run(self, run_id: int) -> Run:
        """Attach to an existing run, e.g. after a restart."""
        return Run(self, self.request("GET", f"/api/v1/runs/{run_id}").json())

    # --- actions -------------------------------------------------------------------------------

    def action(self, action_id: int) -> dict:
        return self.request("GET", f"/api/v1/actions/{action_id}").json()

    def wait_for(self, action_id: int, timeout: float | None = None) -> dict:
        """Long-poll until the action settles or `timeout` seconds pass (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = MAX_LONG_POLL if deadline is None else max(0.0, deadline - time.monotonic())
            step = min(MAX_LONG_POLL, remaining)
            response = self.request("GET", f"/api/v1/actions/{action_id}/wait", params={"timeout": round(step, 3)},
                                    timeout=step + self.timeout)
            if response.status_code == 200 or (deadline is not None and time.monotonic() >= deadline):
                return response.json()

    def settle(self, action: dict, *, timeout: float | None = None, execute: Callable[[dict], Any] | None = None,
               sent: dict | None = None) -> Any:
        """Turn an action as Unwind answered it into the tool's result, or the error that says why not.

        `sent` is the args as the agent passed them to `act`: a client-executed tool gets those, not Unwind's
        echo (its canonical form writes `500.0` as `500`)."""
        status = action["status"]
        if status == "succeeded":
            return action["result"]
        if sent is not None:
            action = {**action, "args": sent}
        if action.get("awaiting_report"):
            if execute is None:
                raise ReportRequired(action, report=self.report)
            return self._execute_and_report(action, execute)
        later = self._later(action["id"], execute, sent)
        if status == "awaiting_approval":
            raise ApprovalPending(action, settle=later)
        if status in PENDING:
            settled = self.wait_for(action["id"], timeout)
            if settled["status"] in PENDING and not settled.get("awaiting_report"):
                raise InFlight("in_flight", f"action {action['id']} is still {settled['status']}", 202,
                               {"action_id": action["id"]}, settle=later)
            return self.settle(settled, timeout=timeout, execute=execute, sent=sent)
        if status in REFUSED_BY_PERSON or (status == "skipped" and action.get("stopped_by")):
            raise Rejected(action)
        error = action.get("error") or {}
        if status == "failed" and error.get("error_class") == "refused":
            # The tool turned the call down and the run is still open (it ran in the worker, after an approval,
            # say): the same answer as a proposal's 422 tool_refused, so the agent handles both alike.
            raise Refused("tool_refused", error.get("message", ""), 422, {
                "code": "tool_refused", "reason": error.get("message", ""), "action_id": action.get("id"),
                "run_status": action.get("run_status"), "action": action})
        raise Unwound(action)

    def _later(self, action_id: int, execute: Callable[[dict], Any] | None,
               sent: dict | None = None) -> Callable[[float | None], Any]:
        """What `wait(timeout)` does on a pending action: wait for it, then settle it like `act` would."""

        def wait(timeout: float | None) -> Any:
            deadline = None if timeout is None else time.monotonic() + timeout
            action = self.wait_for(action_id, timeout)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.settle(action, timeout=remaining, execute=execute, sent=sent)

        return wait

    def _execute_and_report(self, action: dict, execute: Callable[[dict], Any]) -> Any:
        try:
            result = execute(action["args"])
        except Exception as exc:
            reported = self.report(action["id"], ok=False, error=f"{type(exc).__name__}: {exc}"[:4000])
            raise Unwound(reported) from exc
        reported = self.report(action["id"], ok=True, result=result)
        return self.settle(reported)

    def report(self, action_id: int, *, ok: bool, result: Any = None, error: str = "") -> dict:
        """Report the outcome of a client-executed tool (a forward step or a compensation)."""
        body: dict[str, Any] = {"ok": ok}
        if ok and result is not None:
            body["result"] = result
        if not ok:
            body["error"] = error
        return self.request("POST", f"/api/v1/actions/{action_id}/report", json=body).json()

    def pending_compensations(self, *, run: int | None = None) -> list[dict]:
        """Compensations of client-executed tools waiting for this agent to run them and `report`."""
        return list(self._pages("/api/v1/compensations/pending", params={"run": run} if run else None))

    def _pages(self, path: str, params: dict | None = None) -> Iterator[dict]:
        page = self.request("GET", path, params=params).json()
        while True:
            yield from page["results"]
            if not page.get("next"):
                return
            page = self.request("GET", page["next"]).json()

    # --- tools ---------------------------------------------------------------------------------

    def tools(self) -> list[dict]:
        return self.request("GET", "/api/v1/tools").json()

    # Writing tools and policy takes a deploy key (`Unwind(url, "uwd_…")`, from manage.py create_deploy_key):
    # an agent's key is refused with 403 agents_cannot_govern, since the policy is the agent's guardrail.

    def put_tool(self, name: str, policy: dict) -> dict:
        """Register or update a tool (with a deploy key)."""
        return self.request("PUT", f"/api/v1/tools/{name}", json=policy).json()

    def load_policy(self, document: dict) -> dict:
        """Load a whole policy document, all or nothing (with a deploy key)."""
        return self.request("POST", "/api/v1/policy", json=document).json()


class Run:
    """One agent workflow. Use it as a context manager: completed on success, cancelled (unwound) on error."""

    def __init__(self, client: Unwind, data: dict):
        self.client = client
        self.id = data["id"]
        self.data = data

    @property
    def status(self) -> str:
        return self.data["status"]

    def refresh(self) -> Run:
        self.data = self.client.request("GET", f"/api/v1/runs/{self.id}").json()
        return self

    def act(self, tool: str, args: dict, *, intent: dict | None = None, target: str | None = None,
            idempotency_key: str | None = None, execute: Callable[[dict], Any] | None = None,
            timeout: float | None = 300.0, repeat_of: int | None = None) -> Any:
        """Put one tool call through Unwind and return the tool's result.

        Raises ApprovalPending (a person must approve: `.url`, `.wait()`), Rejected (`.reason`), Unwound (the step
        failed; the run is unwinding, compensated or needs a person), Refused (`.code`, `.message`), InFlight
        (the same call is still running), ReportRequired (a client-executed tool and no `execute` given).
        For client-executed tools, `execute(args)` is called to run it (with `args` as given here) and its outcome
        is reported. A call with the same content as an earlier step of the run is that step (its result, or
        InFlight while it runs), whatever the key; to do it again on purpose, pass `repeat_of=<that step's id>`.
        """
        body: dict[str, Any] = {"tool": tool, "args": args}
        if repeat_of is not None:
            body["repeat_of"] = repeat_of
        if intent is not None:
            body["intent"] = intent
        if target is not None:
            body["target"] = str(target)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        path = f"/api/v1/runs/{self.id}/actions"
        try:
            response = self.client.request("POST", path, json=body, headers=headers)
        except InFlight as busy:
            if busy.action_id is None:
                raise
            # Our own first attempt got through before its answer was lost (or an earlier step with the same content
            # runs): wait for it, do not redo it.
            ours = busy.problem.get("matched_by") != "content"
            return self.client.settle(self.client.action(busy.action_id), timeout=timeout, execute=execute,
                                      sent=args if ours else None)
        answer = response.json()
        # Our own call: its tool gets our args as we wrote them. A step matched by content runs with its own.
        ours = answer.get("matched_by") != "content"
        return self.client.settle(answer, timeout=timeout, execute=execute, sent=args if ours else None)

    def report(self, action_id: int, *, ok: bool, result: Any = None, error: str = "") -> dict:
        return self.client.report(action_id, ok=ok, result=result, error=error)

    def cancel(self, reason: str = "") -> Run:
        self.data = self.client.request("POST", f"/api/v1/runs/{self.id}/cancel", json={"reason": reason}).json()
        return self

    def complete(self) -> Run:
        self.data = self.client.request("POST", f"/api/v1/runs/{self.id}/complete").json()
        return self

    def trail(self) -> dict:
        """The correction trail: what changed for the end user, and what became of it."""
        return self.client.request("GET", f"/api/v1/runs/{self.id}/trail").json()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.complete()
            return False
        if isinstance(exc, ActionError) and exc.run_status in FINISHED:
            return False  # the failure already finished the run (compensated): there is nothing left to cancel
        try:
            self.cancel(reason=f"{exc_type.__name__}: {exc}"[:1000])
        except UnwindClientError as cancel_failed:
            # The run may have finished meanwhile (a rejection unwinds it): then there was nothing to cancel. Either
            # way the exception that ended the block wins.
            try:
                finished = self.refresh().status in FINISHED
            except UnwindClientError:
                finished = False
            if not finished:
                log.warning("run %s: cancel after %s failed: %s", self.id, exc_type.__name__, cancel_failed)
        return False


def retry_after_seconds(value: str | None) -> float | None:
    """A `Retry-After` header in seconds: delay-seconds (`3`) or an HTTP-date (`Wed, 21 Oct 2026 07:28:00 GMT`, as a
    proxy or load balancer in front of Unwind may send with its 503), RFC 9110 section 10.2.3; None when absent or
    neither."""
    value = (value or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT; `-0000` parses without a zone
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _not_sent(exc: Exception) -> bool:
    """Whether a connection error happened before the request reached the server (safe to retry anything)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = exc.args[0] if exc.args else None
    return type(getattr(reason, "reason", None)).__name__ in ("NewConnectionError", "NameResolutionError")


def with_trace_context(headers: dict | None) -> dict | None:
    """`headers` plus the caller's current W3C trace context (`traceparent`, `tracestate`, `baggage`), if any."""
    if _propagate is None:
        return headers
    carrier: dict = {}
    _propagate.inject(carrier)
    return {**carrier, **(headers or {})} if carrier else headers
