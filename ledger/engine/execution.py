"""The engine: call a claimed action's tool, record the outcome, retry, unwind, settle the run.

A step costs two commits on the fast path: the proposal inserts the action already claimed (status
running, with a lease), and the outcome commit records result, snapshots, verification and the
compensation plan together. Tool calls and snapshot reads always happen outside any transaction.
"""
from __future__ import annotations

from dataclasses import dataclass
import logging
import random
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.db.models import Q
from django.utils import timezone

from ledger.executors import egress
from ledger import events, tracing
from ledger.engine import failpoints, fastpath, mapping, received, sql
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.errors import StateConflict
from ledger.canonical import canonical, digest, dumps as canonical_text
from ledger.executors.call import (
    ToolError, ToolOutcome, http_call, http_read, mcp_call, python_call, python_read, resolve_url,
)
from ledger.models import (
    ActionClass, Action, ActionKind, ActionStatus as A, Attempt, Checkpoint, CompensationStrategy, Executor,
    OnRefusal, Run, RunStatus as R, SagaRole, Tenant, Tool,
)
from ledger.engine.leases import lease_at_write, queued_seconds
from ledger.policy.document import approvals_needed
from ledger.engine import unknowns
from ledger.engine.dispatch import HELD, enqueue, new_owner
from ledger.engine.transitions import action_transition, moved, run_transition

log = logging.getLogger("unwind.engine")

SYSTEM = "system:engine"
INLINE_RETRY_LIMIT = 2.0  # seconds: longer backoffs are scheduled, not slept through
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


# --- reading targets -----------------------------------------------------------------------------

def read_target(tool: Tool, target_id: str) -> object:
    """The target's current state through the tool's snapshot reader, or None when it has none."""
    reader = tool.snapshot.get("read")
    if not reader or not target_id:
        return None
    if not egress.is_url(reader):
        return python_read(path=reader, target=target_id, tenant=tool.tenant.slug)
    return http_read(url=resolve_url(reader, target=target_id), timeout=tool.timeout_seconds, tenant=tool.tenant.slug)


def snapshot_fields(tool: Tool, state: object) -> object:
    fields = tool.snapshot.get("fields")
    if fields and isinstance(state, dict):
        return {name: state.get(name) for name in fields}
    return state


def sent_args(action: Action):
    """The args as the agent sent them (numbers as written, strings unnormalised): what its tool receives, and
    what `$args.…` in its compensation and verification resolves to. An action recorded before they were kept
    (or built in memory without them) has only the canonical form."""
    return received.loads(action.args_text) if action.args_text else action.args


def same_value(observed, expected) -> bool:
    """Equal as JSON values (500 and 500.0, composed and decomposed text): a tool may store either form."""
    try:
        return canonical(observed) == canonical(expected)
    except (TypeError, ValueError):
        return observed == expected


def context_for(action: Action, *, after=None) -> dict:
    return {
        "args": sent_args(action), "result": action.result, "before": action.before,
        "after": action.after if after is None else after, "target": action.target_id,
        "key": action.idempotency_key, "intent": action.intent,
    }


def target_from_result(tool: Tool, result) -> str:
    """The step's target as its result gives it (`target.from: result.…`); "" when the result does not give it."""
    if tool.target_from.startswith("result.") and isinstance(mapping.decoded(result), dict):
        try:
            value = mapping.resolve("$" + tool.target_from, {"result": result})
        except mapping.MappingError:
            return ""
        return "" if value is None else str(value)
    return ""


@dataclass(frozen=True)
class ReadBack:
    """What reading a step back found: its effect happened. `evidence` is the record as read (the tool's own record
    of the effect from its lookup, or the target's state that its verify rule matched); `result` is that record in
    the shape of the tool's answer (`lookup.result` maps it there; without one the record is taken as it is), which
    the agent receives and the compensation resolves `$result.…` from. `problem`: why it could not be shaped."""

    result: object
    evidence: object
    by: str  # "lookup" or "target"
    problem: str = ""


def shaped(action: Action, record) -> tuple[object, str]:
    """`record` in the shape of the tool's answer (its `lookup.result`, resolved with `$result` the record) and "";
    or, when that cannot be resolved, the record as it is and why."""
    template = action.tool.lookup.get("result")
    if template is None:
        return record, ""
    try:
        return mapping.resolve(template, {**context_for(action), "result": record}), ""
    except mapping.MappingError as error:
        return record, f"its lookup.result could not be resolved from the record: {error}"


