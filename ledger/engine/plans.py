"""Write plans: an engine operation decided once, in Python, and written by either of two writers.

A decision reads what it needs (the run in hand and its steps, kept on it by the read that fetched it and by the calls
that wrote since, or read just before: ledger/engine/runsteps.py) and returns a plan: the rows to write, the audit
events, and the guards it was decided under. A writer applies a plan under the tenant's chain lock and then the
run's: PostgreSQL's function in one round trip (ledger/engine/fastpath.py, its text in ledger/engine/plpgsql/), or the
Python writer here (SQLite, PostgreSQL with UNWIND_FAST_PATH off, and a plan the function did not take). Neither
decides anything: each compares the guards with the rows it locked and writes what the plan says, or answers STALE
having written nothing, and the caller reads afresh and decides again. So each rule is written once, and the writers
are held equal by applying one plan to the same rows (tests/test_parity.py).

Decided this way: completing a run (`runs.completion`, a `Completion`: `unwind_complete` or `write_completion`), and a
forward step's success and its failure for good (`outcome_plans.success`, `failure`, an `Outcome`: `unwind_succeed`
writes one that moves the step alone, `unwind_failed` one that moves no other step and emits nothing, and
`write_outcome` any, a pivot's commit, a run put before a person or pending steps skipped too). Propose, compensate,
open, hold, release and stop are to follow.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import datetime

from ledger import events
from ledger.audit.chain import AuditLog
from ledger.db import sql
from ledger.engine import runsteps
from ledger.engine.dispatch import enqueue
from ledger.errors import StateConflict
from ledger.models import Action, Attempt, Checkpoint, Run

STALE = "stale"  # a writer's answer when a guard failed: nothing was written; read afresh and decide again


@dataclass(frozen=True)
class RunGuards:
    """What a decision on a run was made under, which a writer compares with the run it locked: the run's status
    and the other fields its events fingerprint (`audit.chain.RUN_FIELDS`: the events are built from the decision's
    copy of the run), and its actions, [id, status] of each in order (`runsteps.guard`), which say every step the
    decision counted and how."""

    status: str
    pivot_committed: bool
    agent_id: int | None
    on_behalf_of: str
    goal: str
    intent: dict
    plan: list
    steps: list | None

    @classmethod
    def of(cls, run: Run, steps: list[runsteps.Seen] | None) -> RunGuards:
        """The guards of a decision made from `run` and its `steps` (None: it read no step, and none is compared)."""
        return cls(run.status, run.pivot_committed, run.agent_id, run.on_behalf_of, run.goal, run.intent, run.plan,
                   None if steps is None else runsteps.guard(steps))

    def steps_now(self, run_id: int) -> list[list] | None:
        """The run's steps as this guard compares them, read now (under the caller's lock): None when it has none."""
        return None if self.steps is None else runsteps.guard(runsteps.read(run_id))

    def hold(self, run: Run, steps: list[list] | None) -> bool:
        """Whether `run` and its actions' `steps` ([id, status], in order; `steps_now`), both read under the run's
        lock, are still what the decision was made from."""
        return self == RunGuards(run.status, run.pivot_committed, run.agent_id, run.on_behalf_of, run.goal,
                                 run.intent, run.plan, steps)


@dataclass(frozen=True)
class Completion:
    """A run's completion as decided (`runs.completion`): the run as completed, `changes` the columns that sets
    (`transitions.run_moved`); its checkpoint whole, the state decided from the steps (`runstate.checkpoint_state`);
    the events to append, as `AuditLog.record` builds them; and the guards. The checkpoint's id is the writer's to
    draw, like the events' sequence numbers: None in a decision, and named in its event once drawn (`numbered`)."""

    run: Run
    changes: dict
    checkpoint: Checkpoint
    events: list
    guards: RunGuards

    CHECKPOINT_EVENT = "run.checkpoint"

    def numbered(self, checkpoint_id: int) -> Completion:
        """This plan with its checkpoint's id drawn: the checkpoint and its event name it."""
        checkpoint = copy.copy(self.checkpoint)
        checkpoint.pk = checkpoint_id
        events = [(kind, actor, run_ref, action_ref,
                   {**data, "checkpoint": checkpoint_id} if kind == self.CHECKPOINT_EVENT else data)
                  for kind, actor, run_ref, action_ref, data in self.events]
        return Completion(self.run, self.changes, checkpoint, events, self.guards)


def write_completion(plan: Completion, *, log: AuditLog) -> Run | str:
    """The Python writer of a completion, in the caller's ledger transaction (`log`: the tenant's chain head is
    locked): it locks the run and compares the guards; with a checkpoint id drawn beforehand, it also checks that no
    checkpoint of the run came after it (a run's checkpoints are read in id order: the newest is the one resumed
    from). Then it moves the run, inserts the checkpoint (its id drawn by the insert when the plan has none) and
    appends the events. Returns the run as written; STALE, having written nothing, when a guard failed."""
    run = sql.get_locked(Run, plan.run.pk)
    drawn = plan.checkpoint.pk is not None
    if not plan.guards.hold(run, plan.guards.steps_now(run.pk)) or (
            drawn and Checkpoint.objects.filter(run_id=run.pk, pk__gt=plan.checkpoint.pk).exists()):
        return STALE
    sql.update(Run, {"pk": run.pk}, **plan.changes)  # under the run's lock, in the status the guards checked
    for name, value in plan.changes.items():
        setattr(run, name, value)
    if not drawn:
        plan = plan.numbered(sql.insert(copy.copy(plan.checkpoint)).pk)
    else:
        Checkpoint.objects.bulk_create([copy.copy(plan.checkpoint)])  # with the id the plan names
    log.pending.extend(plan.events)
    return run


