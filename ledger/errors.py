"""Refusals an agent or person can act on: a stable machine code, an HTTP status, a sentence."""


class UnwindError(Exception):
    code = "error"
    status = 400
    title = "Request refused"

    def __init__(self, detail: str, **extra):
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class ValidationFailed(UnwindError):
    code, status, title = "validation_error", 400, "Invalid input"


class UnknownTool(UnwindError):
    code, status, title = "unknown_tool", 404, "Unknown tool"


class NotFound(UnwindError):
    code, status, title = "not_found", 404, "Not found"


class OrderingViolation(UnwindError):
    code, status, title = "ordering_violation", 409, "Saga ordering law violated"


class IdempotencyMismatch(UnwindError):
    code, status, title = "idempotency_mismatch", 422, "Idempotency key reused with different arguments"


class StillInFlight(UnwindError):
    code, status, title = "in_flight", 409, "The first request with this key is still running"


class SameContentInFlight(StillInFlight):
    """The same stable code as a key's in-flight duplicate: an agent (and the client) waits on `action_id` either way."""
    title = "An earlier step with the same content is still in flight"


class RepeatMismatch(UnwindError):
    code, status, title = "repeat_of_mismatch", 409, "repeat_of does not name a matching earlier action"


class RunNotActive(UnwindError):
    code, status, title = "run_not_active", 409, "The run accepts no new actions"


class RunArchived(RunNotActive):
    """A write to a run moved to the archive (docs/archive.md): settled for good, readable, never written again."""
    code, status, title = "run_archived", 409, "The run is archived"


class RunCancelled(UnwindError):
    code, status, title = "run_cancelled", 409, "The run was cancelled"


class StateConflict(UnwindError):
    code, status, title = "state_conflict", 409, "The state has moved on"


class TargetUnreadable(UnwindError):
    """The target could not be read for its before-snapshot for a passing reason (a timeout, a lost connection, a
    5xx): nothing was recorded or done, and the same request may simply be sent again (Retry-After)."""
    code, status, title = "target_unreadable", 503, "The target could not be read before acting"


class ArchiveUnavailable(UnwindError):
    """An archived run whose segment cannot be fetched, or no longer hashes to its name (docs/archive.md)."""
    code, status, title = "archive_unavailable", 503, "The archive segment holding it cannot be read"


class TargetMismatch(UnwindError):
    """The agent sent a target its tool's policy does not let it choose (the policy derives it, or names none)."""
    code, status, title = "target_mismatch", 422, "The target is not the agent's to choose"


class TargetNotFound(UnwindError):
    """The agent named a target (`target.from: agent`) that the tool's own read does not find."""
    code, status, title = "target_not_found", 422, "The named target does not exist"


class TooManyOpenApprovals(UnwindError):
    """The agent (or its run) already has as many approval requests waiting for people as the deployment allows."""
    code, status, title = "too_many_open_approvals", 429, "Too many approval requests waiting"


class PermissionDenied(UnwindError):
    code, status, title = "permission_denied", 403, "Not allowed"