def already_done(action: Action) -> ReadBack | None:
    """After an attempt whose outcome is unknown: did the effect happen? Read back, never guess.

    Returns what was read when it did, None when it did not. Raises ToolError when it cannot
    be told (the caller then treats the outcome as unknown).
    """
    tool = action.tool
    lookup = tool.lookup.get("read")
    failpoints.hit("settle_read_back")
    if lookup:
        if egress.is_url(lookup):
            url = resolve_url(lookup, key=action.tool_key, target=action.target_id)
            found = http_read(url=url, timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
        else:
            found = python_read(path=lookup, target=action.tool_key, tenant=tool.tenant.slug)
        items = found.get("results", found) if isinstance(found, dict) else found
        if not items:
            return None
        record = items[0] if isinstance(items, list) else items
        result, problem = shaped(action, record)
        return ReadBack(result, evidence=record, by="lookup", problem=problem)
    if tool.verify.get("expect") and action.target_id:
        state = read_target(tool, action.target_id)
        expected = mapping.resolve(tool.verify["expect"], context_for(action, after=state))
        if isinstance(state, dict) and all(same_value(state.get(k), v) for k, v in expected.items()):
            result, problem = shaped(action, state)
            return ReadBack(result, evidence=state, by="target", problem=problem)
        return None
    raise ToolError("the tool declares no way to read it back: no lookup and no verify rule", transient=False)


def read_back_outcome(found: ReadBack) -> ToolOutcome:
    return ToolOutcome(result=found.result, read_back=found)


# --- calling tools ---------------------------------------------------------------------------------

def call_tool(action: Action) -> ToolOutcome:
    tool = action.tool
    if tool.executor == Executor.HTTP:
        url = resolve_url(tool.endpoint, target=action.target_id)
        return http_call(url=url, args=sent_args(action), idempotency_key=action.tool_key,
                         timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    if tool.executor == Executor.PYTHON:
        return python_call(path=tool.endpoint, args=sent_args(action), idempotency_key=action.tool_key,
                           target=action.target_id or None, tenant=tool.tenant.slug)
    if tool.executor == Executor.MCP:
        return mcp_call(endpoint=tool.endpoint, args=sent_args(action), idempotency_key=action.tool_key,
                        timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    raise ToolError("client-executed tools are run by the agent, which reports the outcome", transient=False)


AMBIGUOUS_ATTEMPT = (Q(outcome="lost") | Q(outcome="settle_failed") | Q(error_class="transient")
                     | Q(outcome="unanswered_last_try")
                     | (Q(error_class__startswith="http_5") & ~Q(error_class="http_503")))


def attempts_that_may_have_acted(action: Action):
    """The finished attempts that ended without telling whether the tool acted (no answer, a lost worker, a 5xx but
    503), leaving out those that never left Unwind (a tool that ignores keys records when an attempt is sent; for
    one that honours them a new attempt is the same call again, whatever the earlier ones did) and those a person
    set aside by deciding the tool did not act and sending the step again (`resend_by`)."""
    attempts = Attempt.objects.filter(action=action, finished_at__isnull=False).filter(AMBIGUOUS_ATTEMPT)
    if not action.tool.honours_idempotency_key:
        attempts = attempts.filter(sent_at__isnull=False)
    decided = (Attempt.objects.filter(action=action).exclude(resend_by="").order_by("-number")
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
    return until if until > timezone.now() else None


MARK_SENT = ("UPDATE ledger_attempt SET sent_at = %s WHERE action_id = %s AND number = %s AND finished_at IS NULL"
             " AND EXISTS (SELECT 1 FROM ledger_action WHERE id = %s AND status = %s AND lease_owner = %s"
             " AND lease_expires_at > %s)")


def mark_sent(action: Action, owner: str) -> bool:
    """Fencing before a call that cannot be deduplicated, and the ledger's record that it left: the attempt is
    marked sent, in one statement, only while the lease is still ours and has not run out (a thread starved past
    its lease must not send after the sweep has already handed the step to someone else). The sweep's reclaim
    closes the same attempt row (`actions.action_reclaim`), so one of the two waits for the other: either the
    attempt was sent under a lease still held, or it was never sent and is sent again."""
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(MARK_SENT, [now, action.pk, action.attempts, action.pk, A.RUNNING, owner, now])
        return cursor.rowcount == 1


def send(action: Action, owner: str) -> ToolOutcome | None:
    """Call the tool; for one that ignores keys, only once the attempt is marked sent (None: the lease is gone)."""
    if not action.tool.honours_idempotency_key and not mark_sent(action, owner):
        return None
    return call_tool(action)


def run_stopped(action: Action) -> bool:
    """The run was cancelled or is being unwound (or is over): a retry there must not call the tool again."""
    status, cancelled = Run.objects.values_list("status", "cancel_requested_at").get(pk=action.run_id)
    return bool(cancelled) or status not in (R.RUNNING, R.AWAITING_APPROVAL)


def resolve_without_calling(action: Action, *, owner: str) -> None:
    """In a stopped run, find out whether the earlier attempt acted, instead of trying again."""
    try:
        evidence = already_done(action) if an_attempt_may_have_acted(action) else None
    except ToolError as unreadable:
        record_unknown(action, ToolError(action.error_message or "no answer", transient=True),
                       why=unreadable.message, latency_ms=None, actor=SYSTEM)
        return
    if evidence is not None:
        record_success(action, read_back_outcome(evidence), latency_ms=None)
        return
    record_failure(action, ToolError("not tried again: the run stopped, and the earlier attempt did not act",
                                     transient=False), latency_ms=None, retry_inline=False, delay=0, owner=owner)


def defer(action: Action, until, *, owner: str, actor: str = SYSTEM) -> None:
    """Put a claimed action back to wait until `until` (its retry is claimed again by the sweep)."""
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "deferred", latency_ms=None, log=audit)
        action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, where=Q(lease_owner=owner),
                          note={"why": "waiting for the earlier call to be over before reading it back"},
                          next_attempt_at=until, lease_owner="", lease_expires_at=None)


def execute(action_id: int, *, owner: str, budget: float | None = None, sole_owner: bool = False,
            on_compensated: Callable[[AuditLog, Run], None] | None = None, claimed: Action | None = None) -> Action:
    """Run a claimed action (status running, lease held by `owner`) to an outcome.

    Transient failures are retried inline while the backoff is short and the budget allows;
    otherwise the retry is scheduled for the sweeper. Returns the action as it ends here.
    `on_compensated` runs inside the transaction that records a compensation's success, with its log and the run
    as that transaction locked it (see `unwind`).
    `claimed` is the action as the caller's own claim left it (with its tool), which spares reading it again;
    it is used only with `sole_owner`, where nobody else can have moved it since.

    A queued task may be delivered twice (django-q2 delivers at least once), and both deliveries carry
    the same owner; so unless the caller created the lease itself and shares it with nobody
    (`sole_owner`: the API's fast path, the unwinder), the lease is first taken over with a conditional
    update under a name of this call's own. The second delivery finds it taken and does nothing. A held
    owner (see `new_owner`) is never in a queued task, so a delivery that carries one takes nothing over.
    """
    if not sole_owner:
        mine = f"{owner[:100]}{HELD}{uuid.uuid4().hex[:8]}"
        if HELD in owner or Action.objects.filter(
                pk=action_id, status=A.RUNNING, lease_owner=owner).update(lease_owner=mine) != 1:
            return Action.objects.select_related("tool").get(pk=action_id)
        owner = mine
    started = time.monotonic()
    action = claimed if sole_owner and claimed is not None and claimed.pk == action_id \
        else Action.objects.select_related("tool").get(pk=action_id)
    with tracing.step(action) as attempt:
        return attempt.ended(_execute(action, owner=owner, budget=budget, started=started,
                                      on_compensated=on_compensated, attempt=attempt))


def _execute(action: Action, *, owner: str, budget: float | None, started: float,
             on_compensated: Callable[[AuditLog, Run], None] | None, attempt) -> Action:
    while True:
        if action.status != A.RUNNING or action.lease_owner != owner:
            return action
        stopped = action.kind == ActionKind.FORWARD and action.attempts > 1 and run_stopped(action)
        if needs_read_back(action) or stopped:
            until = settles_at(action)
            if until is not None:
                defer(action, until, owner=owner)
                return action
        if stopped:
            settling(action, owner, "finding out whether the earlier attempt acted", None,
                     lambda: resolve_without_calling(action, owner=owner))
            return action
        t0 = time.monotonic()
        failpoints.hit("before_tool_call")
        try:
            # After an attempt that was sent and may have acted: read back first. Found, it is the result; not
            # found (and, `settles_at`, nothing can still arrive), the step is sent again under this new attempt.
            reading_back = needs_read_back(action)
            found = settling(action, owner, "reading the step back", None, lambda: already_done(action)) \
                if reading_back else None
            if found is _SETTLED:
                return action
            if reading_back and found is None and read_back_pass(action):
                raise ToolError("its calls went unanswered, and reading it back once they were over found nothing: "
                                "it did not act", transient=False, not_sent=True)
            outcome = read_back_outcome(found) if found is not None else send(action, owner)
            if outcome is None:  # the lease ran out before the call left: the sweep sends it again
                return Action.objects.select_related("tool").get(pk=action.pk)
        except ToolError as error:
            latency = (time.monotonic() - t0) * 1000
            delay = backoff_delay(action.tool, action.attempts)
            remaining = None if budget is None else budget - (time.monotonic() - started)
            inline = delay <= INLINE_RETRY_LIMIT and (remaining is None or delay < remaining)
            retried = settling(action, owner, "recording the tool's error", None, lambda: record_failure(
                action, error, latency_ms=latency, retry_inline=inline, delay=delay, owner=owner))
            if retried is True and inline:
                time.sleep(delay)
                attempt.again()
                continue
            return action
        latency = (time.monotonic() - t0) * 1000
        failpoints.hit("after_tool_call")
        settling(action, owner, "recording the tool's answer", outcome.result, lambda: record_success(
            action, outcome, latency_ms=latency, on_compensated=on_compensated))
        return action


def read_back_pass(action: Action) -> bool:
    """This attempt is the one more pass `record_failure` gave a key-ignoring tool's last unanswered try, to read it
    back once it is over: it reads back, and does not send again (a reclaim after a lost worker does)."""
    previous = (Attempt.objects.filter(action=action, number__lt=action.attempts).exclude(outcome="deferred")
                .order_by("-number").values_list("outcome", flat=True).first())
    return previous == UNANSWERED_LAST_TRY


# How the last of a key-ignoring tool's tries ends when it got no answer: the pass after it reads it back, only.
UNANSWERED_LAST_TRY = "unanswered_last_try"
_SETTLED = object()  # what `settling` answers when the step failed to settle and was recorded as such
# What a failure to reach the database is: the ledger cannot record anything now, so nothing is recorded; the lease
# runs out and the sweep takes the step over (bounded by UNWIND_MAX_RECLAIMS), knowing whether it was sent.
UNREACHABLE = (OperationalError, InterfaceError)


def settling(action: Action, owner: str, stage: str, result, work: Callable[[], object]):
    """Run `work`, a step of settling `action`'s outcome. Whatever it raises but a ToolError (which its caller
    handles) or a database out of reach ends in a recorded state and a recovery item saying what failed
    (`settle_failed`), never in an action left running for the sweep to take over and fail again. `result`: the
    tool's answer when it gave one (the step then did act). Returns what `work` returns, or `_SETTLED`."""
    try:
        return work()
    except (ToolError, StateConflict, *UNREACHABLE):
        raise  # a ToolError is its caller's; a StateConflict, someone else having moved the step, is not a failure
    except Exception as error:  # noqa: BLE001 - every failure of the engine's own code is recorded, then alerted
        log.exception("settling action %s failed while %s", action.pk, stage)
        settle_failed(action, owner=owner, stage=stage, error=error, result=result)
        return _SETTLED


def settle_failed(action: Action, *, owner: str, stage: str, error: BaseException, result=None) -> None:
    """Settling `action`'s outcome failed while `stage`: record that, and put its run before a person.

    A forward step the tool answered (`result`) acted: it is recorded succeeded with that answer and a failed
    verification naming what failed, so an unwind undoes it with its answer. Otherwise (an error being recorded,
    a read-back, or a compensation) its outcome is unknown: it is recorded lost (`settle_failed`)."""
    why = f"{stage} failed: {error.__class__.__name__}: {str(error)[:500]}"
    with ledger_transaction(action.tenant_id) as audit:
        current = sql.get(Action, pk=action.pk)
        if current is None or current.status != A.RUNNING or current.lease_owner != owner:
            return  # it settled after all, or someone else holds it now
        action.status = current.status
        finish_attempt(action, "settle_failed", latency_ms=None, error=ToolError(why, transient=False), log=audit)
        answered = result is not None and action.kind == ActionKind.FORWARD
        if answered:
            detail = (f"{action.tool.name} (step {action.seq}) was carried out (the tool answered), but {why}. Its "
                      f"answer is kept as the step's result. Check the step, then compensate to undo it, resume to "
                      f"accept it and go on, or close the run.")
            action_transition(action, A.SUCCEEDED, log=audit, actor=SYSTEM, where=Q(lease_owner=owner),
                              note={"settle_failed": why}, result=result,
                              verification={"ok": False, "detail": why}, lease_owner="", lease_expires_at=None)
        else:
            detail = (f"{action.tool.name} (step {action.seq}): {why}, so whether it acted is not recorded. Check "
                      f"the target, then resume (the tool says it did not happen: send it again), compensate, or close.")
            action_transition(action, A.LOST, log=audit, actor=SYSTEM, where=Q(lease_owner=owner),
                              note={"settle_failed": why}, lease_owner="", lease_expires_at=None,
                              error_class="settle_failed", error_message=detail[:2000])
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
            needs_attention(run, "settle_failed", detail, action=action, log=audit)
        elif run.status == R.UNWINDING:
            enqueue_unwind_after(run)


def record_success(action: Action, outcome: ToolOutcome, *, latency_ms: float | None, actor: str = SYSTEM,
                   on_compensated: Callable[[AuditLog, Run], None] | None = None) -> None:
    tool = action.tool
    result = outcome.result
    failpoints.hit("settle_target")
    target_id = action.target_id or target_from_result(tool, result)
    after = None
    verification = None
    if action.kind == ActionKind.FORWARD and tool.target_from.startswith("result.") and not target_id:
        verification = {"ok": False, "detail": f"the result does not give ${tool.target_from}, the step's target"}
    if action.kind == ActionKind.FORWARD and tool.snapshot.get("read") and target_id:
        failpoints.hit("settle_snapshot")
        try:
            after = snapshot_fields(tool, read_target(tool, target_id))
        except ToolError as error:
            verification = {"ok": False, "detail": f"could not read the target back: {error.message}"}
    if action.kind == ActionKind.FORWARD and tool.verify.get("expect") and verification is None:
        failpoints.hit("settle_verify")
        try:
            expected = mapping.resolve(tool.verify["expect"], {**context_for(action, after=after), "result": result, "target": target_id})
            observed = after if after is not None else result
            mismatched = {k: {"expected": v, "observed": (observed or {}).get(k)} for k, v in expected.items()
                          if not isinstance(observed, dict) or not same_value(observed.get(k), v)}
            verification = {"ok": not mismatched, "mismatched": mismatched} if mismatched else {"ok": True}
        except mapping.MappingError as error:
            verification = {"ok": False, "detail": str(error)}
    plan = dict(action.compensation_plan)
    failpoints.hit("settle_plan")
    if plan.get("strategy") not in (None, CompensationStrategy.NONE):
        preview_action = Action(args=action.args, result=result, before=action.before, after=after,
                                target_id=target_id, idempotency_key=action.idempotency_key, intent=action.intent)
        try:
            plan["args_preview"] = mapping.resolve(plan.get("args", {}), context_for(preview_action))
            plan.pop("error", None)
        except mapping.MappingError as error:
            plan["error"] = str(error)
    found = outcome.read_back
    if found is not None and action.kind == ActionKind.FORWARD:
        # Read back, not answered: the record is kept beside the result, and a result the compensation cannot be
        # resolved from (or that lacks the target) sends the step to a person with it.
        problems = [p for p in (found.problem, (verification or {}).get("detail"), plan.get("error") and
                                f"its compensation cannot be resolved from it: {plan['error']}") if p]
        verification = {**(verification or {}), "ok": not problems and (verification or {}).get("ok", True),
                        "read_back": {"by": found.by, "evidence": found.evidence}}
        if problems:
            verification["detail"] = "; ".join(problems)
    failpoints.hit("settle_record")
    changes = dict(result=result, after=after, verification=verification, target_id=target_id, compensation_plan=plan,
                   lease_owner="", lease_expires_at=None, error_class="", error_message="")
    if action.kind == ActionKind.FORWARD and action.status == A.RUNNING and (verification is None or verification.get("ok")) \
            and fastpath.usable(action.tenant_id) and fastpath.succeed(
                action, changes=changes, latency_ms=latency_ms, actor=actor, pivot=action.saga_role == SagaRole.PIVOT):
        return  # PostgreSQL, the plain case: recorded in one call (ledger/engine/fastpath.py)
    if action.kind == ActionKind.COMPENSATION and isinstance(on_compensated, NextUndo) and action.status == A.RUNNING \
            and Action.compensates.is_cached(action) and fastpath.usable(action.tenant_id) \
            and _compensated_in_one_call(action, changes, latency_ms=latency_ms, actor=actor, chain=on_compensated):
        return  # PostgreSQL, the unwinder's plain case: recorded with the next claim (or the settling) in one call
    with ledger_transaction(action.tenant_id) as audit:
        run = action.run = sql.get_locked(Run, action.run_id)  # the answer shows the run as this leaves it
        action_transition(action, A.SUCCEEDED, log=audit, actor=actor, **changes)
        finish_attempt(action, "succeeded", latency_ms=latency_ms, log=audit)
        if action.kind == ActionKind.COMPENSATION:
            # The unwinder's claim loaded it, in memory since; a change behind it fails the conditional update.
            forward = action.compensates if Action.compensates.is_cached(action) else sql.get(Action, pk=action.compensates_id)
            action_transition(forward, A.COMPENSATED, log=audit, actor=actor)
            if run.status == R.UNWINDING:
                enqueue_unwind_after(run)
            if on_compensated is not None:
                on_compensated(audit, run)
            return
        if action.saga_role == SagaRole.PIVOT and not run.pivot_committed:
            Run.objects.filter(pk=run.pk).update(pivot_committed=True)
            run.pivot_committed = True
            audit.record("run.pivot_committed", actor=actor, run=run, action=action)
            checkpoint_save(run, "pivot_committed", log=audit)
        if run.status in (R.UNWINDING,) or run.cancel_requested_at:
            # A late completion after a cancel or a failure elsewhere: it is compensated like the rest.
            if run.status == R.UNWINDING:
                enqueue_unwind_after(run)
            return
        if verification is not None and not verification.get("ok"):
            if "read_back" in verification:
                needs_attention(run, "read_back_incomplete", read_back_detail(action, verification), action=action,
                                log=audit)
                return
            needs_attention(run, "verification_failed", f"{tool.name} (step {action.seq}) did not verify: "
                            f"{verification.get('detail') or verification.get('mismatched')}", action=action, log=audit)
            return
        if run.status == R.AWAITING_APPROVAL and not run.actions.filter(kind=ActionKind.FORWARD, status=A.AWAITING_APPROVAL).exists():
            run_transition(run, R.RUNNING, log=audit, actor=actor)


def read_back_detail(action: Action, verification: dict) -> str:
    """What a person reads of a step found done by reading it back whose record is not a result Unwind can use."""
    plan = action.compensation_plan
    evidence = canonical_text(verification["read_back"]["evidence"])
    undo = (f" Its undo, {plan.get('tool')}, takes {canonical_text(plan.get('args', {}))}: complete those "
             f"arguments from the record on this item's page, then undo the step with them or keep them and resume."
             if compensable(action) else "")
    return (f"{action.tool.name} (step {action.seq}) did act: reading it back ({verification['read_back']['by']}) found "
            f"{evidence[:1500]}. But {verification['detail']}.{undo} Resume to accept it as done and go on, "
            f"or close the run.")


def _compensated_in_one_call(undo: Action, changes: dict, *, latency_ms: float | None, actor: str,
                             chain: "NextUndo") -> bool:
    """PostgreSQL: what the Python path does when the unwinder's compensation succeeds (record it, its step
    compensated, then `claim_next_compensation`: the next compensation claimed, or the run settled compensated), in
    one call (ledger/engine/fastpath.py), decided here from the run's actions read just before and checked again under the
    locks. Only the plain cases (see `_next_in_one_call`); otherwise False with nothing written."""
    if not chain.allowed() or events.subscribed("run_finished"):
        return False
    forward = undo.compensates
    state, chain.state = chain.state, None
    if state is None or not state.ids:
        state = UnwindState.read(undo.run_id)
    run, rows = state.run, state.rows
    read = {action.pk: action for action, *_ in rows}
    if run is None or run.status != R.UNWINDING or getattr(read.get(undo.pk), "status", None) != A.RUNNING \
            or getattr(read.get(forward.pk), "status", None) != A.COMPENSATING:
        return False
    now = timezone.now()
    undo_after, undo_moved = moved(undo, A.SUCCEEDED, now=now, **changes)
    # The step as the ledger has it (the same row the Python path moves).
    forward_after, forward_moved = moved(read[forward.pk], A.COMPENSATED, now=now)
    log = AuditLog(run.tenant_id, head=None)
    log.record(f"{undo.kind}.{A.SUCCEEDED}", actor=actor, action=undo_after, status_from=A.RUNNING)
    log.record(f"{forward.kind}.{A.COMPENSATED}", actor=actor, action=forward_after, status_from=A.COMPENSATING)
    status = {action.pk: action.status for action, *_ in rows}
    status[undo.pk], status[forward.pk] = A.SUCCEEDED, A.COMPENSATED
    attempt = Attempt(action=undo, number=undo.attempts, finished_at=now, outcome="succeeded", latency_ms=latency_ms)
    claimed = _next_in_one_call(run, rows, status, log=log, owner=chain.owner, state=state, now=now,
                                undo=(undo_after, attempt, forward_after), chain=chain)
    if claimed is False:
        return False
    for action, changes in ((undo, undo_moved), (forward, forward_moved)):
        for name, value in changes.items():
            setattr(action, name, value)
    chain.claimed.append(claimed)
    return True


def _claim_unwind_in_one_call(run_id: int, *, owner: str,
                              chain: "NextUndo | None" = None) -> tuple[bool, Action | None] | None:
    """PostgreSQL: `claim_unwind` (the run's unwind lease taken, and its first compensation claimed or the run
    settled) in one call, for the plain cases. None: nothing was written; the Python path decides."""
    if events.subscribed("run_finished"):
        return None
    state = _handed_over(run_id) or UnwindState.read(run_id)
    run, rows = state.run, state.rows
    now = timezone.now()
    if run is None or run.status != R.UNWINDING or (run.lease_expires_at is not None and run.lease_expires_at >= now):
        return None  # not unwinding, or another unwinder holds it: the Python path answers
    log = AuditLog(run.tenant_id, head=None)
    claimed = _next_in_one_call(run, rows, {action.pk: action.status for action, *_ in rows}, log=log, owner=owner,
                                state=state, now=now, lease=lease_until(), chain=chain)
    return None if claimed is False else (True, claimed)


@dataclass
class UnwindState:
    """What `fastpath.run_for_unwind` read (or the last one-call left): the run, ids drawn for the compensations to
    come and for a checkpoint, the tenant's approval threshold, and the run's actions with their tools."""

    run: Run | None
    ids: list
    checkpoint_id: int | None
    threshold: str | None
    rows: list

    @classmethod
    def read(cls, run_id: int) -> UnwindState:
        run, ids, checkpoint_ids, threshold, rows = fastpath.run_for_unwind(run_id)
        return cls(run, ids, checkpoint_ids[0] if checkpoint_ids else None, threshold, rows)


# PostgreSQL: the run as this thread's last one-call failure left it (`_failed_in_one_call`), which the unwind the
# same thread starts next (the API's inline path, the worker's task, the benchmark) takes as its first read instead of
# reading the run again; taken once, and only for that run. Its call still checks every status, and the lease, under
# its locks.
_handed = threading.local()


def _hand_over(state: UnwindState) -> None:
    _handed.state = state


def _handed_over(run_id: int) -> UnwindState | None:
    state, _handed.state = getattr(_handed, "state", None), None
    return state if state is not None and state.run is not None and state.run.pk == run_id else None


def unwind_elsewhere(run_id: int) -> None:
    """For a caller that executed a step and will not unwind its run now (its time is up): the worker does it.

    The one-call failure queues no unwind, as its caller goes on to unwind the run itself; a crash in between
    leaves a run unwinding without a lease, which the sweep hands to a worker within its interval. The Python
    path queued one already (`start_unwind`)."""
    if _handed_over(run_id) is not None:
        enqueue("ledger.tasks.unwind_run", run_id)


def _next_in_one_call(run: Run, rows: list, status: dict, *, log: AuditLog, owner: str, state: UnwindState, now,
                      undo: tuple | None = None, lease=None, chain: "NextUndo | None" = None):
    """`claim_next_compensation` for the one-call paths, from the run's actions as `fastpath.run_for_unwind` read
    them (`status`: theirs once the call's own moves are made), recorded with the events already in `log` (and
    `undo`: a compensation's success, its attempt's end and its step compensated; or `lease`: the run's unwind lease
    to take). Returns the compensation claimed, None when the run settled compensated, or False with nothing
    written when the case is not a plain one: a step pending or in flight, an undo that needs approval, is run by
    the agent or cannot be resolved, a compensation tried before, a run that does not settle compensated, or a
    ledger that changed since the read."""
    steps = [row for row in rows if row[0].kind == ActionKind.FORWARD]
    if any(status[step.pk] in PENDING for step, *_ in steps):
        return False  # the Python path skips them first
    active = [row for row in steps if status[row[0].pk] in (A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED, A.COMPENSATING)]
    if any(status[step.pk] in (A.RUNNING, A.RETRY_SCHEDULED) for step, *_ in active):
        return False  # a step in flight: nothing is claimed until it lands
    candidate = next((row for row in reversed(active) if compensable(row[0])), None)
    next_undo = next_forward = next_attempt = checkpoint = None
    if candidate is not None:
        step, step_tool, _, tool = candidate
        if status[step.pk] != A.SUCCEEDED or tool is None or tool.executor == Executor.CLIENT \
                or undo_approvals(step, state.threshold) or not state.ids:
            return False
        try:
            args = undo_args(step)
        except mapping.MappingError:
            return False  # the Python path records why
        next_undo = new_compensation(run, step, step_tool, tool, args=args, seq=0, defaults_version=0, required=0,
                                     owner=owner, earlier=0)
        next_undo.pk = state.ids[0]
        log.record("compensation.proposed", actor=SYSTEM, action=next_undo, compensates=step.pk,
                   strategy=step.compensation_plan.get("strategy"))
        next_forward, _ = moved(step, A.COMPENSATING, now=now)
        log.record(f"{step.kind}.{A.COMPENSATING}", actor=SYSTEM, action=next_forward, status_from=A.SUCCEEDED,
                   compensation=next_undo.pk)
        next_attempt = Attempt(action=next_undo, number=next_undo.attempts, worker=owner[:120], started_at=now)
    else:
        standing = [step for step, _, action_class, _ in steps if status[step.pk] == A.SUCCEEDED
                    and action_class != ActionClass.READ_ONLY and not compensable(step)]
        if standing or any(status[step.pk] == A.COMPENSATION_FAILED for step, *_ in steps) \
                or any(status[action.pk] == A.LOST for action, *_ in rows):
            return False  # `settle` puts the run before a person
        run.status, run.lease_expires_at, run.updated_at, run.finished_at = R.COMPENSATED, None, now, now
        log.record(f"run.{R.COMPENSATED}", actor=SYSTEM, run=run, status_from=R.UNWINDING)
        checkpoint = Checkpoint(pk=state.checkpoint_id, tenant_id=run.tenant_id, run=run, label="compensated",
                                state=checkpoint_state(run, [(s.pk, s.seq, status[s.pk], name) for s, name, *_ in steps]))
        log.record("run.checkpoint", actor=SYSTEM, run=run, label="compensated", checkpoint=state.checkpoint_id)
    undo_after, attempt, forward_after = undo if undo is not None else (None, None, None)
    recorded = fastpath.compensated(
        run=run, steps=[[action.pk, action.status] for action, *_ in rows], undo=undo_after, undo_attempt=attempt,
        forward=forward_after, next_forward=next_forward, next_undo=next_undo, next_attempt=next_attempt,
        threshold=state.threshold, settle=candidate is None, checkpoint=checkpoint, lease=lease,
        pending=log.pending, now=now)
    if recorded is None:
        return False
    step, defaults_version, run_lease, undo_lease = recorded
    if lease is not None:
        run.lease_expires_at = run_lease
    if next_undo is None and chain is not None:
        chain.settled = run  # as the call left it: compensated, its lease cleared
    if next_undo is not None:
        next_undo.seq, next_undo.defaults_version, next_undo.lease_expires_at = step, defaults_version, undo_lease
        run.next_seq = next_undo.seq + 1
        next_undo._state.adding, next_undo._state.db = False, run._state.db
        next_undo.tool, next_undo.compensates = tool, next_forward
        if chain is not None:  # the run as this call left it: where the next decision starts
            rewritten = {next_forward.pk: next_forward}
            if forward_after is not None:
                rewritten.update({undo_after.pk: undo_after, forward_after.pk: forward_after})
            chain.state = UnwindState(
                run, state.ids[1:], state.checkpoint_id, state.threshold,
                [(rewritten.get(row[0].pk, row[0]), *row[1:]) for row in rows]
                + [(next_undo, tool.name, tool.action_class, None)])
    return next_undo


def record_failure(action: Action, error: ToolError, *, latency_ms: float | None, retry_inline: bool, delay: float,
                   owner: str, actor: str = SYSTEM) -> bool:
    """Record a failed attempt. Returns True when the action will be retried (inline or scheduled).

    When a step's last attempt ended in an error that leaves its effect unknown (a 5xx, a timeout), it is
    not called failed on faith: the tool is read back first. Found → it succeeded; not found → it failed;
    cannot be told → its outcome is unknown and a person is asked (guarantee 2: never "compensated" with
    an effect possibly still standing).
    """
    failpoints.hit("settle_failure")
    note = {"error_class": error.error_class, "error": error.message[:500]}
    final = not (error.transient and action.attempts < action.max_attempts)
    if final and error.maybe_applied and error.status is None and not action.tool.honours_idempotency_key \
            and action.attempts == action.max_attempts and (action.tool.lookup.get("read") or action.tool.verify):
        # No answer, and the call may still be running at the server: read it back once it must be over,
        # in one more pass (the read-back comes first there), rather than now.
        with ledger_transaction(action.tenant_id) as audit:
            finish_attempt(action, UNANSWERED_LAST_TRY, latency_ms=latency_ms, error=error, log=audit)
            action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                              next_attempt_at=timezone.now() + timedelta(seconds=action.tool.timeout_seconds + 1),
                              max_attempts=action.attempts + 1, lease_owner="", lease_expires_at=None,
                              error_class=error.error_class, error_message=error.message[:2000])
        return True
    # A first attempt has no earlier one that could have acted (its own is not finished yet).
    if final and action.kind == ActionKind.FORWARD and (
            error.maybe_applied or (action.attempts > 1 and an_attempt_may_have_acted(action))):
        try:
            evidence = already_done(action)
        except ToolError as unreadable:
            record_unknown(action, error, why=unreadable.message, latency_ms=latency_ms, actor=actor)
            return False
        if evidence is not None:
            finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error)
            record_success(action, read_back_outcome(evidence), latency_ms=None, actor=actor)
            return False
    if final and action.kind == ActionKind.FORWARD and action.status == A.RUNNING and action.attempts == 1 \
            and not answers_refusal(action, error) and fastpath.usable(action.tenant_id) \
            and _failed_in_one_call(action, error, latency_ms=latency_ms, actor=actor):
        return False  # PostgreSQL, the plain case (a first attempt before the pivot): recorded in one call
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "failed_transient" if error.transient else "failed_permanent", latency_ms=latency_ms,
                       error=error, log=audit)
        if error.transient and action.attempts < action.max_attempts:
            if retry_inline:
                action_transition(action, A.RUNNING, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                                  attempts=action.attempts + 1,
                                  lease_expires_at=lease_at_write(action.tool.timeout_seconds + delay, row=action),
                                  error_class=error.error_class, error_message=error.message[:2000])
                start_attempt(action, owner, log=audit)
            else:
                action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note,
                                  next_attempt_at=timezone.now() + timedelta(seconds=delay), lease_owner="",
                                  lease_expires_at=None, error_class=error.error_class, error_message=error.message[:2000])
            return True
        if answers_refusal(action, error):
            action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="",
                              lease_expires_at=None, error_class=REFUSED, error_message=error.message[:2000])
            after_refusal(action, error, log=audit, actor=actor)
            return False
        action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="", lease_expires_at=None,
                          error_class=error.error_class, error_message=error.message[:2000])
        after_failure(action, log=audit, actor=actor)
    return False


