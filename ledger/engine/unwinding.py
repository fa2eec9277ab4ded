"""Compensation: planning each step's undo, claiming the next undo newest-first (the cases a plan does not decide:
ledger/engine/unwind_plans.py decides a compensation's success and the unwind's start, with the plain next claim or
the settling), and handing an unwind between the processes that take part in it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable


from ledger import events
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.canonical import canonical, digest
from ledger.db import mapping, received, sql
from ledger.engine import attempts, fastpath, readback, runstate
from ledger.engine.dispatch import enqueue
from ledger.engine.leases import lease_at_write
from ledger.engine.transitions import action_transition
from ledger.models import (
    Action,
    ActionKind,
    ActionStatus as A,
    CompensationStrategy,
    Executor,
    Run,
    RunStatus as R,
    Tenant,
    Tool,
)
from ledger.policy.law import approvals_needed

log = logging.getLogger("unwind.engine")


@dataclass
class UnwindState:
    """What an unwind's decision reads (`unwind_plans.read`: `fastpath.run_for_unwind` on PostgreSQL), or what the last
    write left: the run, ids drawn for the compensations to come and for a checkpoint (PostgreSQL's read draws them;
    else none, and the writer's inserts do), the tenant's approval threshold, and the run's actions with their
    tools."""

    run: Run | None
    ids: list
    checkpoint_id: int | None
    threshold: str | None
    rows: list

    @classmethod
    def read(cls, run_id: int) -> UnwindState:
        run, ids, checkpoint_ids, threshold, rows = fastpath.run_for_unwind(run_id)
        return cls(run, ids, checkpoint_ids[0] if checkpoint_ids else None, threshold, rows)


# PostgreSQL: the run as this thread's last one-call failure left it (`outcomes.failed_in_one_call`), which the unwind the
# same thread starts next (the API's inline path, the worker's task, the benchmark) takes as its first read instead of
# reading the run again; taken once, and only for that run. Its call still checks every status, and the lease, under
# its locks.
_handed = threading.local()


def hand_over(state: UnwindState) -> None:
    _handed.state = state


def handed_over(run_id: int) -> UnwindState | None:
    state, _handed.state = getattr(_handed, "state", None), None
    return state if state is not None and state.run is not None and state.run.pk == run_id else None


def unwind_elsewhere(run_id: int) -> None:
    """For a caller that executed a step and will not unwind its run now (its time is up): the worker does it.

    The one-call failure queues no unwind, as its caller goes on to unwind the run itself; a crash in between
    leaves a run unwinding without a lease, which the sweep hands to a worker within its interval. The Python
    path queued one already (`start_unwind`)."""
    if handed_over(run_id) is not None:
        enqueue("ledger.tasks.unwind_run", run_id)


class NextUndo:
    """What the unwinder asks of the commit that records a compensation's success (`unwind_plans.record_compensated`):
    claim the next compensation in it too (as `owner`), while `allowed()` (its time budget). The claim (or None:
    nothing to claim now, the run settled or waits) lands in `claimed`."""

    def __init__(self, run_id: int, *, owner: str, allowed: Callable[[], bool]):
        self.run_id, self.owner, self.allowed = run_id, owner, allowed
        self.claimed: list[Action | None] = []
        # The run as the last write of this unwind left it (`UnwindState`), which the next decision starts from
        # instead of reading it again; the next writer still compares every status under its locks.
        self.state: UnwindState | None = None
        self.settled: Run | None = None  # the run, when a one-call settled it: the unwind's answer, as it was written


def next_compensation(run_id: int, *, owner: str, tenant_id: int | None = None) -> Action | None:
    """Pick the newest action still to compensate and claim its compensation; settle the run if none is left.

    Returns the claimed compensation (status running, lease held by `owner`), or None when the unwinder
    should stop (the run settled, or it waits for something: an in-flight step, an approval, a report).
    """
    if tenant_id is None:
        tenant_id = Run.objects.values_list("tenant_id", flat=True).get(pk=run_id)
    with ledger_transaction(tenant_id) as audit:
        return claim_next_compensation(run_id, owner=owner, log=audit)


def claim_next_compensation(run_id: int, *, owner: str, log: AuditLog, run: Run | None = None) -> Action | None:
    """`next_compensation` inside the caller's ledger transaction (`run`: the run as it already locked it)."""
    run = run if run is not None else sql.get_locked(Run, run_id)
    if run.status != R.UNWINDING:
        return None
    steps = runstate.run_steps(run.pk)
    if any(status in attempts.PENDING for _, _, status, _ in steps):
        runstate.skip_pending(run, log=log, actor=attempts.SYSTEM, why="the run is being unwound", forward_only=True)
        steps = runstate.run_steps(run.pk)
    steps = [step for step in steps if step[2] in (A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED, A.COMPENSATING)]
    if any(status in (A.RUNNING, A.RETRY_SCHEDULED) for _, _, status, _ in steps):
        return None  # a step in flight, or one that may have acted; when it lands it re-enqueues the unwind
    candidate, tool_name = None, ""
    for action_id, _, _, tool_name in reversed(steps):  # newest first; usually the newest is the one
        step = sql.get(Action, pk=action_id)
        if attempts.compensable(step):
            candidate = step
            break
    if candidate is None:
        runstate.settle(run, log=log)
        return None
    compensation = None
    if candidate.status == A.COMPENSATING:
        compensation = candidate.compensations.select_related("tool").order_by("-id").first()
    if compensation is not None and compensation.status not in (A.REJECTED, A.EXPIRED):  # else: a new one is planned
        if compensation.status == A.LOST:
            # The undo may or may not have acted, and nothing can tell: a person decides (`settle` puts the run in the
            # recovery queue, naming it), never a silent wait.
            runstate.settle(run, log=log)
            return None
        if compensation.status in (A.FAILED, A.APPROVED):
            retry = compensation.status == A.FAILED
            # A step a person forced since this undo was planned (run_compensate): the undo is retried forced, written
            # by the move that retries it, so that its event fingerprints it so.
            forced = {"compensation_plan": dict(compensation.compensation_plan, force=True)} \
                if candidate.compensation_plan.get("force") and not compensation.compensation_plan.get("force") else {}
            action_transition(compensation, A.RUNNING, log=log, actor=attempts.SYSTEM, attempts=compensation.attempts + 1,
                              max_attempts=compensation.attempts + compensation.tool.max_attempts if retry
                              else compensation.max_attempts,
                              lease_owner=owner,
                              lease_expires_at=lease_at_write(compensation.tool.timeout_seconds, row=compensation),
                              **forced)
            attempts.start_attempt(compensation, owner, log=log)
            return compensation
        return None  # awaiting approval, running elsewhere, waiting for a retry or for the agent's report
    planned = plan_compensation(run, candidate, tool_name, owner=owner, log=log)
    if planned is None and candidate.status == A.COMPENSATION_FAILED:
        # Its undo could not even be put together (recorded and alerted): the rest go on, or the run settles.
        return claim_next_compensation(run_id, owner=owner, log=log, run=run)
    return planned


def compensation_tool(run: Run, plan: dict) -> Tool | None:
    """The version of the compensation's tool bound when the forward step was proposed (`tool_id` in its plan),
    so an undo runs with the policy the step was taken under. A plan without one (recorded before tool versions,
    or whose client-executed twin was not registered then) takes the current version of the named tool."""
    if isinstance(plan.get("tool_id"), int):
        where = {"pk": plan["tool_id"], "tenant": run.tenant_id}
    elif isinstance(plan.get("tool"), str):
        where = {"tenant": run.tenant_id, "name": plan["tool"], "is_current": True}
    else:
        return None
    tool, (slug,) = sql.get_also(Tool, (_TENANT_SLUG,), **where)
    if tool is not None:  # its tenant's slug signs its calls; the rest of the tenant loads if asked
        tool.tenant = Tenant.from_db(tool._state.db, ["id", "slug"], [tool.tenant_id, slug])
    return tool


_TENANT_SLUG = "(SELECT slug FROM ledger_tenant WHERE ledger_tenant.id = ledger_tool.tenant_id)"


def undo_args(forward: Action):
    """The arguments of `forward`'s undo: those a person completed for it (ledger/engine/undo_plans.py), else its
    plan's mapping resolved just in time from the step (MappingError when it cannot be)."""
    plan = forward.compensation_plan
    if isinstance(plan.get("completed_args"), dict):
        return plan["completed_args"]
    return mapping.resolve(plan.get("args", {}), readback.context_for(forward))


def plan_compensation(run: Run, forward: Action, forward_tool: str, *, owner: str, log: AuditLog) -> Action | None:
    """Create the compensation action for `forward` (a call of the tool named `forward_tool`), with its args
    resolved just in time."""
    plan = forward.compensation_plan
    tool = compensation_tool(run, plan)
    try:
        if tool is None:
            raise mapping.MappingError(f"compensation tool {plan.get('tool')!r} is not registered")
        args = undo_args(forward)
    except mapping.MappingError as error:
        if forward.status == A.SUCCEEDED:
            action_transition(forward, A.COMPENSATING, log=log, actor=attempts.SYSTEM)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=attempts.SYSTEM, note={"error": str(error)})
        events.emit("compensation_failed", action=None, forward=forward)
        return None
    taken, threshold, defaults_version = attempts.take_seq(run.pk)
    run.next_seq = taken.next_seq
    required = undo_approvals(forward, threshold)
    claim_now = not required and tool.executor != Executor.CLIENT
    # A forward step still `succeeded` has never had a compensation planned: no need to count them.
    earlier = 0 if forward.status == A.SUCCEEDED else forward.compensations.count()
    compensation = new_compensation(run, forward, forward_tool, tool, args=args, seq=run.next_seq - 1,
                                    defaults_version=defaults_version, required=required, owner=owner, earlier=earlier)
    if compensation.lease_expires_at is not None:  # the run is locked: its lease starts at the insert
        compensation.lease_expires_at = lease_at_write(tool.timeout_seconds)
    sql.insert(compensation)
    log.record("compensation.proposed", actor=attempts.SYSTEM, action=compensation, compensates=forward.pk,
               strategy=plan.get("strategy"))
    if forward.status == A.SUCCEEDED:
        action_transition(forward, A.COMPENSATING, log=log, actor=attempts.SYSTEM, note={"compensation": compensation.pk})
    if required:
        events.emit("approval_required", action=compensation, requested_by=attempts.SYSTEM)
        return None
    if claim_now:
        attempts.start_attempt(compensation, owner, log=log)
    return compensation if claim_now else None


