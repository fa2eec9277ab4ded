"""One transition function per state machine.

Each applies an allowed change as `UPDATE … WHERE id = … AND status = <expected>` and checks that
exactly one row moved, so two workers can never both win; the loser gets StateConflict. Every
transition is recorded in the audit chain in the same transaction.
"""
from __future__ import annotations

import copy

from django.db.models import Q
from django.utils import timezone

from ledger.db import sql
from ledger.audit.chain import AuditLog
from ledger.errors import StateConflict
from ledger.models import RUN_FINAL, Action, ActionStatus as A, Run, RunStatus as R

ACTION_TRANSITIONS: dict[str, set[str]] = {
    A.PLANNED: {A.AWAITING_APPROVAL, A.RUNNING, A.SKIPPED},
    A.AWAITING_APPROVAL: {A.APPROVED, A.REJECTED, A.EXPIRED, A.SKIPPED},
    A.APPROVED: {A.RUNNING, A.HELD, A.SKIPPED},
    # A held step (ledger/engine/holds.py) runs when its window ends, or is stopped (skipped) before: one of the two.
    A.HELD: {A.RUNNING, A.SKIPPED},
    # running -> running is a reclaim after a lost lease (crash recovery).
    A.RUNNING: {A.RUNNING, A.SUCCEEDED, A.FAILED, A.RETRY_SCHEDULED, A.LOST},
    A.RETRY_SCHEDULED: {A.RUNNING, A.SKIPPED},
    A.LOST: {A.RUNNING, A.SUCCEEDED, A.FAILED},
    A.FAILED: {A.RUNNING},
    A.SUCCEEDED: {A.COMPENSATING},
    A.COMPENSATING: {A.COMPENSATED, A.COMPENSATION_FAILED},
    A.COMPENSATION_FAILED: {A.COMPENSATING},
    A.REJECTED: set(),
    A.EXPIRED: set(),
    A.COMPENSATED: set(),
    A.SKIPPED: set(),
}

RUN_TRANSITIONS: dict[str, set[str]] = {
    R.RUNNING: {R.AWAITING_APPROVAL, R.COMPLETED, R.UNWINDING, R.NEEDS_ATTENTION},
    R.AWAITING_APPROVAL: {R.RUNNING, R.UNWINDING, R.NEEDS_ATTENTION},
    # unwinding -> closed: the rest undone, and a step of unknown outcome taken over by a person (services/unknowns.py).
    R.UNWINDING: {R.COMPENSATED, R.NEEDS_ATTENTION, R.CLOSED},
    R.NEEDS_ATTENTION: {R.RUNNING, R.UNWINDING, R.CLOSED},
    # A finished run is put before a person again only when the person it acted for asks for a correction of it
    # (recovery/requests.py); the operator then resumes, compensates or closes it as any other.
    R.COMPLETED: {R.NEEDS_ATTENTION},
    R.COMPENSATED: {R.NEEDS_ATTENTION},
    R.CLOSED: {R.NEEDS_ATTENTION},
}


FINAL_ACTION = (A.SUCCEEDED, A.FAILED, A.REJECTED, A.EXPIRED, A.SKIPPED, A.COMPENSATED, A.COMPENSATION_FAILED, A.LOST)


def transition_fields(to: str, *, now, **fields) -> dict:
    """The columns a move to `to` sets besides `fields`: the status, `updated_at`, and `finished_at` when it ends."""
    fields = {**fields, "status": to, "updated_at": now}
    if to in FINAL_ACTION:
        fields.setdefault("finished_at", now)
    return fields


def moved(action: Action, to: str, *, now, **fields) -> tuple[Action, dict]:
    """A copy of `action` as `action_transition` would leave it, and the columns the move sets: for a caller that
    records the move itself (ledger/engine/fastpath.py) and applies them to `action` once it is recorded."""
    changes = transition_fields(to, now=now, **fields)
    after = copy.copy(action)
    for name, value in changes.items():
        setattr(after, name, value)
    return after, changes


def action_transition(
    action: Action, to: str, *, log: AuditLog, actor: str, where: Q | None = None, note: dict | None = None, **fields
) -> None:
    """Move `action` from its current status to `to`, or raise StateConflict."""
    current = action.status
    if to not in ACTION_TRANSITIONS[current]:
        raise StateConflict(f"action {action.pk} cannot go from {current} to {to}")
    fields = transition_fields(to, now=timezone.now(), **fields)
    if where is None:
        count = sql.update(Action, {"pk": action.pk, "status": current}, **fields)
    else:
        count = Action.objects.filter(where, pk=action.pk, status=current).update(**fields)
    if count != 1:
        raise StateConflict(f"action {action.pk} is no longer {current}: someone else acted first")
    for name, value in fields.items():
        setattr(action, name, value)
    log.record(f"{action.kind}.{to}", actor=actor, action=action, status_from=current, **(note or {}))


def run_fields(run: Run, to: str, *, now, **fields) -> dict:
    """The columns a run's move to `to` sets besides `fields`: the status, `updated_at`, and `finished_at` when it
    ends; StateConflict when RUN_TRANSITIONS does not allow the move."""
    if to not in RUN_TRANSITIONS[run.status]:
        raise StateConflict(f"run {run.pk} cannot go from {run.status} to {to}")
    fields = {**fields, "status": to, "updated_at": now}
    if to in RUN_FINAL:
        fields.setdefault("finished_at", now)
    return fields


def run_moved(run: Run, to: str, *, now, **fields) -> tuple[Run, dict]:
    """A copy of `run` as `run_transition` would leave it, and the columns the move sets: for a decision that a
    writer records (ledger/engine/plans.py)."""
    changes = run_fields(run, to, now=now, **fields)
    after = copy.copy(run)
    for name, value in changes.items():
        setattr(after, name, value)
    return after, changes


def run_transition(run: Run, to: str, *, log: AuditLog, actor: str, note: dict | None = None, **fields) -> None:
    current = run.status
    fields = run_fields(run, to, now=timezone.now(), **fields)
    if sql.update(Run, {"pk": run.pk, "status": current}, **fields) != 1:
        raise StateConflict(f"run {run.pk} is no longer {current}: someone else acted first")
    for name, value in fields.items():
        setattr(run, name, value)
    log.record(f"run.{to}", actor=actor, run=run, status_from=current, **(note or {}))
