"""Holds: an undo window before a step runs ("undo send").

A tool's policy may say `hold: 30s` (or `hold: {for: 30s, customer_can_stop: true}`). A step of it that is ready to
run (proposed and, where needed, approved; the ordering law satisfied) is recorded `held`, with the time it runs in
`next_attempt_at` (the database's clock plus the window), instead of being claimed. The agent is answered at once
(202). When the window ends the sweep releases it (`held → running`, the same claim a due retry gets) and a worker
executes it through the engine like any other step. Until then it can be stopped (`held → skipped`): by the agent
(cancelling its run skips it, like any pending step), an operator, an approver who approved it, or, where the policy
allows, the person the run acts for (from the correction trail's share page); who may stop is decided by the
callers (recovery/stops.py), this module records the stop and goes on by the saga law.

Release and stop are both a conditional update from `held` taken under the tenant's chain lock and the run's row
lock, so of a stop and a release racing exactly one wins, on SQLite and PostgreSQL alike.
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import Min, Q

from ledger import events
from ledger.db import sql
from ledger.engine import attempts, runstate
from ledger.engine.leases import db_now
from ledger.audit import sealed
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.errors import StateConflict
from ledger.models import Action, ActionKind, ActionStatus as A, Run, RunStatus as R, Tool
from ledger.engine.dispatch import enqueue, new_owner
from ledger.engine.transitions import action_transition, run_transition

logger = logging.getLogger("unwind.engine")

RELEASER = "system:hold"
BATCH = 200
# Who stopped a held step (`Action.stopped_by`), as pages name them.
STOPPERS = ("agent", "operator", "approver", "customer")


def window(tool: Tool) -> float | None:
    """The tool's hold in seconds, or None when its steps run at once."""
    seconds = (tool.hold or {}).get("seconds")
    return float(seconds) if seconds else None


def customer_can_stop(tool: Tool) -> bool:
    return bool((tool.hold or {}).get("customer_can_stop"))


# --- holding -------------------------------------------------------------------------------------------------

def hold_new(action: Action, tool: Tool) -> bool:
    """Before a new, claimable step is inserted: make it held instead when its tool has a hold. True when it is."""
    seconds = window(tool)
    if seconds is None:
        return False
    action.status = A.HELD
    action.attempts = 0
    action.lease_owner, action.lease_expires_at = "", None
    action.next_attempt_at = db_now() + timedelta(seconds=seconds)
    return True


def announce(action: Action, run: Run, *, log: AuditLog, actor: str) -> None:
    """Record that `action` is held (in the transaction that made it so) and tell the other apps."""
    log.record("forward.held", actor=actor, action=action, executes_at=action.next_attempt_at.isoformat(),
               customer_can_stop=customer_can_stop(action.tool))
    events.emit("action_held", action=action, run=run)


def hold_approved(action: Action, run: Run, *, log: AuditLog, actor: str) -> bool:
    """After an approval: a step of a tool with a hold waits out its window (from now) instead of being claimed."""
    seconds = window(action.tool)
    if seconds is None:
        return False
    action_transition(action, A.HELD, log=log, actor=actor, next_attempt_at=db_now() + timedelta(seconds=seconds))
    if run.status == R.AWAITING_APPROVAL and not run.actions.filter(status=A.AWAITING_APPROVAL).exists():
        run_transition(run, R.RUNNING, log=log, actor=actor)
    announce(action, run, log=log, actor=actor)
    return True


# --- the window ends ----------------------------------------------------------------------------------------

def release(action_id: int) -> str | None:
    """Claim a held step whose window has ended (by the database's clock), for a worker to execute. Returns the
    lease's owner, or None when it is not ours (stopped, released elsewhere, not due). In a run that stopped meanwhile
    (cancelled, unwinding, before a person) it is skipped instead: nothing runs that nobody is waiting for."""

    owner = new_owner()
    action = Action.objects.select_related("tool").filter(pk=action_id).first()
    if action is None or action.status != A.HELD:
        return None
    try:
        with ledger_transaction(action.tenant_id) as audit:
            run = sql.get_locked(Run, action.run_id)
            now = db_now()
            try:
                # Its window ends when the chain recorded it would: an earlier time written into the row would cut the
                # undo window short, so it is not released at all.
                sealed.check_hold(action)
            except sealed.Tampered as tampered:
                _refuse_release(action, run, tampered, log=audit)
                return None
            if run.cancel_requested_at or run.status not in (R.RUNNING, R.AWAITING_APPROVAL):
                action_transition(action, A.SKIPPED, log=audit, actor=RELEASER, where=Q(next_attempt_at__lte=now),
                                  note={"why": f"its run is {run.status.replace('_', ' ')}"}, next_attempt_at=None)
                return None
            action_transition(action, A.RUNNING, log=audit, actor=RELEASER, where=Q(next_attempt_at__lte=now),
                              attempts=action.attempts + 1, next_attempt_at=None, lease_owner=owner,
                              lease_expires_at=attempts.queued_lease(action.tool))
            attempts.start_attempt(action, owner, log=audit)
    except StateConflict:
        return None
    return owner


