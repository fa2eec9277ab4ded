"""The engine's loops: execute a claimed step (call its tool, retry, read back) and unwind a run newest-first.

What they stand on, lowest first (docs/architecture.md; tests/test_layers.py keeps imports one way):
attempts (leases and attempts) < readback (targets, snapshots, lookups) < runstate (checkpoints, a run that needs a
person, settling the run) < unwinding (planning and claiming undos) < outcomes (recording what a call did) < here.

A step costs two commits on the fast path: the proposal inserts the action already claimed (status
running, with a lease), and the outcome commit records result, snapshots, verification and the
compensation plan together. Tool calls and snapshot reads always happen outside any transaction.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from django.db.models import F, Q

from ledger import tracing
from ledger.audit import sealed
from ledger.audit.chain import ledger_transaction
from ledger.db import sql
from ledger.engine import attempts, failpoints, outcomes, readback, runstate, unwind_plans, unwinding
from ledger.engine.dispatch import HELD, enqueue, new_owner
from ledger.engine.transitions import action_transition
from ledger.errors import StateConflict
from ledger.executors.call import ToolError, ToolOutcome, http_call, mcp_call, python_call, resolve_url
from ledger.models import Action, ActionKind, ActionStatus as A, CompensationStrategy, Executor, Run, RunStatus as R

log = logging.getLogger("unwind.engine")

INLINE_RETRY_LIMIT = 2.0  # seconds: longer backoffs are scheduled, not slept through


# --- calling tools ---------------------------------------------------------------------------------

def call_tool(action: Action, args) -> ToolOutcome:
    """Call the step's tool with `args`: those `sealed.checked_args` answered for it (what was proposed or approved)."""
    tool = action.tool
    if tool.executor == Executor.HTTP:
        url = resolve_url(tool.endpoint, target=action.target_id)
        return http_call(url=url, args=args, idempotency_key=action.tool_key,
                         timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    if tool.executor == Executor.PYTHON:
        return python_call(path=tool.endpoint, args=args, idempotency_key=action.tool_key,
                           target=action.target_id or None, tenant=tool.tenant.slug)
    if tool.executor == Executor.MCP:
        return mcp_call(endpoint=tool.endpoint, args=args, idempotency_key=action.tool_key,
                        timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    raise ToolError("client-executed tools are run by the agent, which reports the outcome", transient=False)


def send(action: Action, owner: str) -> ToolOutcome | None:
    """Call the tool with what its row's seal recorded (sealed.Tampered, and nothing leaves, when the row differs);
    for one that ignores keys, only once the attempt is marked sent (None: the lease is gone)."""
    if action.kind == ActionKind.COMPENSATION:
        sealed.check_undo(action, undo_args=unwinding.undo_args)
    args = sealed.checked_args(action)
    if not action.tool.honours_idempotency_key and not attempts.mark_sent(action, owner):
        return None
    return call_tool(action, args)


def refuse_tampered(action: Action, tampered: sealed.Tampered, *, owner: str) -> None:
    """A claimed step whose row is not what the audit chain recorded (`sealed.checked_args`): it is not sent. It fails
    as `tampered`, the refusal is recorded for `verify_audit` (`sealed.TAMPERING`), and its run goes before a person,
    whatever its saga would do with a failure: an unwind would send more calls from a ledger someone rewrote.
    Resuming or compensating it later refuses the step again while its row differs."""
    why = f"{action.tool.name} (step {action.seq}) was not sent: {tampered.problem}"
    with ledger_transaction(action.tenant_id) as audit:
        attempts.finish_attempt(action, sealed.TAMPERED, latency_ms=None, log=audit,
                                error=ToolError(why, transient=False, not_sent=True))
        action_transition(action, A.FAILED, log=audit, actor=attempts.SYSTEM, where=Q(lease_owner=owner),
                          note={"check": tampered.check}, lease_owner="", lease_expires_at=None,
                          error_class=sealed.TAMPERED, error_message=why[:2000])
        audit.record(sealed.TAMPERING, actor=attempts.SYSTEM, action=action, check=tampered.check,
                     problem=tampered.problem[:1000])
        if action.kind == ActionKind.COMPENSATION:
            forward = Action.objects.select_related("tool").get(pk=action.compensates_id)
            if forward.status == A.COMPENSATING:
                action_transition(forward, A.COMPENSATION_FAILED, log=audit, actor=attempts.SYSTEM,
                                  note={"error": why[:500]})
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL, R.UNWINDING):
            runstate.needs_attention(run, sealed.TAMPERED, why, action=action, log=audit)
    log.error("refused to send action %s: %s", action.pk, tampered.problem)


def run_stopped(action: Action) -> bool:
    """The run was cancelled or is being unwound (or is over): a retry there must not call the tool again."""
    status, cancelled = Run.objects.values_list("status", "cancel_requested_at").get(pk=action.run_id)
    return bool(cancelled) or status not in (R.RUNNING, R.AWAITING_APPROVAL)


def resolve_without_calling(action: Action, *, owner: str) -> None:
    """In a stopped run, find out whether the earlier attempt acted, instead of trying again."""
    try:
        evidence = readback.already_done(action) if attempts.an_attempt_may_have_acted(action) else None
    except ToolError as unreadable:
        outcomes.record_unknown(action, ToolError(action.error_message or "no answer", transient=True),
                       why=unreadable.message, latency_ms=None, actor=attempts.SYSTEM)
        return
    if evidence is not None:
        outcomes.record_success(action, readback.read_back_outcome(evidence), latency_ms=None)
        return
    outcomes.record_failure(action, ToolError("not tried again: the run stopped, and the earlier attempt did not act",
                                     transient=False), latency_ms=None, retry_inline=False, delay=0, owner=owner)


def defer(action: Action, until, *, owner: str, actor: str = attempts.SYSTEM) -> None:
    """Put a claimed action back to wait until `until` (its retry is claimed again by the sweep)."""
    with ledger_transaction(action.tenant_id) as audit:
        attempts.finish_attempt(action, "deferred", latency_ms=None, log=audit)
        action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, where=Q(lease_owner=owner),
                          note={"why": "waiting for the earlier call to be over before reading it back"},
                          next_attempt_at=until, lease_owner="", lease_expires_at=None)