def undo_approvals(forward: Action, threshold: str) -> int:
    """How many approvals the compensation of `forward` needs, by its plan and the tenant's threshold."""
    plan = forward.compensation_plan
    return approvals_needed(rule=plan.get("approval", "threshold"), risk=plan.get("risk", forward.risk),
                            required=plan.get("approvals_required", 1), threshold=threshold)


def new_compensation(run: Run, forward: Action, forward_tool: str, tool: Tool, *, args, seq: int,
                     defaults_version: int, required: int, owner: str, earlier: int) -> Action:
    """The compensation of `forward` (a call of `forward_tool`) with its resolved `args`, as it is recorded: gated
    (`required` approvals), claimed by `owner`, or (a client-executed tool) left for the agent. `earlier`: how many
    compensations of it were planned before (each has a key of its own)."""
    plan = forward.compensation_plan
    args_text = received.dumps(args)  # the values `$args.…` took, as the agent wrote them: what the tool receives
    args = canonical(args)
    claim_now = not required and tool.executor != Executor.CLIENT
    return Action(
        tenant_id=run.tenant_id, run=run, seq=seq, kind=ActionKind.COMPENSATION, compensates=forward, tool=tool,
        saga_role=tool.saga_role, risk=plan.get("risk", forward.risk), args=args, args_text=args_text,
        args_hash=digest(args),
        target_type=forward.target_type, target_id=forward.target_id,
        idempotency_key=f"{forward.idempotency_key}:undo" + (f":{earlier + 1}" if earlier else ""),
        key_agent=forward.key_agent,
        key_source="compensation",
        status=A.AWAITING_APPROVAL if required else A.RUNNING, approvals_required=required,
        defaults_version=defaults_version, attempts=0 if required else 1, max_attempts=tool.max_attempts,
        lease_owner=owner if claim_now else "",
        lease_expires_at=attempts.lease_until(tool.timeout_seconds) if not required else None,
        intent={"goal": f"undo step {forward.seq} ({forward_tool})", "strategy": plan.get("strategy")},
        compensation_plan={"strategy": CompensationStrategy.NONE, "force": bool(plan.get("force"))},
    )