def _failed_in_one_call(action: Action, error: ToolError, *, latency_ms: float | None, actor: str) -> bool:
    """PostgreSQL: a forward step's first attempt failed for good in a run still before its pivot: the step failed
    and the run starting to unwind (`after_failure` → `start_unwind`) in one call, from the run's actions read just
    before and checked again under the locks. False with nothing written for anything else (a pivot committed, a
    pending step to skip, a run not running)."""
    run, ids, checkpoint_ids, threshold, rows = fastpath.run_for_unwind(action.run_id, checkpoints=2)
    checkpoint_id = checkpoint_ids[0] if checkpoint_ids else None
    read = {row.pk: row for row, *_ in rows}
    if run is None or run.status != R.RUNNING or run.pivot_committed or run.lease_expires_at is not None \
            or getattr(read.get(action.pk), "status", None) != A.RUNNING:
        return False
    status = {row.pk: row.status for row, *_ in rows}
    status[action.pk] = A.FAILED
    steps = [row for row in rows if row[0].kind == ActionKind.FORWARD]
    if any(status[step.pk] in PENDING for step, *_ in steps):
        return False  # `skip_pending` first
    now = timezone.now()
    failed, failed_moved = moved(action, A.FAILED, now=now, lease_owner="", lease_expires_at=None,
                                 error_class=error.error_class, error_message=error.message[:2000])
    log = AuditLog(run.tenant_id, head=None)
    log.record(f"{action.kind}.{A.FAILED}", actor=actor, action=failed, status_from=A.RUNNING,
               error_class=error.error_class, error=error.message[:500])
    why = f"{action.tool.name} (step {action.seq}) failed: {failed.error_message}"
    run.status, run.attention_detail, run.updated_at = R.UNWINDING, why[:4000], now
    log.record(f"run.{R.UNWINDING}", actor=actor, run=run, status_from=R.RUNNING, why=why[:500])
    checkpoint = Checkpoint(pk=checkpoint_id, tenant_id=run.tenant_id, run=run, label="unwind_started",
                            state=checkpoint_state(run, [(s.pk, s.seq, status[s.pk], name) for s, name, *_ in steps]))
    log.record("run.checkpoint", actor=SYSTEM, run=run, label="unwind_started", checkpoint=checkpoint_id)
    attempt = Attempt(action=action, number=action.attempts, finished_at=now, latency_ms=latency_ms,
                      outcome="failed_transient" if error.transient else "failed_permanent",
                      error_class=error.error_class, error_message=error.message[:2000])
    if not fastpath.failed(run=run, steps=[[row.pk, row.status] for row, *_ in rows], action=failed, attempt=attempt,
                           checkpoint=checkpoint, pending=log.pending, now=now):
        return False
    for name, value in failed_moved.items():
        setattr(action, name, value)
    # No unwind is queued: the caller unwinds the run next, from this state (`unwind_elsewhere` when it will not).
    _hand_over(UnwindState(run, ids, checkpoint_ids[1], threshold, [
        ((fastpath.Step(action.pk, action.seq, action.kind, A.FAILED), *row[1:]) if row[0].pk == action.pk else row)
        for row in rows]))
    return True


