"""A step of an unwind decided once, in Python, as a write plan (`plans.UnwindStep`): a compensation's success
(`compensated`: the undo succeeded, its step compensated) and the unwind's start (`claimed`: the run's unwind lease
taken), each with what follows (`following`): the next undo claimed newest-first, or the run settled compensated,
with the guards it was decided under. The decision reads the run and every action of it in one statement
(PostgreSQL: `fastpath.run_for_unwind`, or the state the last write left, `unwinding.NextUndo.state`; elsewhere:
`read`). `record_compensated` and `claim_unwind` hand the plan to a writer (PostgreSQL's one call,
`fastpath.compensated`, or the Python writer, `plans.write_unwind`) and decide again from a fresh read when a guard
failed.

A next undo that is no plain claim (a pending step to skip, a step in flight, an undo to retry, one that needs an
approval or the agent, or whose arguments cannot be resolved, a run that does not settle compensated) is left to
`unwinding.claim_next_compensation`, in the Python writer's transaction (`then_claim`).
"""
from __future__ import annotations

import copy
from datetime import datetime

from django.utils import timezone

from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.db import mapping, sql
from ledger.engine import attempts, fastpath, plans, runstate, unwinding
from ledger.engine.transitions import ACTION_TRANSITIONS, moved, run_moved
from ledger.errors import StateConflict
from ledger.models import (
    Action,
    ActionClass,
    ActionKind,
    ActionStatus as A,
    Attempt,
    Checkpoint,
    Executor,
    Run,
    RunStatus as R,
    Tenant,
)

TRIES = 3  # decisions of one step of an unwind: a guard fails again only while the run keeps changing under it


# --- the read -----------------------------------------------------------------------------------------------------

def read(run_id: int, *, one_call: bool) -> unwinding.UnwindState:
    """What a decision needs of the run: on PostgreSQL's one-call path `fastpath.run_for_unwind` (one statement,
    the ids of the rows it may insert drawn with it); else (or for a run past its read limit) the run, the tenant's
    threshold and every action of the run with its tool, the steps it may undo next whole with their undo tool."""
    if one_call:
        state = unwinding.UnwindState.read(run_id)
        if state.run is not None:
            return state
    run = sql.get(Run, pk=run_id)
    if run is None:
        return unwinding.UnwindState(None, [], None, None, [])
    threshold = Tenant.objects.values_list("approval_threshold", flat=True).get(pk=run.tenant_id)
    rows = []
    for action in Action.objects.filter(run_id=run_id).select_related("tool").order_by("seq"):
        action.run = run
        tool = action.tool
        if action.kind == ActionKind.FORWARD and action.status in fastpath.UNDO_NEXT:
            undo_tool = unwinding.compensation_tool(run, action.compensation_plan) \
                if attempts.compensable(action) else None
            rows.append((action, tool.name, tool.action_class, undo_tool))
        else:
            rows.append((fastpath.Step(action.pk, action.seq, action.kind, action.status), tool.name,
                         tool.action_class, None))
    return unwinding.UnwindState(run, [], None, threshold, rows)


# --- the decisions ------------------------------------------------------------------------------------------------

class Deciding:
    """A step of an unwind being decided, in memory: the run as read and as the plan leaves it, its actions'
    statuses once the plan's own moves are made, the events, and what follows."""

    def __init__(self, state: unwinding.UnwindState, now: datetime):
        self.state, self.now = state, now
        self.run = state.run
        self.status = {action.pk: action.status for action, *_ in state.rows}
        self.log = AuditLog(state.run.tenant_id, head=None)  # its entries, not appended here: the writer does
        self.parts: dict = {}

    def plan(self, *, lease: bool, threshold: bool = False, unwind_after: bool = False) -> plans.UnwindStep:
        guards = plans.UnwindGuards(plans.RunGuards.of(self.state.run, [row[0] for row in self.state.rows]), lease,
                                    self.state.run.lease_expires_at, self.state.threshold if threshold else None)
        return plans.UnwindStep(self.run, self.now, guards, self.log.pending, unwind_after=unwind_after, **self.parts)


