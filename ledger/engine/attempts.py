"""Attempts and leases: who holds a step now, what its attempts say, and whether one may have acted.

The lowest layer of the engine (docs/architecture.md): everything else records attempts and reads leases through
it, and it imports nothing of the engine above it.
"""
from __future__ import annotations

import logging
import random
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from ledger.audit.chain import AuditLog
from ledger.db import sql
from ledger.db.partitions import recent
from ledger.engine import leases
from ledger.engine.leases import queued_seconds
from ledger.executors.call import ToolError
from ledger.models import Action, ActionKind, ActionStatus as A, Attempt, CompensationStrategy, Run, Tool

log = logging.getLogger("unwind.engine")


SYSTEM = "system:engine"


PENDING = (A.PLANNED, A.APPROVED, A.AWAITING_APPROVAL, A.RETRY_SCHEDULED, A.HELD)


REFUSED = "refused"  # the error_class of a step the tool turned down and the agent was answered about


def lease_until(seconds: float | None = None):
    """A lease as the caller decides it, on the process clock: only for a one-call function, which moves it to start
    after its locks (from `p_at`). Every other claim takes its lease at the write (`leases.lease_at_write`)."""
    return timezone.now() + timedelta(seconds=seconds or settings.UNWIND_LEASE_SECONDS)


def queued_lease(tool: Tool):
    """The lease of an action claimed here but run by a worker task: the tool's timeout plus time in the queue."""
    return lease_until(queued_seconds(tool))


def backoff_delay(tool: Tool, attempt: int) -> float:
    """Exponential backoff with full jitter, capped."""
    base = tool.backoff_seconds * (2 ** max(0, attempt - 1))
    return min(settings.UNWIND_MAX_BACKOFF, random.uniform(base / 2, base))


# Waiting for a tool that is down: an undo, and a step whose call never left (a refused connection, a connect
# timeout), are tried again for minutes before a person is asked (issue 39). The tool's own retry policy is for a
# tool that answered; a tool that is being restarted answers nothing for a while, and an undo that gives up in a
# second hands a person work the engine would have done a minute later. Never sending twice is not at stake: an
# undo carries its own idempotency key, and a call that never left did nothing.

def patient(action: Action, error: ToolError) -> bool:
    """Is this failure one the engine waits out (UNWIND_RETRY_PATIENCE; 0: none is) rather than counting it against
    the tool's `retry.max_attempts` alone? Its retries are always scheduled, never slept through in a thread: the
    wait is the ledger's (`next_attempt_at`), and the sweep sends the step when it falls due."""
    return settings.UNWIND_RETRY_PATIENCE > 0 and error.transient and (
        action.kind == ActionKind.COMPENSATION or error.not_sent)


def retry_delay(action: Action, error: ToolError) -> float:
    """How long before the next attempt: the tool's backoff, or, for a failure the engine waits out, an exponential one
    from UNWIND_PATIENT_BACKOFF (5 s, 10 s, 20 s, …), each capped at UNWIND_MAX_BACKOFF, with full jitter below the
    cap too, so that steps that failed together in an outage do not all come back at the same instant."""
    own = backoff_delay(action.tool, action.attempts)
    if not patient(action, error):
        return own
    base = min(settings.UNWIND_MAX_BACKOFF, settings.UNWIND_PATIENT_BACKOFF * (2 ** min(30, max(0, action.attempts - 1))))
    return max(own, random.uniform(base / 2, base))


MOST_ATTEMPTS = 32000  # what Action.attempts can count to (a small integer), with room for a person's retries