def answers_refusal(action: Action, error: ToolError) -> bool:
    """A forward step the tool turned down ("not carried out") is the agent's to answer, unless its tool's policy
    asks for the unwind (`on_refusal: unwind`). Compensations never are: an undo that is turned down is alerted."""
    return error.refused and action.kind == ActionKind.FORWARD and action.tool.on_refusal == OnRefusal.ANSWER


def after_refusal(action: Action, error: ToolError, *, log: AuditLog, actor: str) -> None:
    """The step did nothing: the run stays as it is (the agent re-proposes otherwise, completes or cancels).

    It never counts towards the ordering law, is never compensated and commits no pivot. A run that was
    cancelled or started unwinding while the step was in flight goes on with its unwind.
    """
    run = sql.get_locked(Run, action.run_id)
    log.record("forward.refused", actor=actor, action=action, tool=action.tool.name, status=error.status,
               reason=error.message[:500], run_status=run.status)
    if run.status == R.UNWINDING:
        enqueue_unwind_after(run)


def record_unknown(action: Action, error: ToolError, *, why: str, latency_ms: float | None, actor: str) -> None:
    """The step may or may not have acted, and nothing can tell: mark it lost and put the run before a person."""
    detail = (f"{action.tool.name} (step {action.seq}) answered {error.message} on its last attempt, so it may have "
              f"acted, and it cannot be read back ({why}). Check the target, then resume, compensate or close.")
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error, log=audit)
        action_transition(action, A.LOST, log=audit, actor=actor, note={"error": error.message[:500]},
                          lease_owner="", lease_expires_at=None, error_class="outcome_unknown",
                          error_message=detail[:2000])
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
            needs_attention(run, "outcome_unknown", detail, action=action, log=audit)
        elif run.status == R.UNWINDING:
            enqueue_unwind_after(run)