def compensated(undo: Action, changes: dict, state: unwinding.UnwindState, *, latency_ms: float | None, actor: str,
                owner: str | None) -> plans.UnwindStep:
    """The success of compensation `undo` (its tool answered: `changes`) decided from `state`: the undo succeeded,
    its attempt ended, its step compensated; then, with `owner` (the unwinder, claiming the next undo in the same
    commit) and the run still unwinding, what follows (`following`). Without `owner`, an unwinder is queued when the
    run is unwinding and none holds it (the unwinder that claims next continues the unwind itself, and its decision
    does not read the lease). StateConflict when the undo or its step cannot move so (someone else acted first)."""
    run = state.run
    read = {action.pk: action for action, *_ in state.rows}
    was, forward = getattr(read.get(undo.pk), "status", None), read.get(undo.compensates_id)
    if run is None or was is None or A.SUCCEEDED not in ACTION_TRANSITIONS.get(was, ()) or forward is None \
            or A.COMPENSATED not in ACTION_TRANSITIONS.get(forward.status, ()) or not isinstance(forward, Action):
        raise StateConflict(f"compensation {undo.pk} or its step moved: someone else acted first")
    decided = Deciding(state, timezone.now())
    now = decided.now
    undo_after, undo_changes = moved(undo, A.SUCCEEDED, now=now, **changes)
    forward_after, forward_changes = moved(forward, A.COMPENSATED, now=now)
    decided.log.record(f"{undo.kind}.{A.SUCCEEDED}", actor=actor, action=undo_after, status_from=was)
    decided.log.record(f"{forward.kind}.{A.COMPENSATED}", actor=actor, action=forward_after,
                       status_from=forward.status)
    decided.status[undo.pk], decided.status[forward.pk] = A.SUCCEEDED, A.COMPENSATED
    decided.parts.update(
        undo=undo_after, undo_changes=undo_changes, undo_from=was, forward=forward_after,
        forward_changes=forward_changes, forward_from=forward.status,
        attempt=Attempt(action_id=undo.pk, number=undo.attempts, finished_at=now, outcome="succeeded",
                        latency_ms=latency_ms, error_class="", error_message=""))
    if owner is None:
        return decided.plan(lease=True, unwind_after=run.status == R.UNWINDING and runstate.unwinder_free(run, now))
    if run.status == R.UNWINDING:
        following(decided, owner=owner)
    return decided.plan(lease=False, threshold="claim" in decided.parts)


def claimed(state: unwinding.UnwindState, *, owner: str) -> plans.UnwindStep | None:
    """The unwind's start decided from `state`: the run's unwind lease taken by `owner`, then what follows
    (`following`). None when the run is not unwinding or another unwinder holds its lease."""
    run = state.run
    now = timezone.now()
    if run is None or run.status != R.UNWINDING or not runstate.unwinder_free(run, now):
        return None
    decided = Deciding(state, now)
    decided.run = copy.copy(run)  # its lease is the writer's to start
    decided.parts["lease"] = attempts.lease_until()
    following(decided, owner=owner)
    return decided.plan(lease=True, threshold="claim" in decided.parts)