def keep_trying(action: Action, error: ToolError, *, owner: str, delay: float) -> bool:
    """A failure the engine waits out, on a step whose attempts are spent: while its next attempt would still start
    within UNWIND_RETRY_PATIENCE seconds of its first, it gets one more (`max_attempts` raised on its row while the
    lease is still `owner`'s), so `outcomes.record_failure` schedules a retry instead of asking a person. True when
    it did."""
    if not patient(action, error) or action.attempts < action.max_attempts or action.attempts >= MOST_ATTEMPTS:
        return False
    first = Attempt.objects.filter(action=action, started_at__gte=recent(action.created_at)).order_by("number").values_list("started_at", flat=True).first()
    if first is None or (timezone.now() - first).total_seconds() + delay > settings.UNWIND_RETRY_PATIENCE:
        return False
    if Action.objects.filter(pk=action.pk, status=A.RUNNING, lease_owner=owner).update(
            max_attempts=action.attempts + 1) != 1:
        return False
    action.max_attempts = action.attempts + 1
    return True


AMBIGUOUS_ATTEMPT = (Q(outcome="lost") | Q(outcome="settle_failed") | Q(error_class="transient")
                     | Q(outcome="unanswered_last_try")
                     | (Q(error_class__startswith="http_5") & ~Q(error_class="http_503")))


def attempts_that_may_have_acted(action: Action):
    """The finished attempts that ended without telling whether the tool acted (no answer, a lost worker, a 5xx but
    503), leaving out those that never left Unwind (a tool that ignores keys records when an attempt is sent; for
    one that honours them a new attempt is the same call again, whatever the earlier ones did) and those a person
    set aside by deciding the tool did not act and sending the step again (`resend_by`)."""
    of_it = Attempt.objects.filter(action=action, started_at__gte=recent(action.created_at))
    attempts = of_it.filter(finished_at__isnull=False).filter(AMBIGUOUS_ATTEMPT)
    if not action.tool.honours_idempotency_key:
        attempts = attempts.filter(sent_at__isnull=False)
    decided = (of_it.exclude(resend_by="").order_by("-number")
               .values_list("number", flat=True).first())
    return attempts if decided is None else attempts.filter(number__gte=decided)


def an_attempt_may_have_acted(action: Action) -> bool:
    """Did an attempt end without telling whether the tool acted? Then a later clean refusal (a 429, say) does not
    prove the step never took effect."""
    return attempts_that_may_have_acted(action).exists()


def needs_read_back(action: Action) -> bool:
    """A retry or reclaim of a tool that ignores idempotency keys must first check it did not already act, when an
    earlier attempt was sent and may have (one never sent, or answered cleanly, did nothing)."""
    return action.attempts > 1 and not action.tool.honours_idempotency_key and an_attempt_may_have_acted(action)


def settles_at(action: Action):
    """When the last sent attempt of a key-ignoring tool that got no answer is surely over, or None when it is.

    An attempt that got an answer (even a 5xx) is over: the server finished with it, so reading back now
    is reliable. One that got none (a read timeout, a dropped connection, a lost worker) may still be
    running at the server; reading back before it ends could miss its effect and send it again. It is
    over once twice the tool's timeout has passed since it was sent; then a read-back that finds nothing means
    nothing can still arrive, and the step is sent again under a new attempt.
    """
    previous = (attempts_that_may_have_acted(action).exclude(error_class__startswith="http_")
                .order_by("-number").only("started_at", "sent_at").first())
    if previous is None:
        return None
    until = (previous.sent_at or previous.started_at) + timedelta(seconds=2 * action.tool.timeout_seconds + 1)
    return until if until > leases.db_now() else None  # sent_at is the database's clock


MARK_SENT = ("UPDATE ledger_attempt SET sent_at = {now} WHERE {attempt}"
             " AND EXISTS (SELECT 1 FROM ledger_action WHERE id = %s AND status = %s AND lease_owner = %s"
             " AND lease_expires_at > {now})")


