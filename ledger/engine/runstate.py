"""Run-level decisions: the run's steps, its checkpoint, a run that needs a person, pending steps skipped, an
unwind begun, and a run settled once its undos are done.
"""
from __future__ import annotations

import logging

from django.utils import timezone

from ledger import events
from ledger.audit.chain import AuditLog
from ledger.db import sql
from ledger.engine import attempts, unknowns
from ledger.engine.dispatch import enqueue
from ledger.engine.transitions import action_transition, run_transition
from ledger.models import Action, ActionClass, ActionKind, ActionStatus as A, Checkpoint, Run, RunStatus as R

log = logging.getLogger("unwind.engine")


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
    log.record("run.checkpoint", actor=attempts.SYSTEM, run=run, label=label, checkpoint=checkpoint.pk)
    return checkpoint


AWAITING = (A.AWAITING_APPROVAL,)  # the steps a checkpoint lists as awaiting approval


def checkpoint_state(run: Run, steps: list[tuple]) -> dict:
    """What a checkpoint records of the run and its forward `steps` ((id, seq, status, tool name), in order)."""
    actions = [dict(zip(("id", "seq", "status", "tool__name"), row)) for row in steps]
    completed = [a["id"] for a in actions if a["status"] in attempts.DONE]
    pending = [a["id"] for a in actions if a["status"] in attempts.UNFINISHED]
    summary = ", ".join(f"{a['tool__name']} {a['status'].replace('_', ' ')}" for a in actions) or "no actions yet"
    mode = {R.UNWINDING: "compensate", R.NEEDS_ATTENTION: "resume_or_compensate",
            R.AWAITING_APPROVAL: "await_approval"}.get(run.status, "resume")
    return {
        "run_status": run.status, "pivot_committed": run.pivot_committed,
        "completed_action_ids": completed, "pending_action_ids": pending,
        "awaiting_approval_ids": [a["id"] for a in actions if a["status"] in AWAITING],
        "recovery_mode": mode, "summary": summary,
    }


def needs_attention(run: Run, reason: str, detail: str, *, action: Action | None, log: AuditLog, actor: str = attempts.SYSTEM) -> None:
    run_transition(run, R.NEEDS_ATTENTION, log=log, actor=actor, note={"reason": reason},
                   attention_reason=reason, attention_detail=detail[:4000], lease_expires_at=None)
    checkpoint_save(run, f"needs_attention:{reason}", log=log)
    events.emit("run_needs_attention", run=run, reason=reason, detail=detail, action=action)


def skip_pending(run: Run, *, log: AuditLog, actor: str, why: str, forward_only: bool = False) -> None:
    """Skip what has not started. An unwind skips only forward steps: its own compensations may be waiting
    for approval and must still run."""
    if not run_steps(run.pk, statuses=list(attempts.PENDING), forward_only=forward_only):
        return  # the common case, told by one narrow query
    pending_actions = run.actions.filter(status__in=attempts.PENDING).select_related("tool")
    if forward_only:
        pending_actions = pending_actions.filter(kind=ActionKind.FORWARD)
    for pending in pending_actions:
        if pending.status == A.RETRY_SCHEDULED and pending.kind == ActionKind.FORWARD and attempts.an_attempt_may_have_acted(pending):
            continue  # it may have acted: its retry finds out (reading back, never calling again) first
        was_waiting = pending.status == A.AWAITING_APPROVAL
        # A held step skipped by its agent's cancel was stopped by the agent (ledger/engine/holds.py).
        stopped = {"stopped_by": "agent"} if pending.status == A.HELD and actor.startswith("agent:") else {}
        action_transition(pending, A.SKIPPED, log=log, actor=actor, note={"why": why}, lease_owner="",
                          lease_expires_at=None, next_attempt_at=None, **stopped)
        if was_waiting:
            events.emit("approval_withdrawn", action=pending, reason=why)


# Why a run began to unwind, recorded on its `run.unwinding` event as a typed fact (the trail tells it in words):
# a step failed, was rejected or expired or its approval was voided by a policy change, a held step was stopped
# (`by` whom), the run was cancelled, or it was idle past its deadline. An operator's compensate records "operator".
UNWIND_CAUSES = ("failed", "rejected", "expired", "voided", "stopped", "cancelled", "idle", "operator")


def start_unwind(run: Run, why: str, *, log: AuditLog, actor: str, cause: str, step: Action | None = None,
                 by: str = "") -> None:
    if cause not in UNWIND_CAUSES:
        raise ValueError(f"unknown unwind cause {cause!r}")
    skip_pending(run, log=log, actor=actor, why=why, forward_only=True)
    fact = {"why": why[:500], "cause": cause, **({"for_action": step.pk} if step is not None else {}), **({"by": by} if by else {})}
    run_transition(run, R.UNWINDING, log=log, actor=actor, note=fact, attention_detail=why[:4000])
    checkpoint_save(run, "unwind_started", log=log)
    enqueue_unwind_after(run)


def enqueue_unwind_after(run: Run) -> None:
    """Queue an unwinder unless one holds the run's lease (it will see the new state itself)."""
    if unwinder_free(run, timezone.now()):
        enqueue("ledger.tasks.unwind_run", run.pk)


def unwinder_free(run: Run, now) -> bool:
    """Whether no unwinder holds the run's lease: none was taken, or it ran out."""
    return run.lease_expires_at is None or run.lease_expires_at < now


def settle(run: Run, *, log: AuditLog) -> None:
    """Nothing is left to compensate: the run is compensated, or a person must look at what remains."""
    actions = list(run.actions.select_related("tool").order_by("seq"))
    failed = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.COMPENSATION_FAILED]
    standing = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.SUCCEEDED
                and a.tool.action_class != ActionClass.READ_ONLY and not attempts.compensable(a)]
    lost = [a for a in actions if a.status == A.LOST and not unknowns.left_to_person(a)]
    if not failed and not standing and not lost:
        left = [a for a in actions if unknowns.left_to_person(a)]
        # A step a person took over (their one decision on the run, ledger/engine/unknowns.py) ends it closed.
        run_transition(run, R.CLOSED if left else R.COMPENSATED, log=log, actor=attempts.SYSTEM, lease_expires_at=None,
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