def execute(action_id: int, *, owner: str, budget: float | None = None, sole_owner: bool = False,
            on_compensated: unwinding.NextUndo | None = None, claimed: Action | None = None) -> Action:
    """Run a claimed action (status running, lease held by `owner`) to an outcome.

    Transient failures are retried inline while the backoff is short and the budget allows;
    otherwise the retry is scheduled for the sweeper. Returns the action as it ends here.
    `on_compensated`: the unwinder whose commit recording a compensation's success also claims the next undo (see
    `unwind`).
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
    # With its run read in the same statement: its fingerprint key (ledger/audit/subjects.py) for the seal check and
    # the outcome's event, and the run its outcome is decided from (ledger/engine/outcome_plans.py; the writer checks
    # it has not changed since).
    action = claimed if sole_owner and claimed is not None and claimed.pk == action_id \
        else Action.objects.select_related("tool", "run").annotate(run_fingerprint_key=F("run__fingerprint_key")).get(
            pk=action_id)
    with tracing.step(action) as attempt:
        return attempt.ended(_execute(action, owner=owner, budget=budget, started=started,
                                      on_compensated=on_compensated, attempt=attempt))


def _execute(action: Action, *, owner: str, budget: float | None, started: float,
             on_compensated: unwinding.NextUndo | None, attempt) -> Action:
    while True:
        if action.status != A.RUNNING or action.lease_owner != owner:
            return action
        stopped = action.kind == ActionKind.FORWARD and action.attempts > 1 and run_stopped(action)
        if attempts.needs_read_back(action) or stopped:
            until = attempts.settles_at(action)
            if until is not None:
                defer(action, until, owner=owner)
                return action
        if stopped:
            outcomes.settling(action, owner, "finding out whether the earlier attempt acted", None,
                     lambda: resolve_without_calling(action, owner=owner))
            return action
        t0 = time.monotonic()
        failpoints.hit("before_tool_call")
        try:
            # After an attempt that was sent and may have acted: read back first. Found, it is the result; not
            # found (and, `settles_at`, nothing can still arrive), the step is sent again under this new attempt.
            reading_back = attempts.needs_read_back(action)
            found = outcomes.settling(action, owner, "reading the step back", None, lambda: readback.already_done(action)) \
                if reading_back else None
            if found is outcomes.SETTLED:
                return action
            if reading_back and found is None and readback.read_back_pass(action):
                raise ToolError("its calls went unanswered, and reading it back once they were over found nothing: "
                                "it did not act", transient=False, not_sent=True)
            outcome = readback.read_back_outcome(found) if found is not None else send(action, owner)
            if outcome is None:  # the lease ran out before the call left: the sweep sends it again
                return Action.objects.select_related("tool").get(pk=action.pk)
        except sealed.Tampered as tampered:
            try:
                outcomes.settling(action, owner, "refusing a step edited behind the services' back", None,
                                  lambda: refuse_tampered(action, tampered, owner=owner))
            except StateConflict:
                pass  # the lease is no longer ours: whoever holds it checks the row again before sending
            return action
        except ToolError as error:
            latency = (time.monotonic() - t0) * 1000
            delay = attempts.retry_delay(action, error)
            attempts.keep_trying(action, error, owner=owner, delay=delay)
            remaining = None if budget is None else budget - (time.monotonic() - started)
            inline = delay <= INLINE_RETRY_LIMIT and (remaining is None or delay < remaining) \
                and not attempts.patient(action, error)
            retried = outcomes.settling(action, owner, "recording the tool's error", None, lambda: outcomes.record_failure(
                action, error, latency_ms=latency, retry_inline=inline, delay=delay, owner=owner))
            if retried is True and inline:
                time.sleep(delay)
                attempt.again()
                continue
            return action
        latency = (time.monotonic() - t0) * 1000
        failpoints.hit("after_tool_call")
        outcomes.settling(action, owner, "recording the tool's answer", outcome.result, lambda: outcomes.record_success(
            action, outcome, latency_ms=latency, on_compensated=on_compensated))
        return action


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
        return unwinding.next_compensation(run_id, tenant_id=tenant_id, owner=owner)

    chain = unwinding.NextUndo(run_id, owner=owner, allowed=within_budget)
    claimed, compensation = unwind_plans.claim_unwind(run_id, tenant_id=tenant_id, owner=owner, chain=chain)
    if not claimed:
        return Run.objects.get(pk=run_id)
    try:
        with sealed.one_seal_read_per_unwind(run_id):
            _undo_each(compensation, chain, owner=owner, budget=budget, started=started, following=following)
    finally:
        # Settling already cleared the lease; only a run left unwinding still holds it.
        if chain.settled is None:
            Run.objects.filter(pk=run_id, lease_expires_at__isnull=False).update(lease_expires_at=None)
    return chain.settled or Run.objects.get(pk=run_id)


def _undo_each(compensation: Action | None, chain: unwinding.NextUndo, *, owner: str, budget: float | None,
               started: float, following: Callable[[], Action | None]) -> None:
    """`unwind`'s loop: each claimed undo run to its outcome, the next taken from the commit that recorded it."""
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
        current = readback.snapshot_fields(forward.tool, readback.read_target(forward.tool, forward.target_id))
    except ToolError as error:
        unread = ToolError(f"drift check could not read the target: {error.message}", transient=error.transient,
                           status=error.status)
        delay = attempts.retry_delay(compensation, unread)
        attempts.keep_trying(compensation, unread, owner=compensation.lease_owner, delay=delay)
        outcomes.record_failure(compensation, unread, latency_ms=None, retry_inline=False, delay=delay,
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
        attempts.finish_attempt(compensation, "drift", latency_ms=None, error=error, log=audit)
        action_transition(compensation, A.FAILED, log=audit, actor=attempts.SYSTEM, note={"current": current},
                          lease_owner="", lease_expires_at=None, error_class=error_class, error_message=error.message)
        outcomes.after_failure(compensation, log=audit, actor=attempts.SYSTEM)
    return True