def after_failure(action: Action, *, log: AuditLog, actor: str) -> None:
    """An action failed for good: unwind before the pivot, recovery queue after it; compensations alert and continue."""
    run = sql.get_locked(Run, action.run_id)
    if action.kind == ActionKind.COMPENSATION:
        forward = Action.objects.select_related("tool").get(pk=action.compensates_id)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=actor,
                          note={"error": action.error_message[:500]})
        events.emit("compensation_failed", action=action, forward=forward)
        if run.status == R.UNWINDING:
            enqueue_unwind_after(run)
        return
    if run.status in (R.UNWINDING, R.NEEDS_ATTENTION) or run.status in (R.COMPLETED, R.COMPENSATED, R.CLOSED):
        if run.status == R.UNWINDING:
            enqueue_unwind_after(run)
        return
    if run.pivot_committed:
        needs_attention(run, "step_failed", f"{action.tool.name} (step {action.seq}) failed after the pivot and "
                        f"{action.attempts} attempt(s): {action.error_message}. The run only moves forward from here.",
                        action=action, log=log)
    else:
        start_unwind(run, f"{action.tool.name} (step {action.seq}) failed: {action.error_message}", log=log, actor=actor)


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
    _write(statement, log)


def finish_attempt(action: Action, outcome: str, *, latency_ms: float | None, error: ToolError | None = None,
                   log: AuditLog | None = None) -> None:
    """Close the action's current attempt, if still open; with `log`, as part of that transaction's commit."""
    statement = sql.update_statement(
        Attempt, {"action": action.pk, "number": action.attempts, "finished_at": None},
        finished_at=timezone.now(), outcome=outcome, latency_ms=latency_ms,
        error_class=error.error_class if error else "", error_message=error.message[:2000] if error else "")
    _write(statement, log)