def _refuse_release(action: Action, run: Run, tampered: sealed.Tampered, *, log: AuditLog) -> None:
    """A held step whose time is not the one its hold recorded: it never runs (skipped, its row's time kept as found),
    the refusal is recorded for `verify_audit`, and its run goes before a person."""
    why = f"{action.tool.name} (step {action.seq}) was not released: {tampered.problem}"
    action_transition(action, A.SKIPPED, log=log, actor=RELEASER, note={"why": why[:500], "check": tampered.check},
                      decision_reason=why)
    log.record(sealed.TAMPERING, actor=RELEASER, action=action, check=tampered.check, problem=tampered.problem[:1000])
    if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
        runstate.needs_attention(run, sealed.TAMPERED, why, action=action, log=log, actor=RELEASER)
    logger.error("refused to release held action %s: %s", action.pk, tampered.problem)


def release_due(now) -> int:
    """The sweep's part: release every held step whose window has ended and queue its execution."""
    due = Action.objects.filter(status=A.HELD, next_attempt_at__lte=now).values_list("pk", flat=True)[:BATCH]
    released = 0
    for action_id in list(due):
        owner = release(action_id)
        if owner:
            released += 1
            enqueue("ledger.tasks.execute_action", action_id, owner)
    return released


def next_release(after):
    """When the next held step's window ends, later than `after` (None when none is held)."""
    return Action.objects.filter(status=A.HELD, next_attempt_at__gt=after).aggregate(at=Min("next_attempt_at"))["at"]


# --- stopping ------------------------------------------------------------------------------------------------

def action_stop(*, action_id: int, actor: str, by: str, reason: str = "") -> Action:
    """Stop a held step before it runs: it is skipped, never executed, and its run goes on by the saga law. Before
    the pivot (the held step is the pivot or an earlier one) the run is unwound, its earlier steps compensated
    newest-first; after it nothing can be undone, so the run ends without the step (completed, once nothing else of
    it is pending). `by` is who stopped it (one of STOPPERS); callers decide whether `actor` may.

    Raises StateConflict when the step is no longer held (it ran, or was stopped first)."""
    from ledger.engine import execution

    if by not in STOPPERS:
        raise ValueError(f"unknown stopper {by!r}")
    reason = reason.strip()[:500]
    unwind_now = False
    with ledger_transaction(Action.objects.values_list("tenant_id", flat=True).get(pk=action_id)) as audit:
        action = Action.objects.select_related("tool").get(pk=action_id)
        run = sql.get_locked(Run, action.run_id)
        if action.status != A.HELD:
            raise StateConflict(f"step {action.seq} ({action.tool.name}) is {action.get_status_display()}, not held: "
                                "only a held step can be stopped")
        why = f"{action.tool.name} (step {action.seq}) was stopped by {actor} ({by}) before it ran" + (
            f": {reason}" if reason else "")
        action_transition(action, A.SKIPPED, log=audit, actor=actor,
                          note={"why": why, "stopped_by": by, "reason": reason}, stopped_by=by,
                          decision_reason=why, next_attempt_at=None)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL) and not run.cancel_requested_at:
            if not run.pivot_committed:
                runstate.start_unwind(run, why, log=audit, actor=actor, cause="stopped", step=action, by=by)
                unwind_now = True
            elif run.status == R.RUNNING and not runstate.run_steps(
                    run.pk, statuses=[*attempts.PENDING, A.RUNNING], forward_only=False):
                run_transition(run, R.COMPLETED, log=audit, actor=actor, note={"why": why})
                runstate.checkpoint_save(run, "completed", log=audit)
                events.emit("run_finished", run=run)
        events.emit("hold_stopped", action=action, run=run, by=by, actor=actor)
    if unwind_now:
        execution.unwind(run.pk, budget=2.0, tenant_id=run.tenant_id)
    action.refresh_from_db()
    return action


def held_steps(*, tenant_ids: list[int]):
    """The held steps of these tenants, soonest first (for the operator's queue)."""
    return (Action.objects.filter(tenant_id__in=tenant_ids, status=A.HELD).select_related("tool", "run")
            .order_by("next_attempt_at", "pk"))


def stop_refusal(action: Action) -> str:
    """Why `action` cannot be stopped now, or "" when it can."""
    if action.status == A.HELD:
        return ""
    return f"step {action.seq} is {action.get_status_display()}: only a held step can be stopped"
