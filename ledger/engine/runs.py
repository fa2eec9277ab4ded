"""Runs: open, complete, cancel, and the three operator decisions (resume, compensate, close)."""
from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError
from django.db.models import Max
from django.utils import timezone

from ledger import events
from ledger.db import sql
from ledger.engine import attempts, fastpath, plans, runstate, runsteps
from ledger.audit import subjects
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.canonical import storable
from ledger.errors import IdempotencyMismatch, StateConflict, ValidationFailed
from ledger.engine.leases import lease_at_write, queued_seconds
from ledger.models import (
    RUN_IDLE_TIMEOUT_SECONDS, ActionKind, ActionStatus as A, Agent, Checkpoint, Run, RunStatus as R, Tenant,
    Tool,
)
from ledger.policy.law import check_plan
from ledger.engine import execution, moves, unknowns
from ledger.engine.proposal import check_key
from ledger.engine.dispatch import enqueue, new_owner
from ledger.engine.transitions import action_transition, run_moved, run_transition


def run_open(*, tenant: Tenant, agent: Agent | None, goal: str = "", on_behalf_of: str = "", intent: dict | None = None,
             plan: list[str] | None = None, actor: str, idempotency_key: str | None = None,
             idle_timeout: int | None = None) -> Run:
    """Open a run. A declared plan (tool names in order) is checked against the ordering law first.

    The run is unwound if it stays idle longer than `idle_timeout` seconds (at most the tenant's
    `run_idle_timeout`, its default): an agent that walks away leaves nothing half-done.

    With an idempotency key, opening again (a client's retry after a lost answer) returns the same run,
    so no empty run is left behind, with `replayed` set; the same key with another goal or plan is refused.
    """
    if intent is not None and not isinstance(intent, dict):
        raise ValidationFailed("intent must be an object", field="intent")
    goal, on_behalf_of = storable(str(goal), field="goal"), storable(str(on_behalf_of), field="on_behalf_of")
    intent = storable(intent or {}, field="intent")
    plan = plan or []
    idle_timeout = idle_timeout_for(tenant, idle_timeout)
    if not isinstance(plan, list) or not all(isinstance(step, str) for step in plan):
        raise ValidationFailed("plan must be a list of tool names", field="plan")
    if plan:
        check_plan(plan, {t.name: t for t in Tool.objects.filter(tenant=tenant, name__in=plan, is_current=True)})
    if idempotency_key is not None:
        idempotency_key = check_key(idempotency_key)
        existing = Run.objects.filter(tenant=tenant, agent=agent, open_key=idempotency_key).first()
        if existing is not None:
            return same_run(existing, agent=agent, goal=goal, on_behalf_of=on_behalf_of, plan=plan)
    run = Run(tenant=tenant, agent=agent, goal=str(goal)[:10000], on_behalf_of=str(on_behalf_of)[:200],
              fingerprint_key=subjects.new_key() if on_behalf_of else "", intent=intent or {}, plan=plan, open_key=idempotency_key or "", idle_timeout_seconds=idle_timeout,
              idle_deadline=timezone.now() + timedelta(seconds=idle_timeout))
    try:
        if not (fastpath.usable(tenant.pk) and fastpath.open_run(run, actor=actor, event={"goal": run.goal[:500],
                                                                                            "plan": plan})):
            with ledger_transaction(tenant.pk) as audit:
                sql.insert(run)
                audit.record("run.opened", actor=actor, run=run, goal=run.goal[:500], plan=plan)
        run.replayed = False
        runsteps.keep(run, [])  # a new run has no step yet: its first proposal decides from that

    except IntegrityError:
        if not idempotency_key:
            raise
        existing = Run.objects.get(tenant=tenant, agent=agent, open_key=idempotency_key)  # a concurrent retry won
        return same_run(existing, agent=agent, goal=goal, on_behalf_of=on_behalf_of, plan=plan)
    return run