def _write(statement: tuple[str, list], log: AuditLog | None) -> None:
    if log is not None:
        log.write_at_commit(statement)
    else:
        sql.execute(*statement)


# --- run-level decisions ----------------------------------------------------------------------------

def run_steps(run_id: int, *, statuses: list[str] | None = None, forward_only: bool = True) -> list[tuple]:
    """(id, seq, status, tool name) of a run's forward steps (or all its actions) in order, optionally only
    those in `statuses`."""
    where = " AND a.kind = %s" if forward_only else ""
    if statuses:
        where += f" AND a.status IN ({', '.join(['%s'] * len(statuses))})"
    return sql.fetch_all(
        "SELECT a.id, a.seq, a.status, t.name FROM ledger_action a JOIN ledger_tool t ON t.id = a.tool_id"
        f" WHERE a.run_id = %s{where} ORDER BY a.seq",
        [run_id, *([ActionKind.FORWARD] if forward_only else []), *(statuses or [])])


def checkpoint_save(run: Run, label: str, *, log: AuditLog) -> Checkpoint:
    checkpoint = sql.insert(Checkpoint(tenant_id=run.tenant_id, run=run, label=label,
                                       state=checkpoint_state(run, run_steps(run.pk))))
    log.record("run.checkpoint", actor=SYSTEM, run=run, label=label, checkpoint=checkpoint.pk)
    return checkpoint


# How a checkpoint sorts the forward steps: done, or not done yet. `unwind_complete` (ledger/migrations/0013) builds
# the completion's checkpoint from the same lists, in SQL.
DONE = (A.SUCCEEDED, A.COMPENSATED)
UNFINISHED = (*PENDING, A.RUNNING, A.FAILED, A.LOST)


def checkpoint_state(run: Run, steps: list[tuple]) -> dict:
    """What a checkpoint records of the run and its forward `steps` ((id, seq, status, tool name), in order)."""
    actions = [dict(zip(("id", "seq", "status", "tool__name"), row)) for row in steps]
    completed = [a["id"] for a in actions if a["status"] in DONE]
    pending = [a["id"] for a in actions if a["status"] in UNFINISHED]
    summary = ", ".join(f"{a['tool__name']} {a['status'].replace('_', ' ')}" for a in actions) or "no actions yet"
    mode = {R.UNWINDING: "compensate", R.NEEDS_ATTENTION: "resume_or_compensate",
            R.AWAITING_APPROVAL: "await_approval"}.get(run.status, "resume")
    return {
        "run_status": run.status, "pivot_committed": run.pivot_committed,
        "completed_action_ids": completed, "pending_action_ids": pending,
        "awaiting_approval_ids": [a["id"] for a in actions if a["status"] == A.AWAITING_APPROVAL],
        "recovery_mode": mode, "summary": summary,
    }


def needs_attention(run: Run, reason: str, detail: str, *, action: Action | None, log: AuditLog, actor: str = SYSTEM) -> None:
    run_transition(run, R.NEEDS_ATTENTION, log=log, actor=actor, note={"reason": reason},
                   attention_reason=reason, attention_detail=detail[:4000], lease_expires_at=None)
    checkpoint_save(run, f"needs_attention:{reason}", log=log)
    events.emit("run_needs_attention", run=run, reason=reason, detail=detail, action=action)


def skip_pending(run: Run, *, log: AuditLog, actor: str, why: str, forward_only: bool = False) -> None:
    """Skip what has not started. An unwind skips only forward steps: its own compensations may be waiting
    for approval and must still run."""
    if not run_steps(run.pk, statuses=list(PENDING), forward_only=forward_only):
        return  # the common case, told by one narrow query
    pending_actions = run.actions.filter(status__in=PENDING).select_related("tool")
    if forward_only:
        pending_actions = pending_actions.filter(kind=ActionKind.FORWARD)
    for pending in pending_actions:
        if pending.status == A.RETRY_SCHEDULED and pending.kind == ActionKind.FORWARD and an_attempt_may_have_acted(pending):
            continue  # it may have acted: its retry finds out (reading back, never calling again) first
        was_waiting = pending.status == A.AWAITING_APPROVAL
        # A held step skipped by its agent's cancel was stopped by the agent (ledger/engine/holds.py).
        stopped = {"stopped_by": "agent"} if pending.status == A.HELD and actor.startswith("agent:") else {}
        action_transition(pending, A.SKIPPED, log=log, actor=actor, note={"why": why}, lease_owner="",
                          lease_expires_at=None, next_attempt_at=None, **stopped)
        if was_waiting:
            events.emit("approval_withdrawn", action=pending, reason=why)


def start_unwind(run: Run, why: str, *, log: AuditLog, actor: str) -> None:
    skip_pending(run, log=log, actor=actor, why=why, forward_only=True)
    run_transition(run, R.UNWINDING, log=log, actor=actor, note={"why": why[:500]}, attention_detail=why[:4000])
    checkpoint_save(run, "unwind_started", log=log)
    enqueue_unwind_after(run)


def enqueue_unwind_after(run: Run) -> None:
    """Queue an unwinder unless one holds the run's lease (it will see the new state itself)."""
    if run.lease_expires_at is None or run.lease_expires_at < timezone.now():
        enqueue("ledger.tasks.unwind_run", run.pk)


# --- unwinding ----------------------------------------------------------------------------------------

def compensable(action: Action) -> bool:
    return action.compensation_plan.get("strategy") not in (None, "", CompensationStrategy.NONE)


