"""Write plans: an engine operation decided once, in Python, and written by either of two writers.

A decision reads what it needs (the run in hand and its steps, kept on it by the read that fetched it and by the calls
that wrote since, or read just before: ledger/engine/runsteps.py) and returns a plan: the rows to write, the audit
events, and the guards it was decided under. A writer applies a plan under the tenant's chain lock and then the
run's: PostgreSQL's function in one round trip (ledger/engine/fastpath.py, its text in ledger/engine/plpgsql/), or the
Python writer here (SQLite, PostgreSQL with UNWIND_FAST_PATH off, and a plan the function did not take). Neither
decides anything: each compares the guards with the rows it locked and writes what the plan says, or answers STALE
having written nothing, and the caller reads afresh and decides again. So each rule is written once, and the writers
are held equal by applying one plan to the same rows (tests/test_parity.py).

Completing a run is decided this way (`runs.completion`); the engine's other operations are to follow it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from ledger.audit.chain import AuditLog
from ledger.db import sql
from ledger.engine import runsteps
from ledger.models import Checkpoint, Run

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
    steps: list

    @classmethod
    def of(cls, run: Run, steps: list[runsteps.Seen]) -> RunGuards:
        return cls(run.status, run.pivot_committed, run.agent_id, run.on_behalf_of, run.goal, run.intent, run.plan,
                   runsteps.guard(steps))

    def hold(self, run: Run, steps: list[list]) -> bool:
        """Whether `run` and its actions' `steps` ([id, status], in order), both read under the run's lock, are
        still what the decision was made from."""
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
    if not plan.guards.hold(run, runsteps.guard(runsteps.read(run.pk))) or (
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