def idle_timeout_for(tenant: Tenant, asked: int | None) -> int:
    """The run's idle timeout: the tenant's default, or shorter when the agent asks (never longer: that is policy)."""
    ceiling = tenant.run_idle_timeout_seconds
    if asked is None:
        return ceiling
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < RUN_IDLE_TIMEOUT_SECONDS[0]:
        raise ValidationFailed(f"idle_timeout must be a whole number of seconds, at least "
                               f"{RUN_IDLE_TIMEOUT_SECONDS[0]}", field="idle_timeout")
    if asked > ceiling:
        raise ValidationFailed(f"idle_timeout may be at most the tenant's run_idle_timeout ({ceiling} s), not {asked}",
                               field="idle_timeout")
    return asked


def same_run(run: Run, *, agent: Agent | None, goal: str, on_behalf_of: str, plan: list[str]) -> Run:
    if run.agent_id != (agent.pk if agent else None) or run.goal != str(goal)[:10000] or \
            run.on_behalf_of != str(on_behalf_of)[:200] or run.plan != plan:
        raise IdempotencyMismatch(f"key {run.open_key!r} opened run {run.pk} with another goal, plan or agent; "
                                  "use a new key for a new run", run_id=run.pk)
    run.replayed = True
    return run


COMPLETE_TRIES = 3  # decisions of one completion: a guard fails again only while the run keeps changing under it


def run_complete(*, run: Run, actor: str) -> Run:
    """Complete the run: decided once, in Python (`completion`), from the run in hand and its steps (kept on it by
    the read that fetched it and the calls that wrote since, else read now), and written under the guards it was
    decided under: by PostgreSQL's one call (`fastpath.complete`), or by the Python writer (`plans.write_completion`:
    on SQLite, with UNWIND_FAST_PATH off, when a `run_finished` handler must run in the commit, or when the call
    did not take the plan). A failed guard: read afresh and decide again. What is not to be written is answered
    from a fresh read: a run completed already as it is, anything else refused with the moves model's sentence."""
    one_call = fastpath.usable(run.tenant_id) and not events.subscribed("run_finished")
    steps = runsteps.kept(run)
    for _ in range(COMPLETE_TRIES):
        fresh = steps is None
        if fresh:
            pk = run.pk
            run, steps = runsteps.run_with_steps(pk)
            if run is None:
                raise Run.DoesNotExist(f"run {pk} does not exist")
        decided = completion(run, steps, actor=actor)
        if isinstance(decided, moves.Move):
            if fresh:
                if decided.allowed:
                    return run  # completed already: a repeat
                raise StateConflict(decided.refusal)
            steps = None  # decided from a copy: the answer comes from a fresh read
            continue
        written = fastpath.complete(decided) if one_call else None
        if written is None:
            with ledger_transaction(run.tenant_id) as audit:
                written = plans.write_completion(decided, log=audit)
                if written != plans.STALE:
                    events.emit("run_finished", run=written)
        if written != plans.STALE:
            return written
        steps = None
    raise StateConflict(f"run {run.pk} kept changing while it was being completed; try again")


def completion(run: Run, steps: list[runsteps.Seen], *, actor: str) -> plans.Completion | moves.Move:
    """The completion of `run` decided from it and its `steps` (every action, in order): the run completed, its
    checkpoint (`runstate.checkpoint_state` of its forward steps), the events, and the guards (`plans.RunGuards`).
    When there is nothing to write, the moves model's answer instead (`moves.complete_move`): allowed for a run
    completed already (a repeat), else refused with its sentence (a step in flight, or the run not running)."""
    move = moves.complete_move(run, next(((s.seq, s.tool_name, s.status) for s in steps
                                          if s.status in moves.COMPLETE_WAITS_FOR), None))
    if not move.allowed or run.status == R.COMPLETED:
        return move
    completed, changes = run_moved(run, R.COMPLETED, now=timezone.now())
    checkpoint = Checkpoint(tenant_id=run.tenant_id, run_id=run.pk, label="completed", state=runstate.checkpoint_state(
        completed, [(s.pk, s.seq, s.status, s.tool_name) for s in steps if s.kind == ActionKind.FORWARD]))
    log = AuditLog(run.tenant_id, head=None)  # its entries, not appended here: the writer appends them
    log.record(f"run.{R.COMPLETED}", actor=actor, run=completed, status_from=run.status)
    log.record(plans.Completion.CHECKPOINT_EVENT, actor=attempts.SYSTEM, run=completed, label="completed",
               checkpoint=None)
    return plans.Completion(completed, changes, checkpoint, log.pending, plans.RunGuards.of(run, steps))