def mark_sent(action: Action, owner: str) -> bool:
    """Fencing before a call that cannot be deduplicated, and the ledger's record that it left: the attempt is
    marked sent, in one statement, only while the lease is still ours and has not run out (a thread starved past
    its lease must not send after the sweep has already handed the step to someone else). The sweep's reclaim
    closes the same attempt row (`actions.action_reclaim`), so one of the two waits for the other: either the
    attempt was sent under a lease still held, or it was never sent and is sent again."""
    now, at = leases.now_in_sql()  # the lease was written on the database's clock: judged on it too
    with connection.cursor() as cursor:
        attempt, params = sql.conditions(Attempt, open_attempt(action))
        cursor.execute(MARK_SENT.format(now=now, attempt=attempt), [*at, *params, action.pk, A.RUNNING, owner, *at])
        return cursor.rowcount == 1


_TENANT_THRESHOLD = "(SELECT approval_threshold FROM ledger_tenant WHERE ledger_tenant.id = ledger_run.tenant_id)"


_DEFAULTS_VERSION = ("(SELECT COALESCE(MAX(version), 0) FROM ledger_tenantpolicyversion"
                     " WHERE ledger_tenantpolicyversion.tenant_id = ledger_run.tenant_id)")


def take_seq(run_id: int) -> tuple[Run, str, int]:
    """Lock the run and take its next step number (the returned run's `next_seq - 1`), in one statement, reading
    the tenant's approval threshold and the version of its defaults as they stand now with it. A rolled-back
    transaction gives the number back."""
    run, (threshold, defaults_version) = sql.increment(Run, run_id, "next_seq",
                                                       also=(_TENANT_THRESHOLD, _DEFAULTS_VERSION))
    if run is None:
        raise Run.DoesNotExist(f"run {run_id} does not exist")
    return run, threshold, defaults_version


def start_attempt(action: Action, owner: str, *, log: AuditLog | None = None, resend_by: str = "") -> None:
    """Open the action's current attempt; with `log`, as part of that transaction's commit (nothing reads it before).
    `resend_by`: the person who decided, after an unknown outcome, that the tool did not act."""
    statement = sql.insert_statement(Attempt(action=action, number=action.attempts, worker=owner[:120],
                                             started_at=timezone.now(), resend_by=resend_by[:160]))
    write(statement, log)


def started_after(action: Action):
    """The lower bound of the start of `action`'s attempts: its creation less the partitions' margin (`recent`), so
    that on PostgreSQL a statement that finds one reads only the months since the step was recorded
    (ledger/db/partitions.py), not each month's index (issue 42). None for a step not read back from the database."""
    return None if action.created_at is None else recent(action.created_at)


def open_attempt(action: Action, number: int | None = None) -> dict:
    """Where the attempt of `action` numbered `number` (its current one unless told) is while it has not ended: what
    ending it or marking it sent updates, within the months since the step was recorded (`started_after`)."""
    where = {"action": action.pk, "number": action.attempts if number is None else number, "finished_at": None}
    since = started_after(action)
    if since is not None:
        where["started_at__gte"] = since
    return where


def finish_attempt(action: Action, outcome: str, *, latency_ms: float | None, error: ToolError | None = None,
                   log: AuditLog | None = None) -> None:
    """Close the action's current attempt, if still open; with `log`, as part of that transaction's commit."""
    statement = sql.update_statement(
        Attempt, open_attempt(action),
        finished_at=timezone.now(), outcome=outcome, latency_ms=latency_ms,
        error_class=error.error_class if error else "", error_message=error.message[:2000] if error else "")
    write(statement, log)


def write(statement: tuple[str, list], log: AuditLog | None) -> None:
    if log is not None:
        log.write_at_commit(statement)
    else:
        sql.execute(*statement)


# How a checkpoint sorts the forward steps: done, or not done yet. `unwind_complete` (ledger/migrations/0013) builds
# the completion's checkpoint from the same lists, in SQL.
DONE = (A.SUCCEEDED, A.COMPENSATED)


UNFINISHED = (*PENDING, A.RUNNING, A.FAILED, A.LOST)


def compensable(action: Action) -> bool:
    return action.compensation_plan.get("strategy") not in (None, "", CompensationStrategy.NONE)
