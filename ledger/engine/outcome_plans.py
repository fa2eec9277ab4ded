"""A forward step's outcome decided once, in Python, as a write plan (`plans.Outcome`): its success (`success`) and
its failure for good (`failure`), each from the step and the run in hand (its steps only when the decision needs
them), with the guards it was decided under. `outcomes` hands the plan to a writer (PostgreSQL's one call or the
Python writer, ledger/engine/plans.py) and decides again from a fresh read when a guard failed.
"""
from __future__ import annotations

import copy
from typing import Callable

from django.utils import timezone

from ledger.audit.chain import AuditLog
from ledger.engine import attempts, plans, readback, runstate, runsteps
from ledger.engine.transitions import ACTION_TRANSITIONS, moved, run_moved
from ledger.errors import StateConflict
from ledger.executors.call import ToolError
from ledger.models import Action, ActionKind, ActionStatus as A, Attempt, Checkpoint, Run, RunStatus as R, SagaRole


class Deciding:
    """A forward step's outcome being decided, in memory: the step moved to `to` with `changes` and its event, its
    attempt's end, then what follows for the run (`run_to`, `checkpoint`, `skip`, `emit`), returned as one plan
    (`plan`) with the guards it was decided under. `steps`, the run's steps as read (None: the decision read none)."""

    def __init__(self, action: Action, run: Run, steps: list[runsteps.Seen] | None, to: str, *, actor: str, now,
                 attempt: dict, note: dict | None = None, **changes):
        if to not in ACTION_TRANSITIONS[action.status]:
            raise StateConflict(f"action {action.pk} cannot go from {action.status} to {to}")
        self.action, self.before, self.steps, self.actor, self.now = action, run, steps, actor, now
        self.after, self.changes = moved(action, to, now=now, **changes)
        self.log = AuditLog(run.tenant_id, head=None)  # its entries, not appended here: the writer appends them
        self.log.record(f"{action.kind}.{to}", actor=actor, action=self.after, status_from=action.status,
                        **(note or {}))
        self.attempt = Attempt(action_id=action.pk, number=action.attempts, finished_at=now, **attempt)
        self.run, self.run_changes, self.others, self.checkpoints = run, {}, [], []  # `run` copied once it moves
        # The forward steps as the plan leaves them, (id, seq, status, tool name), for its checkpoints.
        self.left = [(s.pk, s.seq, to if s.pk == action.pk else s.status, s.tool_name)
                     for s in steps or () if s.kind == ActionKind.FORWARD]

    def run_to(self, status: str, *, actor: str, note: dict, **fields) -> None:
        was = self.run.status
        self.run, columns = run_moved(self.run, status, now=self.now, **fields)
        self.run_changes.update(columns)
        self.log.record(f"run.{status}", actor=actor, run=self.run, status_from=was, **note)

    def checkpoint(self, label: str) -> None:
        self.checkpoints.append(Checkpoint(tenant_id=self.run.tenant_id, run_id=self.run.pk, label=label,
                                           state=runstate.checkpoint_state(self.run, self.left)))
        self.log.record(plans.Completion.CHECKPOINT_EVENT, actor=attempts.SYSTEM, run=self.run, label=label,
                        checkpoint=None)

    def emit(self, event: str, **payload) -> None:
        self.log.pending.append(plans.Emit(event, payload))

    def skip(self, pending: Action, *, why: str) -> None:
        """`runstate.skip_pending`'s move of one step that has not started, as the unwind starts."""
        stopped = {"stopped_by": "agent"} if pending.status == A.HELD and self.actor.startswith("agent:") else {}
        skipped, columns = moved(pending, A.SKIPPED, now=self.now, lease_owner="", lease_expires_at=None,
                                 next_attempt_at=None, **stopped)
        self.others.append((skipped, columns, pending.status))
        self.left = [(pk, seq, A.SKIPPED if pk == pending.pk else status, name) for pk, seq, status, name in self.left]
        self.log.record(f"{pending.kind}.{A.SKIPPED}", actor=self.actor, action=skipped, status_from=pending.status,
                        why=why)
        if pending.status == A.AWAITING_APPROVAL:
            self.emit("approval_withdrawn", action=skipped, reason=why)

    def plan(self, *, unwind_after: bool) -> plans.Outcome:
        return plans.Outcome(self.after, self.changes, self.attempt, self.run, self.run_changes, tuple(self.others),
                             tuple(self.checkpoints), self.log.pending,
                             plans.StepGuards.of(self.before, self.steps, self.action.status), unwind_after)