def run_cancel(*, run: Run, actor: str, reason: str = "") -> Run:
    """Cancel: start nothing new; unwind what was done before the pivot; after it, ask a person."""
    unwind_now = False
    with ledger_transaction(run.tenant_id) as audit:
        run = sql.get_locked(Run, run.pk)
        if run.cancel_requested_at:
            return run
        moves.require(run, moves.AGENT, "cancel")
        Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())
        run.cancel_requested_at = timezone.now()
        why = f"cancelled by {actor}" + (f": {reason}" if reason else "")
        audit.record("run.cancel_requested", actor=actor, run=run, reason=reason[:1000])
        if run.status in (R.UNWINDING, R.NEEDS_ATTENTION):
            runstate.skip_pending(run, log=audit, actor=actor, why=why, forward_only=True)
            return run
        if run.pivot_committed:
            runstate.skip_pending(run, log=audit, actor=actor, why=why)
            runstate.needs_attention(run, "cancelled_after_pivot", f"The run was {why} after its pivot committed; "
                                      "what was done stands and cannot be unwound automatically.", action=None, log=audit)
        else:
            runstate.start_unwind(run, why, log=audit, actor=actor, cause="cancelled")
            unwind_now = True
    if unwind_now:
        execution.unwind(run.pk, budget=2.0)
        run.refresh_from_db()
    return run


IDLE_ACTOR = "system:idle"
# What keeps a run from being idle whatever the clock says: a step in flight, or one waiting for a person.
BUSY = (A.PLANNED, A.AWAITING_APPROVAL, A.APPROVED, A.RUNNING, A.RETRY_SCHEDULED, A.HELD)


def span(seconds: int) -> str:
    """3600 -> "1h", 90 -> "90s": the idle timeout as a person writes it."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def last_activity(run: Run):
    """The newest sign of life of the run: a proposal, a report, an approval decision or a step's outcome each
    moves an action's `updated_at`; opening, resuming and approval turns move the run's own."""
    newest = run.actions.aggregate(at=Max("updated_at"))["at"]
    return max(run.updated_at, newest) if newest is not None else run.updated_at


def run_expire_idle(*, run_id: int) -> bool:
    """Unwind a run the agent walked away from: running, idle past its deadline, nothing in flight or waiting.

    The sweep picks candidates by `idle_deadline` alone; here, with the run locked, the deadline is measured again
    from the run's last activity and pushed on when something happened since (the usual case for an active run).
    Before the pivot the run is unwound; after it, it goes to the recovery queue, like any failure there.
    Returns True when it expired the run.
    """
    tenant_id = Run.objects.values_list("tenant_id", flat=True).get(pk=run_id)
    with ledger_transaction(tenant_id) as audit:
        run = sql.get_locked(Run, run_id)
        if run.status != R.RUNNING or run.idle_deadline is None:
            return False
        now = timezone.now()
        deadline = last_activity(run) + timedelta(seconds=run.idle_timeout_seconds)
        if run.actions.filter(status__in=BUSY).exists():
            deadline = max(deadline, now + timedelta(seconds=run.idle_timeout_seconds))
        if deadline > now:
            Run.objects.filter(pk=run.pk).update(idle_deadline=deadline)
            return False
        why = f"idle for {span(run.idle_timeout_seconds)}: the agent went away"
        audit.record("run.idle", actor=IDLE_ACTOR, run=run, idle_timeout=run.idle_timeout_seconds,
                     last_activity=(deadline - timedelta(seconds=run.idle_timeout_seconds)).isoformat())
        if run.pivot_committed:
            runstate.needs_attention(run, "idle_after_pivot", f"The run was {why} after its pivot committed; what "
                                      "was done stands and cannot be unwound automatically.", action=None,
                                      log=audit, actor=IDLE_ACTOR)
        else:
            runstate.start_unwind(run, why, log=audit, actor=IDLE_ACTOR, cause="idle")  # queues the unwinder after commit
    return True


def resume_refusal(run: Run) -> str:
    """Why resuming this run cannot work ("" when it can): the moves model's sentence (ledger/engine/moves.py)."""
    return moves.run_moves(run).get(moves.OPERATOR, "resume").refusal