@dataclass(frozen=True)
class StepGuards:
    """What a step's outcome was decided under, which a writer compares with the rows it locked: the run's
    (`RunGuards`; its steps only when the decision read them), whether it is cancelled and its unwind lease (they
    say what follows for the run), and the status the step moves from (its conditional update)."""

    run: RunGuards
    cancelled: bool
    lease_expires_at: datetime | None
    step_from: str

    @classmethod
    def of(cls, run: Run, steps: list[runsteps.Seen] | None, step_from: str) -> StepGuards:
        return cls(RunGuards.of(run, steps), run.cancel_requested_at is not None, run.lease_expires_at, step_from)

    def hold(self, run: Run, steps: list[list] | None) -> bool:
        return (self.run.hold(run, steps) and self.cancelled == (run.cancel_requested_at is not None)
                and self.lease_expires_at == run.lease_expires_at)


# The columns of an attempt that its end sets, as a plan gives them.
ATTEMPT_END = ("finished_at", "outcome", "latency_ms", "error_class", "error_message")


@dataclass(frozen=True)
class Emit:
    """A domain event (ledger/events.py) a plan emits in its writer's commit, in its place among the plan's audit
    events: its handlers may write rows and events of their own (a recovery item, an approval withdrawn)."""

    event: str
    payload: dict


@dataclass(frozen=True)
class Outcome:
    """A forward step's outcome as decided (`outcome_plans.success`, `outcome_plans.failure`): the step as moved,
    `changes` the columns that sets (`transitions.moved`); its attempt's end (`number` and ATTEMPT_END); the run as the plan
    leaves it, `run_changes` the columns that sets (none when it stays as it is); `others`, the run's other steps the
    plan moves (pending steps skipped as an unwind starts), each as (the step moved, its columns, the status it
    moves from); the checkpoints to insert, whole; the events to append, as `AuditLog.record` builds them, with the
    domain events to emit among them (`Emit`); the guards; and `unwind_after`, an unwinder to queue once committed
    (the writers do not decide that either). Checkpoint ids are the writer's to draw, as in `Completion`."""

    action: Action
    changes: dict
    attempt: Attempt
    run: Run
    run_changes: dict
    others: tuple
    checkpoints: tuple
    events: list
    guards: StepGuards
    unwind_after: bool = False

    @property
    def emits(self) -> bool:
        return any(isinstance(event, Emit) for event in self.events)

    def numbered(self, checkpoint_ids: list[int]) -> Outcome:
        """This plan with its checkpoints' ids drawn, in order: each checkpoint and its event name one."""
        checkpoints = []
        for checkpoint, pk in zip(self.checkpoints, checkpoint_ids, strict=True):
            checkpoint = copy.copy(checkpoint)
            checkpoint.pk = pk
            checkpoints.append(checkpoint)
        ids = iter(checkpoint_ids)
        events = [event if isinstance(event, Emit) or event[0] != Completion.CHECKPOINT_EVENT else
                  (*event[:4], {**event[4], "checkpoint": next(ids)}) for event in self.events]
        return dataclasses.replace(self, checkpoints=tuple(checkpoints), events=events)


def write_outcome(plan: Outcome, *, log: AuditLog) -> Run | str:
    """The Python writer of a step's outcome, in the caller's ledger transaction (`log`: the tenant's chain head is
    locked): it locks the run and compares the guards, then moves the step from the status it was decided from (a
    conditional update: a step moved since is a failed guard too), ends its attempt, moves the other steps (each
    from the status the guards checked: one moved under the run's lock all the same raises StateConflict, which rolls
    the transaction back), moves the run, inserts the checkpoints, appends the events and emits the domain events
    in their places, and queues the unwinder after the commit when the plan says so. Returns the run as written;
    STALE, having written nothing, when a guard failed."""
    run = sql.get_locked(Run, plan.run.pk)
    guards = plan.guards
    if not guards.hold(run, guards.run.steps_now(run.pk)) or sql.update(
            Action, {"pk": plan.action.pk, "run": run.pk, "status": guards.step_from}, **plan.changes) != 1:
        return STALE
    log.write_at_commit(sql.update_statement(
        Attempt, {"action": plan.action.pk, "number": plan.attempt.number, "finished_at": None},
        **{name: getattr(plan.attempt, name) for name in ATTEMPT_END}))
    for other, changes, status_from in plan.others:
        if sql.update(Action, {"pk": other.pk, "run": run.pk, "status": status_from}, **changes) != 1:
            raise StateConflict(f"action {other.pk} moved under run {run.pk}'s lock")
    if plan.run_changes:
        sql.update(Run, {"pk": run.pk}, **plan.run_changes)  # under the run's lock, in the status the guards checked
        for name, value in plan.run_changes.items():
            setattr(run, name, value)
    if plan.checkpoints and plan.checkpoints[0].pk is None:
        plan = plan.numbered([sql.insert(copy.copy(checkpoint)).pk for checkpoint in plan.checkpoints])
    elif plan.checkpoints:
        Checkpoint.objects.bulk_create([copy.copy(c) for c in plan.checkpoints])  # with the ids the plan names
    for event in plan.events:
        if isinstance(event, Emit):
            events.emit(event.event, **event.payload)  # its handlers record on `log`, after the events before it
        else:
            log.pending.append(event)
    if plan.unwind_after:
        enqueue("ledger.tasks.unwind_run", run.pk)
    return run