def following(decided: Deciding, *, owner: str) -> None:
    """What follows in an unwinding run once `decided`'s own moves are made: the newest step that is done and has an
    undo gets its compensation, claimed by `owner` (its step compensating); none left, the run settles compensated
    with its checkpoint. Anything else is `then_claim`: `unwinding.claim_next_compensation` decides it in the Python
    writer's transaction."""
    state, status, now, run = decided.state, decided.status, decided.now, decided.run
    steps = [row for row in state.rows if row[0].kind == ActionKind.FORWARD]
    active = [row for row in steps if status[row[0].pk] in (A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED,
                                                             A.COMPENSATING)]
    if any(status[step.pk] in attempts.PENDING for step, *_ in steps) \
            or any(status[step.pk] in (A.RUNNING, A.RETRY_SCHEDULED) for step, *_ in active):
        decided.parts["then_claim"] = True  # steps to skip first, or one in flight
        return
    candidate = next((row for row in reversed(active) if attempts.compensable(row[0])), None)
    if candidate is not None:
        step, step_tool, _, tool = candidate
        if status[step.pk] != A.SUCCEEDED or tool is None or tool.executor == Executor.CLIENT \
                or unwinding.undo_approvals(step, state.threshold):
            decided.parts["then_claim"] = True
            return
        try:
            args = unwinding.undo_args(step)
        except mapping.MappingError:
            decided.parts["then_claim"] = True  # the Python path records why
            return
        undo = unwinding.new_compensation(run, step, step_tool, tool, args=args, seq=0, defaults_version=0,
                                          required=0, owner=owner, earlier=0)
        undo.pk = state.ids[0] if state.ids else None  # else drawn by the writer's insert
        decided.log.record(plans.UnwindStep.PROPOSED, actor=attempts.SYSTEM, action=undo, compensates=step.pk,
                           strategy=step.compensation_plan.get("strategy"))
        forward, changes = moved(step, A.COMPENSATING, now=now)
        decided.log.record(f"{step.kind}.{A.COMPENSATING}", actor=attempts.SYSTEM, action=forward,
                           status_from=A.SUCCEEDED, compensation=undo.pk)
        decided.parts["claim"] = plans.Claim(forward, changes, A.SUCCEEDED, undo, tool, Attempt(
            action=undo, number=undo.attempts, worker=owner[:120], started_at=now))
        return
    standing = [step for step, _, action_class, _ in steps if status[step.pk] == A.SUCCEEDED
                and action_class != ActionClass.READ_ONLY and not attempts.compensable(step)]
    if standing or any(status[step.pk] == A.COMPENSATION_FAILED for step, *_ in steps) \
            or any(status[action.pk] == A.LOST for action, *_ in state.rows):
        decided.parts["then_claim"] = True  # `runstate.settle` puts the run before a person
        return
    was = run.status
    settled, columns = run_moved(run, R.COMPENSATED, now=now, lease_expires_at=None)
    decided.run = settled
    decided.log.record(f"run.{R.COMPENSATED}", actor=attempts.SYSTEM, run=settled, status_from=was)
    checkpoint = Checkpoint(pk=state.checkpoint_id, tenant_id=run.tenant_id, run_id=run.pk, label="compensated",
                            state=runstate.checkpoint_state(settled, [(s.pk, s.seq, status[s.pk], name)
                                                                      for s, name, *_ in steps]))
    decided.log.record(plans.Completion.CHECKPOINT_EVENT, actor=attempts.SYSTEM, run=settled, label="compensated",
                       checkpoint=state.checkpoint_id)
    decided.log.pending.append(plans.Emit("run_finished", {"run": settled}))
    decided.parts.update(run_changes=columns, checkpoint=checkpoint)


# --- deciding, writing, deciding again --------------------------------------------------------------------------

def record_compensated(undo: Action, changes: dict, *, latency_ms: float | None, actor: str,
                       chain: unwinding.NextUndo | None) -> None:
    """A compensation's success: decided once (`compensated`) from the run as read (or as the last write of this
    unwind left it, `chain.state`), and written under the guards it was decided under, by PostgreSQL's one call
    (`fastpath.compensated`) or by the Python writer (`plans.write_unwind`: SQLite, UNWIND_FAST_PATH off, a plan
    the call does not take). With `chain` (the unwinder, while its budget lasts) the same commit claims the next
    undo or settles the run; what it claimed lands in `chain.claimed`. A failed guard: read afresh and decide
    again (three times). `undo` then holds its changes, and `undo.run` the run as written."""
    one_call = fastpath.usable(undo.tenant_id)
    owner = chain.owner if chain is not None and chain.allowed() else None
    for _ in range(TRIES):
        state = None
        if chain is not None:
            state, chain.state = chain.state, None
        if state is None or (one_call and not state.ids):
            state = read(undo.run_id, one_call=one_call)
        plan = compensated(undo, changes, state, latency_ms=latency_ms, actor=actor, owner=owner)
        written = write(plan, owner=owner, one_call=one_call)
        if written == plans.STALE:
            continue
        for name, value in plan.undo_changes.items():
            setattr(undo, name, value)
        if Action.compensates.is_cached(undo):
            for name, value in plan.forward_changes.items():
                setattr(undo.compensates, name, value)
        undo.run = written.run or plan.run  # the answer shows the run as this commit leaves it
        landed(plan, written, state, chain, claims=owner is not None)
        return
    raise StateConflict(f"run {undo.run_id} kept changing while compensation {undo.pk}'s outcome was being "
                        "recorded; try again")


