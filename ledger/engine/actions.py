"""Entry points for actions: propose, report a client-executed outcome, approve, reject, expire."""
from __future__ import annotations

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from ledger import events
from ledger.audit.chain import ledger_transaction
from ledger.canonical import canonical, storable
from ledger.db import sql
from ledger.db.partitions import recent
from ledger.engine import attempts, holds, outcomes, runstate
from ledger.engine.dispatch import enqueue, new_owner
from ledger.engine.leases import db_now, lease_at_write, queued_seconds
from ledger.engine.transitions import action_transition, run_transition
from ledger.errors import StateConflict, ValidationFailed
from ledger.executors.call import ToolError, ToolOutcome
from ledger.models import Action, ActionKind, ActionStatus as A, Attempt, Executor, Run, RunStatus as R


def action_report(*, action: Action, ok: bool, result=None, error: str = "", actor: str,
                  refused: bool = False) -> Action:
    """The agent reports the outcome of a client-executed tool (forward or compensation).

    A failure reported as `refused` (the tool turned the call down: nothing happened) follows the tool's
    `on_refusal`, like an executed tool's 4xx; any other reported failure fails the step as always.
    """
    if action.tool.executor != Executor.CLIENT:
        raise StateConflict(f"{action.tool.name} is executed by Unwind, not reported by the agent")
    if action.status != A.RUNNING:
        if action.status in (A.SUCCEEDED, A.COMPENSATING, A.COMPENSATED) and ok and action.result == canonical(result or {}):
            return action  # the same report again
        raise StateConflict(f"action {action.pk} is {action.status}; it is not waiting for a report")
    if ok:
        outcomes.record_success(action, ToolOutcome(result=storable(result if result is not None else {}, field="result")),
                                 latency_ms=None, actor=actor)
    else:
        outcomes.record_failure(action, ToolError(error or "the agent reported a failure", transient=False,
                                                   refused=refused),
                                 latency_ms=None, retry_inline=False, delay=0, owner=action.lease_owner, actor=actor)
    action.refresh_from_db()
    return action


def action_approve(*, action: Action, args_hash: str, actor: str) -> Action:
    """Release an action that waited for approval. The approval is bound to the exact args hash."""
    if args_hash != action.args_hash:
        raise StateConflict("the approval was given for other arguments than this action's; it does not apply")
    owner = new_owner()
    with ledger_transaction(action.tenant_id) as audit:
        run = sql.get_locked(Run, action.run_id)
        action_transition(action, A.APPROVED, log=audit, actor=actor)
        if action.kind == ActionKind.COMPENSATION:
            runstate.enqueue_unwind_after(run)
            return action
        if run.cancel_requested_at or run.status not in (R.RUNNING, R.AWAITING_APPROVAL):
            return action
        if holds.hold_approved(action, run, log=audit, actor=actor):
            return action
        client = action.tool.executor == Executor.CLIENT
        action_transition(action, A.RUNNING, log=audit, actor=actor, attempts=action.attempts + 1,
                          lease_owner="" if client else owner,
                          lease_expires_at=lease_at_write(queued_seconds(action.tool), row=action))
        attempts.start_attempt(action, owner, log=audit)
        if run.status == R.AWAITING_APPROVAL and not run.actions.filter(status=A.AWAITING_APPROVAL).exists():
            run_transition(run, R.RUNNING, log=audit, actor=actor)
        if not client:
            enqueue("ledger.tasks.execute_action", action.pk, owner)
    return action


def action_reject(*, action: Action, reason: str, actor: str, expired: bool = False, voided: bool = False) -> Action:
    """A rejection (or expiry) of a gated action: unwind before the pivot, recovery queue after it."""
    if not reason.strip():
        raise ValidationFailed("a rejection needs a reason", field="reason")
    with ledger_transaction(action.tenant_id) as audit:
        run = sql.get_locked(Run, action.run_id)
        action_transition(action, A.EXPIRED if expired else A.REJECTED, log=audit, actor=actor,
                          note={"reason": reason[:1000]}, decision_reason=reason[:4000])
        word = "expired" if expired else "was rejected"
        if action.kind == ActionKind.COMPENSATION:
            forward = Action.objects.get(pk=action.compensates_id)
            action_transition(forward, A.COMPENSATION_FAILED, log=audit, actor=actor,
                              note={"error": f"compensation {word}: {reason}"[:500]})
            events.emit("compensation_failed", action=action, forward=forward)
            if run.status == R.UNWINDING:
                runstate.enqueue_unwind_after(run)
            return action
        if run.status not in (R.RUNNING, R.AWAITING_APPROVAL):
            return action
        why = f"{action.tool.name} (step {action.seq}) {word}: {reason}"
        if run.pivot_committed:
            runstate.needs_attention(run, "approval_expired" if expired else "approval_rejected",
                                      why + ". The pivot has committed, so the run cannot be unwound automatically.",
                                      action=action, log=audit)
        else:
            runstate.start_unwind(run, why, log=audit, actor=actor, step=action,
                                  cause="expired" if expired else "voided" if voided else "rejected")
    return action