def unwind(run_id: int, *, budget: float | None = None, tenant_id: int | None = None) -> Run:
    """Compensate the run's succeeded actions newest-first, then settle it. Safe to call any number of times.

    Holds the run's lease while it works, so one unwinder at a time; a crashed unwinder's lease
    expires and the sweeper starts another, which picks up exactly where the ledger says.

    A compensation costs one commit, not two: the commit that records one compensation's outcome also
    claims the next one (or settles the run), so every compensation is still recorded, with its lease,
    before its tool is called.

    Returns the run as the unwind leaves it: as the call that settled it wrote it (PostgreSQL's one-call path), or
    else read again. `tenant_id`, when the caller knows it, spares reading it first.
    """
    owner = new_owner(held=True)
    started = time.monotonic()
    if tenant_id is None:
        tenant_id = Run.objects.values_list("tenant_id", flat=True).get(pk=run_id)

    def within_budget() -> bool:
        return budget is None or time.monotonic() - started <= budget

    def following() -> Action | None:
        if not within_budget():
            enqueue("ledger.tasks.unwind_run", run_id)
            return None
        return next_compensation(run_id, tenant_id=tenant_id, owner=owner)

    chain = NextUndo(run_id, owner=owner, allowed=within_budget)
    claimed, compensation = claim_unwind(run_id, tenant_id=tenant_id, owner=owner, chain=chain)
    if not claimed:
        return Run.objects.get(pk=run_id)
    try:
        while compensation is not None:
            failpoints.hit("mid_unwind")
            if compensation.tool.executor == Executor.CLIENT:
                break  # the agent runs it and reports; its report continues the unwind
            if drift_detected(compensation):
                chain.state = None
                compensation = following()
                continue
            chain.claimed = []
            execute(compensation.pk, owner=owner, sole_owner=True, on_compensated=chain, claimed=compensation,
                    budget=None if budget is None else max(0.0, budget - (time.monotonic() - started)))
            if chain.claimed:
                compensation = chain.claimed[0]
                continue
            chain.state = None
            compensation.refresh_from_db(fields=["status"])
            if compensation.status not in (A.SUCCEEDED, A.FAILED, A.LOST):
                break  # scheduled for a later retry; its completion continues the unwind
            compensation = following()
    finally:
        # Settling already cleared the lease; only a run left unwinding still holds it.
        if chain.settled is None:
            Run.objects.filter(pk=run_id, lease_expires_at__isnull=False).update(lease_expires_at=None)
    return chain.settled or Run.objects.get(pk=run_id)


class NextUndo:
    """What the unwinder asks of the commit that records a compensation's success: claim the next compensation in
    it too (as `owner`), while `allowed()` (its time budget). The claim (or None: nothing to claim now, the run
    settled or waits) lands in `claimed`."""

    def __init__(self, run_id: int, *, owner: str, allowed: Callable[[], bool]):
        self.run_id, self.owner, self.allowed = run_id, owner, allowed
        self.claimed: list[Action | None] = []
        # PostgreSQL: the run as the last one-call left it (`UnwindState`), which the next decision starts from
        # instead of reading it again; the next call still checks every status under its locks.
        self.state: UnwindState | None = None
        self.settled: Run | None = None  # the run, when a one-call settled it: the unwind's answer, as it was written

    def __call__(self, log: AuditLog, run: Run) -> None:
        if self.allowed():
            self.claimed.append(claim_next_compensation(self.run_id, owner=self.owner, log=log, run=run))


def claim_unwind(run_id: int, *, tenant_id: int, owner: str, chain: NextUndo | None = None) -> tuple[bool, Action | None]:
    """Take the run's unwind lease and claim its first compensation in one commit.

    Returns (False, None) when another unwinder holds the lease or the run is not unwinding.
    """
    if fastpath.usable(tenant_id):
        claimed = _claim_unwind_in_one_call(run_id, owner=owner, chain=chain)
        if claimed is not None:
            return claimed
    with ledger_transaction(tenant_id) as audit:
        claimed = Run.objects.filter(pk=run_id, status=R.UNWINDING).filter(
            Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=timezone.now())
        ).update(lease_expires_at=lease_at_write(model=Run, pk=run_id))
        if claimed != 1:
            return False, None
        return True, claim_next_compensation(run_id, owner=owner, log=audit)


def next_compensation(run_id: int, *, owner: str, tenant_id: int | None = None) -> Action | None:
    """Pick the newest action still to compensate and claim its compensation; settle the run if none is left.

    Returns the claimed compensation (status running, lease held by `owner`), or None when the unwinder
    should stop (the run settled, or it waits for something: an in-flight step, an approval, a report).
    """
    if tenant_id is None:
        tenant_id = Run.objects.values_list("tenant_id", flat=True).get(pk=run_id)
    with ledger_transaction(tenant_id) as audit:
        return claim_next_compensation(run_id, owner=owner, log=audit)


def claim_next_compensation(run_id: int, *, owner: str, log: AuditLog, run: Run | None = None) -> Action | None:
    """`next_compensation` inside the caller's ledger transaction (`run`: the run as it already locked it)."""
    run = run if run is not None else sql.get_locked(Run, run_id)
    if run.status != R.UNWINDING:
        return None
    steps = run_steps(run.pk)
    if any(status in PENDING for _, _, status, _ in steps):
        skip_pending(run, log=log, actor=SYSTEM, why="the run is being unwound", forward_only=True)
        steps = run_steps(run.pk)
    steps = [step for step in steps if step[2] in (A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED, A.COMPENSATING)]
    if any(status in (A.RUNNING, A.RETRY_SCHEDULED) for _, _, status, _ in steps):
        return None  # a step in flight, or one that may have acted; when it lands it re-enqueues the unwind
    candidate, tool_name = None, ""
    for action_id, _, _, tool_name in reversed(steps):  # newest first; usually the newest is the one
        step = sql.get(Action, pk=action_id)
        if compensable(step):
            candidate = step
            break
    if candidate is None:
        settle(run, log=log)
        return None
    compensation = None
    if candidate.status == A.COMPENSATING:
        compensation = candidate.compensations.select_related("tool").order_by("-id").first()
    if compensation is not None and compensation.status not in (A.REJECTED, A.EXPIRED):  # else: a new one is planned
        if compensation.status == A.LOST:
            # The undo may or may not have acted, and nothing can tell: a person decides (`settle` puts the run in the
            # recovery queue, naming it), never a silent wait.
            settle(run, log=log)
            return None
        if compensation.status in (A.FAILED, A.APPROVED):
            retry = compensation.status == A.FAILED
            action_transition(compensation, A.RUNNING, log=log, actor=SYSTEM, attempts=compensation.attempts + 1,
                              max_attempts=compensation.attempts + compensation.tool.max_attempts if retry
                              else compensation.max_attempts,
                              lease_owner=owner,
                              lease_expires_at=lease_at_write(compensation.tool.timeout_seconds, row=compensation))
            start_attempt(compensation, owner, log=log)
            return compensation
        return None  # awaiting approval, running elsewhere, waiting for a retry or for the agent's report
    planned = plan_compensation(run, candidate, tool_name, owner=owner, log=log)
    if planned is None and candidate.status == A.COMPENSATION_FAILED:
        # Its undo could not even be put together (recorded and alerted): the rest go on, or the run settles.
        return claim_next_compensation(run_id, owner=owner, log=log, run=run)
    return planned


def compensation_tool(run: Run, plan: dict) -> Tool | None:
    """The version of the compensation's tool bound when the forward step was proposed (`tool_id` in its plan),
    so an undo runs with the policy the step was taken under. A plan without one (recorded before tool versions,
    or whose client-executed twin was not registered then) takes the current version of the named tool."""
    if isinstance(plan.get("tool_id"), int):
        where = {"pk": plan["tool_id"], "tenant": run.tenant_id}
    elif isinstance(plan.get("tool"), str):
        where = {"tenant": run.tenant_id, "name": plan["tool"], "is_current": True}
    else:
        return None
    tool, (slug,) = sql.get_also(Tool, (_TENANT_SLUG,), **where)
    if tool is not None:  # its tenant's slug signs its calls; the rest of the tenant loads if asked
        tool.tenant = Tenant.from_db(tool._state.db, ["id", "slug"], [tool.tenant_id, slug])
    return tool


_TENANT_SLUG = "(SELECT slug FROM ledger_tenant WHERE ledger_tenant.id = ledger_tool.tenant_id)"