def claim_unwind(run_id: int, *, tenant_id: int, owner: str,
                 chain: unwinding.NextUndo | None = None) -> tuple[bool, Action | None]:
    """Take the run's unwind lease and claim its first compensation (or settle the run) in one commit: decided once
    (`claimed`), written as `record_compensated` writes. (False, None) when another unwinder holds the lease or the
    run is not unwinding."""
    one_call = fastpath.usable(tenant_id)
    for tries in range(TRIES):
        state = (unwinding.handed_over(run_id) if one_call and not tries else None) \
            or read(run_id, one_call=one_call)
        plan = claimed(state, owner=owner)
        if plan is None:
            return False, None
        written = write(plan, owner=owner, one_call=one_call)
        if written == plans.STALE:
            continue
        return True, landed(plan, written, state, chain, claims=False)
    raise StateConflict(f"run {run_id} kept changing while its unwind was being claimed; try again")


def write(plan: plans.UnwindStep, *, owner: str | None, one_call: bool) -> plans.Unwound | str:
    """The plan written by PostgreSQL's one call when it takes it, else by the Python writer (which runs
    `claim_next_compensation` as `owner` in its transaction for a next undo that is no plain claim)."""
    written = fastpath.compensated(plan) if one_call else None
    if written is None:
        with ledger_transaction(plan.run.tenant_id) as audit:
            written = plans.write_unwind(plan, log=audit, then=lambda run: unwinding.claim_next_compensation(
                run.pk, owner=owner, log=audit, run=run))
    return written


def landed(plan: plans.UnwindStep, written: plans.Unwound, state: unwinding.UnwindState,
           chain: unwinding.NextUndo | None, *, claims: bool) -> Action | None:
    """The objects in hand brought to what was written: the run's lease, the claimed undo (its id, step number,
    defaults' version and lease as the writer took them), and `chain`: what was claimed, the run once settled, and
    the state the next decision starts from (the run's actions as this write left them; none after a claim the
    Python path decided). Returns the undo claimed, or None."""
    run = plan.run
    if written.run_lease is not None:
        run.lease_expires_at = written.run_lease
    claimed_undo = written.then
    if plan.claim is not None:
        claim = plan.claim
        claimed_undo = claim.undo
        claimed_undo.pk, claimed_undo.seq = written.undo_id, written.step
        claimed_undo.defaults_version, claimed_undo.lease_expires_at = written.defaults_version, written.undo_lease
        claimed_undo._state.adding, claimed_undo._state.db = False, run._state.db
        claimed_undo.tool, claimed_undo.compensates = claim.tool, claim.forward
        run.next_seq = written.step + 1
    if chain is None:
        return claimed_undo
    if claims:
        chain.claimed.append(claimed_undo)
    if plan.run_changes:
        chain.settled = run  # as the writer left it: compensated, its lease cleared
    if plan.claim is not None:
        rewritten = {plan.claim.forward.pk: plan.claim.forward}
        if plan.undo is not None:
            rewritten.update({plan.undo.pk: plan.undo, plan.forward.pk: plan.forward})
        chain.state = unwinding.UnwindState(
            run, state.ids[1:], state.checkpoint_id, state.threshold,
            [(rewritten.get(row[0].pk, row[0]), *row[1:]) for row in state.rows]
            + [(claimed_undo, plan.claim.tool.name, plan.claim.tool.action_class, None)])
    return claimed_undo