def action_reclaim(action_id: int) -> str | None:
    """Crash recovery: take over an action whose lease expired. Returns the new owner, or None if not ours."""
    owner = new_owner()
    now = db_now()  # the clock the lease was written on, whatever this machine's says
    action = Action.objects.select_related("tool").get(pk=action_id)
    if action.status != A.RUNNING or action.lease_expires_at is None or action.lease_expires_at >= now:
        return None
    try:
        with ledger_transaction(action.tenant_id) as audit:
            sent = _close_lost_attempt(action)
            tool = action.tool
            lost = attempts.attempts_that_may_have_acted(action).filter(outcome="lost").count()
            why = ""
            if tool.executor == Executor.CLIENT:
                why = "the agent never reported the outcome"
            elif sent and not (tool.honours_idempotency_key or tool.lookup.get("read") or tool.verify.get("expect")):
                why = "the worker was lost mid-call and the tool can neither be read back nor deduplicated"
            elif lost >= settings.UNWIND_MAX_RECLAIMS:
                why = (f"its worker was lost {lost} times with the call sent and no outcome recorded; it is not taken "
                       f"over again (UNWIND_MAX_RECLAIMS)")
            if why:
                action_transition(action, A.LOST, log=audit, actor="system:sweeper", note={"why": why},
                                  where=_lease_still(action), lease_owner="", lease_expires_at=None,
                                  error_class="lease_lost", error_message=why)
                run = sql.get_locked(Run, action.run_id)
                if run.status in (R.RUNNING, R.AWAITING_APPROVAL, R.UNWINDING):
                    runstate.needs_attention(run, "lease_lost", f"{action.tool.name} (step {action.seq}): {why}",
                                              action=action, log=audit)
                return None
            action_transition(action, A.RUNNING, log=audit, actor="system:sweeper", where=_lease_still(action),
                              note={"reclaimed_from": action.lease_owner}, attempts=action.attempts + 1,
                              max_attempts=max(action.max_attempts, action.attempts + 1), lease_owner=owner,
                              lease_expires_at=lease_at_write(queued_seconds(tool), row=action))
            attempts.start_attempt(action, owner, log=audit)
    except StateConflict:
        return None
    return owner


def _close_lost_attempt(action: Action) -> bool:
    """End the reclaimed step's current attempt as lost; True when it was sent (or, for a tool that honours keys,
    may have been: those are not marked). The update locks the attempt's row, as `attempts.mark_sent` does, so a
    mark made under the lease just before it ran out is seen here, and none can be made after."""
    sql.update(Attempt, attempts.open_attempt(action), finished_at=timezone.now(), outcome="lost")
    if action.tool.honours_idempotency_key:
        return True
    return Attempt.objects.filter(action=action, number=action.attempts, sent_at__isnull=False,
                                  started_at__gte=recent(action.created_at)).exists()


def _lease_still(action: Action):
    return Q(lease_expires_at=action.lease_expires_at, attempts=action.attempts)


def action_claim_due(action_id: int) -> str | None:
    """Claim a scheduled retry whose time has come. Returns the owner, or None if another worker has it."""
    owner = new_owner()
    action = Action.objects.select_related("tool").get(pk=action_id)
    if action.status != A.RETRY_SCHEDULED:
        return None
    try:
        with ledger_transaction(action.tenant_id) as audit:
            action_transition(action, A.RUNNING, log=audit, actor="system:sweeper",
                              where=Q(next_attempt_at__lte=db_now()), attempts=action.attempts + 1,
                              next_attempt_at=None, lease_owner=owner,
                              lease_expires_at=lease_at_write(queued_seconds(action.tool), row=action))
            attempts.start_attempt(action, owner, log=audit)
    except StateConflict:
        return None
    return owner