def success(action: Action, run: Run, changes: dict, *, latency_ms: float | None, actor: str,
            steps_of: Callable[[], list[runsteps.Seen]]) -> plans.Outcome:
    """The success of forward step `action` decided from it and `run` (and its steps, `steps_of`, read only when
    the decision needs them): the step succeeded with `changes`, its attempt ended, and what follows for the run.
    A pivot commits (the run's mark, its event and checkpoint). A run that is unwinding or cancelled takes the step
    as a late completion, undone like the rest (an unwinder queued when none holds the run). Otherwise a step that
    did not verify puts the run before a person, and a run waiting for approvals runs again once none is awaited.
    StateConflict when the step cannot move to succeeded."""
    now = timezone.now()
    late = run.status == R.UNWINDING or run.cancel_requested_at is not None
    verification = changes.get("verification")
    unverified = verification is not None and not verification.get("ok")
    pivot = action.saga_role == SagaRole.PIVOT and not run.pivot_committed
    steps = steps_of() if pivot or (not late and (unverified or run.status == R.AWAITING_APPROVAL)) else None
    decided = Deciding(action, run, steps, A.SUCCEEDED, actor=actor, now=now, attempt=dict(
        outcome="succeeded", latency_ms=latency_ms, error_class="", error_message=""), **changes)
    if pivot:
        decided.run = copy.copy(decided.run)
        decided.run.pivot_committed = decided.run_changes["pivot_committed"] = True
        decided.log.record("run.pivot_committed", actor=actor, run=decided.run, action=decided.after)
        decided.checkpoint("pivot_committed")
    if late:
        pass
    elif unverified:
        reason, detail = ("read_back_incomplete", readback.read_back_detail(decided.after, verification)) \
            if "read_back" in verification else \
            ("verification_failed", f"{action.tool.name} (step {action.seq}) did not verify: "
                                    f"{verification.get('detail') or verification.get('mismatched')}")
        attention(decided, reason, detail)
    elif run.status == R.AWAITING_APPROVAL and not any(status == A.AWAITING_APPROVAL for *_, status, _ in decided.left):
        decided.run_to(R.RUNNING, actor=actor, note={})
    return decided.plan(unwind_after=run.status == R.UNWINDING and runstate.unwinder_free(run, now))


def attention(decided: Deciding, reason: str, detail: str) -> None:
    """`runstate.needs_attention` decided: the run before a person, its checkpoint, and the domain event that opens
    the recovery item."""
    decided.run_to(R.NEEDS_ATTENTION, actor=attempts.SYSTEM, note={"reason": reason}, attention_reason=reason,
                   attention_detail=detail[:4000], lease_expires_at=None)
    decided.checkpoint(f"needs_attention:{reason}")
    decided.emit("run_needs_attention", run=decided.run, reason=reason, detail=detail, action=decided.after)


def failure(action: Action, run: Run, error: ToolError, *, latency_ms: float | None, actor: str,
            steps_of: Callable[[], list[runsteps.Seen]], pending_of: Callable[[list[int]], list[Action]]
            ) -> plans.Outcome:
    """The failure for good of forward step `action` (its last attempt ended in `error`) decided from it and `run`
    (its steps, `steps_of`, read only when the decision needs them; `pending_of` reads the steps it skips whole):
    the step failed, its attempt ended, and what follows for the run. Before the pivot the run starts to unwind:
    the steps that have not started are skipped (but a retry an earlier attempt of which may have acted: its retry
    finds out), the run is unwinding with its checkpoint, and an unwinder is queued. After the pivot the run goes
    before a person. A run already unwinding queues an unwinder when none holds it; a run before a person or settled
    stays as it is. StateConflict when the step cannot move to failed."""
    now = timezone.now()
    starts = run.status not in (R.UNWINDING, R.NEEDS_ATTENTION, R.COMPLETED, R.COMPENSATED, R.CLOSED)
    decided = Deciding(action, run, steps_of() if starts else None, A.FAILED, actor=actor, now=now,
                       note={"error_class": error.error_class, "error": error.message[:500]},
                       attempt=dict(outcome="failed_transient" if error.transient else "failed_permanent",
                                    latency_ms=latency_ms, error_class=error.error_class,
                                    error_message=error.message[:2000]),
                       lease_owner="", lease_expires_at=None, error_class=error.error_class,
                       error_message=error.message[:2000])
    if not starts:
        return decided.plan(unwind_after=run.status == R.UNWINDING and runstate.unwinder_free(run, now))
    message = decided.after.error_message
    if run.pivot_committed:
        attention(decided, "step_failed", f"{action.tool.name} (step {action.seq}) failed after the pivot and "
                  f"{action.attempts} attempt(s): {message}. The run only moves forward from here.")
        return decided.plan(unwind_after=False)
    why = f"{action.tool.name} (step {action.seq}) failed: {message}"
    pending = [s.pk for s in decided.steps if s.kind == ActionKind.FORWARD and s.status in attempts.PENDING]
    for step in pending_of(pending) if pending else ():
        if step.status == A.RETRY_SCHEDULED and attempts.an_attempt_may_have_acted(step):
            continue  # it may have acted: its retry finds out (reading back, never calling again) first
        decided.skip(step, why=why)
    decided.run_to(R.UNWINDING, actor=actor, note={"why": why[:500], "cause": "failed", "for_action": action.pk},
                   attention_detail=why[:4000])
    decided.checkpoint("unwind_started")
    return decided.plan(unwind_after=runstate.unwinder_free(decided.run, now))
