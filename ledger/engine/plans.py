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
forward step's success and its failure for good (`outcome_plans.success`, `failure`, an `Outcome`: `unwind_outcome`
writes one that moves no other step and emits nothing, the columns of the step it sets and no other, and
`write_outcome` any, a pivot's commit, a run put before a person or pending steps skipped too), and a step of an
unwind (`unwind_plans.compensated`, `claimed`, an `UnwindStep`: `unwind_compensated` writes one that claims its next
undo or settles the run itself, `write_unwind` any). Propose, open, hold, release and stop are to follow.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from ledger import events
from ledger.audit.chain import AuditLog
from ledger.db import sql
from ledger.db.partitions import recent
from ledger.engine import attempts, runsteps
from ledger.engine.dispatch import enqueue
from ledger.engine.leases import lease_at_write
from ledger.errors import StateConflict
from ledger.models import Action, Attempt, Checkpoint, Run, Tenant

STALE = "stale"  # a writer's answer when a guard failed: nothing was written; read afresh and decide again


@dataclass(frozen=True)
class RunGuards:
    """What a decision on a run was made under, which a writer compares with the run it locked: the run's status
    and the other fields its events fingerprint (`audit.chain.RUN_FIELDS`: the events are built from the decision's
    copy of the run), and its actions, [id, status] of each in order as a digest (`runsteps.guard`), which say every
    step the decision counted and how."""

    status: str
    pivot_committed: bool
    agent_id: int | None
    on_behalf_of: str
    goal: str
    intent: dict
    plan: list
    steps: str | None

    @classmethod
    def of(cls, run: Run, steps: list[runsteps.Seen] | None) -> RunGuards:
        """The guards of a decision made from `run` and its `steps` (None: it read no step, and none is compared)."""
        return cls(run.status, run.pivot_committed, run.agent_id, run.on_behalf_of, run.goal, run.intent, run.plan,
                   None if steps is None else runsteps.guard(steps))

    def steps_now(self, run_id: int) -> str | None:
        """The run's steps as this guard compares them, read now (under the caller's lock): None when it has none."""
        return None if self.steps is None else runsteps.guard_now(run_id)

    def hold(self, run: Run, steps: str | None) -> bool:
        """Whether `run` and its actions' `steps` (their digest: `steps_now`), both read under the run's
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
            drawn and Checkpoint.objects.filter(run_id=run.pk, pk__gt=plan.checkpoint.pk,
                                                created_at__gte=recent(run.created_at)).exists()):
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

    def hold(self, run: Run, steps: str | None) -> bool:
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
        Attempt, attempts.open_attempt(plan.action, plan.attempt.number),
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


@dataclass(frozen=True)
class UnwindGuards:
    """What a step of an unwind was decided under (`unwind_plans`), which a writer compares with the rows it locked:
    the run's (`RunGuards`, always with its actions' [id, status] in order: which undo comes next, and whether the
    run settles, are decided from them); its unwind lease as read, when the decision was made from it
    (`lease_compared`: whether the lease is free to take, whether an unwinder is to be queued; not for the unwinder
    that holds it and claims its next undo, whose decision does not read it); and the tenant's approval threshold
    when the plan claims an undo (its approvals were decided with it; None: not compared)."""

    run: RunGuards
    lease_compared: bool
    lease_expires_at: datetime | None
    threshold: str | None

    def hold(self, run: Run, steps: str | None, threshold: str | None) -> bool:
        return (self.run.hold(run, steps)
                and (not self.lease_compared or self.lease_expires_at == run.lease_expires_at)
                and (self.threshold is None or self.threshold == threshold))


@dataclass(frozen=True)
class Claim:
    """The next undo an unwind claims, as decided: its forward step moved (`forward`, `forward_changes`, from
    `forward_from`), the compensation as it is to be recorded (`undo`, claimed: its lease made on the process clock,
    which the writer starts after its locks; its id drawn by the read the decision was made from, or None: the
    writer's insert draws it), its undo tool, and its first attempt. The step number and the defaults' version are
    the writer's to take, under the run's lock, as a proposal's are."""

    forward: Action
    forward_changes: dict
    forward_from: str
    undo: Action
    tool: object
    attempt: Attempt


@dataclass(frozen=True)
class UnwindStep:
    """A step of an unwind as decided (`unwind_plans.compensated`, `unwind_plans.claimed`): a compensation's success
    (`undo` moved from `undo_from` with `undo_changes`, its attempt's end, its step `forward` compensated from
    `forward_from`), or the run's unwind lease taken (`lease`, made on the process clock at `now`: the writer starts
    it after its locks); then what follows: the next undo claimed (`claim`), or the run settled (`run_changes`, its
    `checkpoint`), or, `then_claim`, a next undo that is no plain claim (a step to skip, an undo to retry, one that
    needs approval or the agent, a run put before a person), which `unwinding.claim_next_compensation` decides in the
    Python writer's transaction (the function does not take such a plan). `run` is the run as the plan leaves it; the
    events as `AuditLog.record` builds them (domain events among them: `Emit`); `unwind_after`: an unwinder to queue
    once committed."""

    run: Run
    now: datetime
    guards: UnwindGuards
    events: list
    undo: Action | None = None
    undo_changes: dict | None = None
    undo_from: str | None = None
    attempt: Attempt | None = None
    forward: Action | None = None
    forward_changes: dict | None = None
    forward_from: str | None = None
    lease: datetime | None = None
    claim: Claim | None = None
    run_changes: dict | None = None
    checkpoint: Checkpoint | None = None
    then_claim: bool = False
    unwind_after: bool = False

    PROPOSED = "compensation.proposed"

    @property
    def emits(self) -> bool:
        """Whether a domain event of the plan has a handler (one without is emitted to nobody: nothing to run)."""
        return any(isinstance(event, Emit) and events.subscribed(event.event) for event in self.events)

    def numbered(self, *, undo_id: int | None = None, checkpoint_id: int | None = None) -> UnwindStep:
        """This plan with the claimed undo's id, or its checkpoint's, drawn by the writer: the rows and the events
        that name it (the undo's proposal, its step's move; the checkpoint's event) name it."""
        claim, checkpoint, numbered = self.claim, self.checkpoint, []
        if undo_id is not None:
            undo = copy.copy(claim.undo)
            undo.pk = undo_id
            attempt = copy.copy(claim.attempt)
            attempt.action = undo
            claim = dataclasses.replace(claim, undo=undo, attempt=attempt)
        if checkpoint_id is not None:
            checkpoint = copy.copy(checkpoint)
            checkpoint.pk = checkpoint_id
        for event in self.events:
            if not isinstance(event, Emit):
                kind, actor, run_ref, action_ref, data = event
                if undo_id is not None and kind == self.PROPOSED and action_ref is None:
                    event = (kind, actor, run_ref, undo_id, data)
                elif undo_id is not None and "compensation" in data and data["compensation"] is None:
                    event = (kind, actor, run_ref, action_ref, {**data, "compensation": undo_id})
                elif checkpoint_id is not None and kind == Completion.CHECKPOINT_EVENT:
                    event = (kind, actor, run_ref, action_ref, {**data, "checkpoint": checkpoint_id})
            numbered.append(event)
        return dataclasses.replace(self, events=numbered, claim=claim, checkpoint=checkpoint)


@dataclass(frozen=True)
class Unwound:
    """What a writer of an `UnwindStep` took under its locks: the claimed undo's step number, defaults' version, id
    and lease, the run's unwind lease it took (None for what it did not take), the checkpoint's id; and, for a plan
    whose next undo is no plain claim (`then_claim`), what `unwinding.claim_next_compensation` claimed (or None);
    the run as the Python writer left it (None from the function: the plan's run is)."""

    step: int | None = None
    defaults_version: int | None = None
    undo_id: int | None = None
    undo_lease: datetime | None = None
    run_lease: datetime | None = None
    checkpoint_id: int | None = None
    then: Action | None = None
    run: Run | None = None


def write_unwind(plan: UnwindStep, *, log: AuditLog, then: Callable[[Run], Action | None] | None = None
                 ) -> Unwound | str:
    """The Python writer of a step of an unwind, in the caller's ledger transaction (`log`: the tenant's chain head
    is locked): it locks the run and compares the guards (the run, its actions' statuses, its unwind lease, the
    tenant's threshold when the plan claims an undo), then writes the plan: the compensation succeeded from the
    status it was decided from (a conditional update: one moved since is a failed guard too), its attempt ended,
    its step compensated; or the run's lease taken (on the database's clock, after the lock); then the next undo
    claimed (its step's move, the compensation with the run's next step number and the defaults' version taken
    under the lock, its lease started now, its attempt), or the run settled with its checkpoint; the events and
    domain events in their places; and, for a plan whose next undo is no plain claim, `then(run)` (the caller's
    `claim_next_compensation`) in the same transaction. Moves after the first that find their row moved under the
    run's lock raise StateConflict (the transaction rolls back). Returns what it took; STALE, having written
    nothing, when a guard failed."""
    run = sql.get_locked(Run, plan.run.pk)
    guards = plan.guards
    threshold = None if guards.threshold is None else \
        Tenant.objects.values_list("approval_threshold", flat=True).get(pk=run.tenant_id)
    if not guards.hold(run, guards.run.steps_now(run.pk), threshold):
        return STALE
    if plan.undo is not None:
        if sql.update(Action, {"pk": plan.undo.pk, "run": run.pk, "status": plan.undo_from},
                      **plan.undo_changes) != 1:
            return STALE
        log.write_at_commit(sql.update_statement(
            Attempt, attempts.open_attempt(plan.undo, plan.attempt.number),
            **{name: getattr(plan.attempt, name) for name in ATTEMPT_END}))
        if sql.update(Action, {"pk": plan.forward.pk, "status": plan.forward_from}, **plan.forward_changes) != 1:
            raise StateConflict(f"action {plan.forward.pk} moved under run {run.pk}'s lock")
    taken = Unwound()
    if plan.lease is not None:
        run_lease = lease_at_write((plan.lease - plan.now).total_seconds(), model=Run, pk=run.pk)
        sql.update(Run, {"pk": run.pk}, lease_expires_at=run_lease)
        run.lease_expires_at = run_lease
        taken = dataclasses.replace(taken, run_lease=run_lease)
    if plan.claim is not None:
        claim = plan.claim
        if sql.update(Action, {"pk": claim.forward.pk, "run": run.pk, "status": claim.forward_from},
                      **claim.forward_changes) != 1:
            raise StateConflict(f"action {claim.forward.pk} moved under run {run.pk}'s lock")
        numbered, _, defaults_version = attempts.take_seq(run.pk)
        undo = copy.copy(claim.undo)
        undo.seq, undo.defaults_version = numbered.next_seq - 1, defaults_version
        undo.lease_expires_at = lease_at_write((claim.undo.lease_expires_at - plan.now).total_seconds())
        if undo.pk is None:
            undo = sql.insert(undo)
            plan = plan.numbered(undo_id=undo.pk)
        else:
            Action.objects.bulk_create([undo])  # with the id the plan names
        # The undo in hand carries the times it was written with, as the function's writer leaves it (`_row` stamps
        # them): reads of its attempts start at its creation (their partitions), a retry's among them.
        claim.undo.created_at, claim.undo.updated_at = undo.created_at, undo.updated_at
        attempt = copy.copy(plan.claim.attempt)
        attempt.action = undo
        log.write_at_commit(sql.insert_statement(attempt))
        taken = dataclasses.replace(taken, step=undo.seq, defaults_version=defaults_version, undo_id=undo.pk,
                                    undo_lease=undo.lease_expires_at)
    if plan.run_changes:
        sql.update(Run, {"pk": run.pk}, **plan.run_changes)  # under the run's lock, in the status the guards checked
        for name, value in plan.run_changes.items():
            setattr(run, name, value)
    if plan.checkpoint is not None:
        if plan.checkpoint.pk is None:
            plan = plan.numbered(checkpoint_id=sql.insert(copy.copy(plan.checkpoint)).pk)
        else:
            Checkpoint.objects.bulk_create([copy.copy(plan.checkpoint)])  # with the id the plan names
        taken = dataclasses.replace(taken, checkpoint_id=plan.checkpoint.pk)
    for event in plan.events:
        if isinstance(event, Emit):
            events.emit(event.event, **event.payload)
        else:
            log.pending.append(event)
    if plan.then_claim and then is not None:
        taken = dataclasses.replace(taken, then=then(run))
    if plan.unwind_after:
        enqueue("ledger.tasks.unwind_run", run.pk)
    return dataclasses.replace(taken, run=run)