def run_resume(*, run: Run, actor: str, reason: str = "") -> Run:
    """Continue from the last checkpoint: retry failed or lost steps with their same idempotency keys."""
    owners = []
    with ledger_transaction(run.tenant_id) as audit:
        run = sql.get_locked(Run, run.pk)
        retry = moves.require(run, moves.OPERATOR, "resume").touching(moves.RETRY, moves.RESEND)
        run_transition(run, R.RUNNING, log=audit, actor=actor, note={"reason": reason[:1000]}, attention_reason="")
        for action in retry:
            owner = new_owner()
            # On a step whose outcome was unknown, resuming is the person's word that the tool did not act: the
            # step is sent again, recorded as their decision (`resend_by`), and the attempts before it no longer
            # count as ones that may have acted.
            unknown = action.status == A.LOST
            action_transition(action, A.RUNNING, log=audit, actor=actor, attempts=action.attempts + 1,
                              max_attempts=action.attempts + action.tool.max_attempts, lease_owner=owner,
                              lease_expires_at=lease_at_write(queued_seconds(action.tool), row=action),
                              error_class="", error_message="",
                              note={"decision": "the tool did not act: send it again"} if unknown else None)
            attempts.start_attempt(action, owner, log=audit, resend_by=actor if unknown else "")
            if action.tool.executor != "client":
                owners.append((action.pk, owner))
        runstate.checkpoint_save(run, "resumed", log=audit)
        events.emit("run_attention_cleared", run=run, resolution="resumed", actor=actor)
        for action_id, owner in owners:
            enqueue("ledger.tasks.execute_action", action_id, owner)
    return run


def run_compensate(*, run: Run, actor: str, reason: str = "", force: bool = False, unknown: str = "") -> Run:
    """Unwind a run that needs attention, newest-first; failed compensations are tried again.

    `force` lets a snapshot restore overwrite a target that drifted: a person looked and decided. `unknown` is the
    person's word on its steps whose outcome is unknown (ledger/engine/unknowns.py), so the run settles at once.
    """
    with ledger_transaction(run.tenant_id) as audit:
        run = sql.get_locked(Run, run.pk)
        moves.require(run, moves.OPERATOR, "compensate")
        if unknown:
            unknowns.decide_unknown(run, unknown, actor=actor, log=audit)
        for forward in run.actions.filter(kind=ActionKind.FORWARD, status=A.COMPENSATION_FAILED):
            # The person's word to overwrite goes into the step's plan by the move that records it (the event
            # fingerprints the row as written); the undo that is retried takes it from there when it is
            # (unwinding.claim_next_compensation), and its earlier undos stay as they were tried.
            forced = {"compensation_plan": dict(forward.compensation_plan, force=True)} if force else {}
            action_transition(forward, A.COMPENSATING, log=audit, actor=actor, note={"retry": True, "force": force},
                              **forced)
        run_transition(run, R.UNWINDING, log=audit, actor=actor, note={"reason": reason[:1000], "force": force, "cause": "operator"},
                       attention_reason="")
        runstate.checkpoint_save(run, "operator_compensate", log=audit)
        events.emit("run_attention_cleared", run=run, resolution="compensated", actor=actor)
    execution.unwind(run.pk, budget=2.0)
    run.refresh_from_db()
    return run


def run_close(*, run: Run, actor: str, reason: str) -> Run:
    """Mark a run that needs attention as handled. A reason is required: it goes into the audit chain."""
    if not reason or not reason.strip():
        raise ValidationFailed("closing a run needs a reason", field="reason")
    with ledger_transaction(run.tenant_id) as audit:
        run = sql.get_locked(Run, run.pk)
        moves.require(run, moves.OPERATOR, "close")
        runstate.skip_pending(run, log=audit, actor=actor, why=f"run closed: {reason}")
        run_transition(run, R.CLOSED, log=audit, actor=actor, note={"reason": reason[:1000]})
        runstate.checkpoint_save(run, "closed", log=audit)
        events.emit("run_attention_cleared", run=run, resolution="closed", actor=actor)
        events.emit("run_finished", run=run)
    return run