def undo_args(forward: Action):
    """The arguments of `forward`'s undo: those a person completed for it (ledger/engine/undo_plans.py), else its
    plan's mapping resolved just in time from the step (MappingError when it cannot be)."""
    plan = forward.compensation_plan
    if isinstance(plan.get("completed_args"), dict):
        return plan["completed_args"]
    return mapping.resolve(plan.get("args", {}), context_for(forward))


def plan_compensation(run: Run, forward: Action, forward_tool: str, *, owner: str, log: AuditLog) -> Action | None:
    """Create the compensation action for `forward` (a call of the tool named `forward_tool`), with its args
    resolved just in time."""
    plan = forward.compensation_plan
    tool = compensation_tool(run, plan)
    try:
        if tool is None:
            raise mapping.MappingError(f"compensation tool {plan.get('tool')!r} is not registered")
        args = undo_args(forward)
    except mapping.MappingError as error:
        if forward.status == A.SUCCEEDED:
            action_transition(forward, A.COMPENSATING, log=log, actor=SYSTEM)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=SYSTEM, note={"error": str(error)})
        events.emit("compensation_failed", action=None, forward=forward)
        return None
    taken, threshold, defaults_version = take_seq(run.pk)
    run.next_seq = taken.next_seq
    required = undo_approvals(forward, threshold)
    claim_now = not required and tool.executor != Executor.CLIENT
    # A forward step still `succeeded` has never had a compensation planned: no need to count them.
    earlier = 0 if forward.status == A.SUCCEEDED else forward.compensations.count()
    compensation = new_compensation(run, forward, forward_tool, tool, args=args, seq=run.next_seq - 1,
                                    defaults_version=defaults_version, required=required, owner=owner, earlier=earlier)
    if compensation.lease_expires_at is not None:  # the run is locked: its lease starts at the insert
        compensation.lease_expires_at = lease_at_write(tool.timeout_seconds)
    sql.insert(compensation)
    log.record("compensation.proposed", actor=SYSTEM, action=compensation, compensates=forward.pk,
               strategy=plan.get("strategy"))
    if forward.status == A.SUCCEEDED:
        action_transition(forward, A.COMPENSATING, log=log, actor=SYSTEM, note={"compensation": compensation.pk})
    if required:
        events.emit("approval_required", action=compensation, requested_by=SYSTEM)
        return None
    if claim_now:
        start_attempt(compensation, owner, log=log)
    return compensation if claim_now else None


def undo_approvals(forward: Action, threshold: str) -> int:
    """How many approvals the compensation of `forward` needs, by its plan and the tenant's threshold."""
    plan = forward.compensation_plan
    return approvals_needed(rule=plan.get("approval", "threshold"), risk=plan.get("risk", forward.risk),
                            required=plan.get("approvals_required", 1), threshold=threshold)


def new_compensation(run: Run, forward: Action, forward_tool: str, tool: Tool, *, args, seq: int,
                     defaults_version: int, required: int, owner: str, earlier: int) -> Action:
    """The compensation of `forward` (a call of `forward_tool`) with its resolved `args`, as it is recorded: gated
    (`required` approvals), claimed by `owner`, or (a client-executed tool) left for the agent. `earlier`: how many
    compensations of it were planned before (each has a key of its own)."""
    plan = forward.compensation_plan
    args_text = received.dumps(args)  # the values `$args.…` took, as the agent wrote them: what the tool receives
    args = canonical(args)
    claim_now = not required and tool.executor != Executor.CLIENT
    return Action(
        tenant_id=run.tenant_id, run=run, seq=seq, kind=ActionKind.COMPENSATION, compensates=forward, tool=tool,
        saga_role=tool.saga_role, risk=plan.get("risk", forward.risk), args=args, args_text=args_text,
        args_hash=digest(args),
        target_type=forward.target_type, target_id=forward.target_id,
        idempotency_key=f"{forward.idempotency_key}:undo" + (f":{earlier + 1}" if earlier else ""),
        key_agent=forward.key_agent,
        key_source="compensation",
        status=A.AWAITING_APPROVAL if required else A.RUNNING, approvals_required=required,
        defaults_version=defaults_version, attempts=0 if required else 1, max_attempts=tool.max_attempts,
        lease_owner=owner if claim_now else "",
        lease_expires_at=lease_until(tool.timeout_seconds) if not required else None,
        intent={"goal": f"undo step {forward.seq} ({forward_tool})", "strategy": plan.get("strategy")},
        compensation_plan={"strategy": CompensationStrategy.NONE, "force": bool(plan.get("force"))},
    )


def drift_detected(compensation: Action) -> bool:
    """Guarantee 7: before a snapshot restore, compare the target now with the after-snapshot.

    If someone changed it since, do not overwrite: fail the compensation as `drift` and let the run
    go to the recovery queue. An operator may force it (`force` on the plan).
    """
    # The unwinder planned or picked this compensation from its forward step a moment ago, in the same
    # transaction: the forward step is already in memory (its plan and after-snapshot no longer change).
    forward = compensation.compensates
    if forward.compensation_plan.get("strategy") != CompensationStrategy.SNAPSHOT or compensation.compensation_plan.get("force"):
        return False
    try:
        current = snapshot_fields(forward.tool, read_target(forward.tool, forward.target_id))
    except ToolError as error:
        record_failure(compensation, ToolError(f"drift check could not read the target: {error.message}",
                                               transient=error.transient, status=error.status),
                       latency_ms=None, retry_inline=False, delay=backoff_delay(compensation.tool, compensation.attempts),
                       owner=compensation.lease_owner)
        return True
    if current == forward.after:
        return False
    changed = sorted(k for k in (current or {}) if (forward.after or {}).get(k) != (current or {}).get(k)) \
        if isinstance(current, dict) else ["state"]
    error = ToolError(f"{forward.target_type or 'target'} {forward.target_id} changed since step {forward.seq} "
                      f"({', '.join(changed)}); not overwriting someone else's change", transient=False)
    error_class = "drift"
    with ledger_transaction(compensation.tenant_id) as audit:
        finish_attempt(compensation, "drift", latency_ms=None, error=error, log=audit)
        action_transition(compensation, A.FAILED, log=audit, actor=SYSTEM, note={"current": current},
                          lease_owner="", lease_expires_at=None, error_class=error_class, error_message=error.message)
        after_failure(compensation, log=audit, actor=SYSTEM)
    return True


def settle(run: Run, *, log: AuditLog) -> None:
    """Nothing is left to compensate: the run is compensated, or a person must look at what remains."""
    actions = list(run.actions.select_related("tool").order_by("seq"))
    failed = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.COMPENSATION_FAILED]
    standing = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.SUCCEEDED
                and a.tool.action_class != ActionClass.READ_ONLY and not compensable(a)]
    lost = [a for a in actions if a.status == A.LOST and not unknowns.left_to_person(a)]
    if not failed and not standing and not lost:
        left = [a for a in actions if unknowns.left_to_person(a)]
        # A step a person took over (their one decision on the run, ledger/engine/unknowns.py) ends it closed.
        run_transition(run, R.CLOSED if left else R.COMPENSATED, log=log, actor=SYSTEM, lease_expires_at=None,
                       note={"left_to_person": [a.pk for a in left]} if left else None)
        checkpoint_save(run, "closed" if left else "compensated", log=log)
        events.emit("run_finished", run=run)
        return
    comps = {a.compensates_id: a for a in actions if a.kind == ActionKind.COMPENSATION}  # newest wins: ordered by seq
    drift = [a for a in failed if comps.get(a.pk) is not None and comps[a.pk].error_class == "drift"]
    parts = []
    for a in failed:
        comp = comps.get(a.pk)
        parts.append(f"{a.tool.name} (step {a.seq}) could not be compensated: "
                     f"{comp.error_message if comp else 'no compensation could be planned'}")
    parts += [f"{a.tool.name} (step {a.seq}) has no compensation and still stands" for a in standing]
    parts += [f"{a.tool.name} (step {a.seq}) has an unknown outcome: it may have acted" for a in lost]
    lost_reason = next((cls for cls in ("settle_failed", "outcome_unknown") if any(a.error_class == cls for a in lost)),
                       "lease_lost")
    reason = "drift" if drift else "compensation_failed" if failed else lost_reason if lost else "irreversible_effects"
    first = (drift or failed or lost or standing)[0]
    needs_attention(run, reason, "; ".join(parts), action=first, log=log)
