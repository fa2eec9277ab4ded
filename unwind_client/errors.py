"""What `Run.act` raises instead of returning the tool's result: each says what happened and what to do."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UnwindClientError(Exception):
    """Base class of everything the client raises."""


class Unavailable(UnwindClientError):
    """Unwind could not be reached (or answered 5xx) after the client's retries."""


class Refused(UnwindClientError):
    """Unwind refused the request: `code` is the stable machine code, `message` the sentence saying why."""

    def __init__(self, code: str, message: str, status: int, problem: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.problem = problem or {}


class InFlight(Refused):
    """The same logical action (same Idempotency-Key) is still running; `wait()` for its outcome."""

    def __init__(self, code: str, message: str, status: int, problem: dict | None, *, settle: Callable[[float | None], Any]):
        super().__init__(code, message, status, problem)
        self.action_id = (problem or {}).get("action_id")
        self._settle = settle

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the running action and return its result (or raise what `act` would)."""
        return self._settle(timeout)


class ActionError(UnwindClientError):
    """An action that did not simply succeed: carries the action as Unwind recorded it."""

    def __init__(self, message: str, action: dict):
        super().__init__(message)
        self.action = action
        self.action_id = action.get("id")
        self.run_id = action.get("run")
        self.run_status = action.get("run_status")


class ApprovalPending(ActionError):
    """The action waits for a person. Send them `url`; `wait(timeout)` returns the result once approved."""

    def __init__(self, action: dict, *, settle: Callable[[float | None], Any]):
        approval = action.get("approval") or {}
        self.url = approval.get("url")
        self.approval_id = approval.get("id")
        super().__init__(f"{action.get('tool')} (action {action.get('id')}) waits for approval at {self.url}", action)
        self._settle = settle

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the decision; return the tool's result, or raise Rejected (or ApprovalPending again on timeout)."""
        return self._settle(timeout)


class Rejected(ActionError):
    """A person rejected the action (or the approval expired, or someone stopped it while it was held: its
    `stopped_by` says who); `reason` is theirs (or says who stopped it)."""

    def __init__(self, action: dict):
        self.reason = action.get("decision_reason") or ""
        super().__init__(f"{action.get('tool')} (action {action.get('id')}) was {action.get('status')}: {self.reason}",
                         action)


class Unwound(ActionError):
    """The step failed (or was skipped or undone): the run is being unwound, is compensated, or needs a person.

    `run_status` says which: unwinding, compensated or needs_attention. `error` is the step's error message.
    """

    def __init__(self, action: dict):
        error = action.get("error") or {}
        self.error = error.get("message", "")
        self.error_class = error.get("error_class", "")
        super().__init__(f"{action.get('tool')} (action {action.get('id')}) {action.get('status')}"
                         f"{': ' + self.error if self.error else ''}; the run is {action.get('run_status')}", action)


class ReportRequired(ActionError):
    """A client-executed tool: run it yourself with `tool_args`, then `report(ok=..., result=...|error=...)`."""

    def __init__(self, action: dict, *, report: Callable[..., dict]):
        super().__init__(f"{action.get('tool')} is executed by the agent: run it and report action {action.get('id')}",
                         action)
        self.tool = action.get("tool")
        self.tool_args = action.get("args")  # not `args`: that is the exception's own message tuple
        self._report = report  # the client's `report`, handed in (as `settle` is above): errors know no client

    def report(self, *, ok: bool, result: Any = None, error: str = "") -> dict:
        return self._report(self.action_id, ok=ok, result=result, error=error)
