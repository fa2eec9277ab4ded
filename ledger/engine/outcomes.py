"""Recording a step's outcome: success (result, snapshots, verification, the compensation plan), failure
(retry, refusal, unknown), and `settling`, which makes sure every outcome ends in a recorded state. A forward step's
success and its failure for good are decided once (ledger/engine/outcome_plans.py) and handed to a writer here.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Callable

from django.db import InterfaceError, OperationalError
from django.db.models import Q

from ledger import events
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.db import mapping, sql
from ledger.engine import (attempts, failpoints, fastpath, outcome_plans, plans, readback, runstate, runsteps,
                           unwind_plans, unwinding)
from ledger.engine.dispatch import enqueue
from ledger.engine.leases import db_now, lease_at_write
from ledger.engine.transitions import action_transition
from ledger.errors import StateConflict
from ledger.executors.call import ToolError, ToolOutcome
from ledger.models import (
    Action,
    ActionKind,
    ActionStatus as A,
    CompensationStrategy,
    OnRefusal,
    Run,
    RunStatus as R,
)

log = logging.getLogger("unwind.engine")


SETTLED = object()  # what `settling` answers when the step failed to settle and was recorded as such


# What a failure to reach the database is: the ledger cannot record anything now, so nothing is recorded; the lease
# runs out and the sweep takes the step over (bounded by UNWIND_MAX_RECLAIMS), knowing whether it was sent.
UNREACHABLE = (OperationalError, InterfaceError)


def settling(action: Action, owner: str, stage: str, result, work: Callable[[], object]):
    """Run `work`, a step of settling `action`'s outcome. Whatever it raises but a ToolError (which its caller
    handles) or a database out of reach ends in a recorded state and a recovery item saying what failed
    (`settle_failed`), never in an action left running for the sweep to take over and fail again. `result`: the
    tool's answer when it gave one (the step then did act). Returns what `work` returns, or `SETTLED`."""
    try:
        return work()
    except (ToolError, StateConflict, *UNREACHABLE):
        raise  # a ToolError is its caller's; a StateConflict, someone else having moved the step, is not a failure
    except Exception as error:  # noqa: BLE001 - every failure of the engine's own code is recorded, then alerted
        log.exception("settling action %s failed while %s", action.pk, stage)
        settle_failed(action, owner=owner, stage=stage, error=error, result=result)
        return SETTLED


def settle_failed(action: Action, *, owner: str, stage: str, error: BaseException, result=None) -> None:
    """Settling `action`'s outcome failed while `stage`: record that, and put its run before a person.

    A forward step the tool answered (`result`) acted: it is recorded succeeded with that answer and a failed
    verification naming what failed, so an unwind undoes it with its answer. Otherwise (an error being recorded,
    a read-back, or a compensation) its outcome is unknown: it is recorded lost (`settle_failed`)."""
    why = f"{stage} failed: {error.__class__.__name__}: {str(error)[:500]}"
    with ledger_transaction(action.tenant_id) as audit:
        current = sql.get(Action, pk=action.pk)
        if current is None or current.status != A.RUNNING or current.lease_owner != owner:
            return  # it settled after all, or someone else holds it now
        action.status = current.status
        attempts.finish_attempt(action, "settle_failed", latency_ms=None, error=ToolError(why, transient=False), log=audit)
        answered = result is not None and action.kind == ActionKind.FORWARD
        if answered:
            detail = (f"{action.tool.name} (step {action.seq}) was carried out (the tool answered), but {why}. Its "
                      f"answer is kept as the step's result. Check the step, then compensate to undo it, resume to "
                      f"accept it and go on, or close the run.")
            action_transition(action, A.SUCCEEDED, log=audit, actor=attempts.SYSTEM, where=Q(lease_owner=owner),
                              note={"settle_failed": why}, result=result,
                              verification={"ok": False, "detail": why}, lease_owner="", lease_expires_at=None)
        else:
            detail = (f"{action.tool.name} (step {action.seq}): {why}, so whether it acted is not recorded. Check "
                      f"the target, then resume (the tool says it did not happen: send it again), compensate, or close.")
            action_transition(action, A.LOST, log=audit, actor=attempts.SYSTEM, where=Q(lease_owner=owner),
                              note={"settle_failed": why}, lease_owner="", lease_expires_at=None,
                              error_class="settle_failed", error_message=detail[:2000])
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
            runstate.needs_attention(run, "settle_failed", detail, action=action, log=audit)
        elif run.status == R.UNWINDING:
            runstate.enqueue_unwind_after(run)


def record_success(action: Action, outcome: ToolOutcome, *, latency_ms: float | None, actor: str = attempts.SYSTEM,
                   on_compensated: unwinding.NextUndo | None = None) -> None:
    tool = action.tool
    result = outcome.result
    failpoints.hit("settle_target")
    target_id = action.target_id or readback.target_from_result(tool, result)
    after = None
    verification = None
    if action.kind == ActionKind.FORWARD and tool.target_from.startswith("result.") and not target_id:
        verification = {"ok": False, "detail": f"the result does not give ${tool.target_from}, the step's target"}
    if action.kind == ActionKind.FORWARD and tool.snapshot.get("read") and target_id:
        failpoints.hit("settle_snapshot")
        try:
            after = readback.snapshot_fields(tool, readback.read_target(tool, target_id))
        except ToolError as error:
            verification = {"ok": False, "detail": f"could not read the target back: {error.message}"}
    if action.kind == ActionKind.FORWARD and tool.verify.get("expect") and verification is None:
        failpoints.hit("settle_verify")
        try:
            expected = mapping.resolve(tool.verify["expect"], {**readback.context_for(action, after=after), "result": result, "target": target_id})
            observed = after if after is not None else result
            mismatched = {k: {"expected": v, "observed": (observed or {}).get(k)} for k, v in expected.items()
                          if not isinstance(observed, dict) or not readback.same_value(observed.get(k), v)}
            verification = {"ok": not mismatched, "mismatched": mismatched} if mismatched else {"ok": True}
        except mapping.MappingError as error:
            verification = {"ok": False, "detail": str(error)}
    plan = dict(action.compensation_plan)
    failpoints.hit("settle_plan")
    if plan.get("strategy") not in (None, CompensationStrategy.NONE):
        # `readback.context_for` of the step as it stands now, without building an Action for it (its args as such
        # an Action, which has no args_text, gives them: the canonical form).
        preview = readback.context(args=action.args, result=result, before=action.before, after=after,
                                   target=target_id, key=action.idempotency_key, intent=action.intent)
        try:
            plan["args_preview"] = mapping.resolve(plan.get("args", {}), preview)
            plan.pop("error", None)
        except mapping.MappingError as error:
            plan["error"] = str(error)
    found = outcome.read_back
    if found is not None and action.kind == ActionKind.FORWARD:
        # Read back, not answered: the record is kept beside the result, and a result the compensation cannot be
        # resolved from (or that lacks the target) sends the step to a person with it.
        problems = [p for p in (found.problem, (verification or {}).get("detail"), plan.get("error") and
                                f"its compensation cannot be resolved from it: {plan['error']}") if p]
        verification = {**(verification or {}), "ok": not problems and (verification or {}).get("ok", True),
                        "read_back": {"by": found.by, "evidence": found.evidence}}
        if problems:
            verification["detail"] = "; ".join(problems)
    failpoints.hit("settle_record")
    changes = dict(result=result, after=after, verification=verification, target_id=target_id, compensation_plan=plan,
                   lease_owner="", lease_expires_at=None, error_class="", error_message="")
    if action.kind == ActionKind.FORWARD:
        record_forward_success(action, changes, latency_ms=latency_ms, actor=actor)
        return
    # A compensation's: decided once (`unwind_plans.compensated`), with the unwinder's next claim or the settling
    # in the same commit.
    unwind_plans.record_compensated(action, changes, latency_ms=latency_ms, actor=actor, chain=on_compensated)


OUTCOME_TRIES = 3  # decisions of one outcome: a guard fails again only while the run keeps changing under it


def record_forward_success(action: Action, changes: dict, *, latency_ms: float | None, actor: str) -> None:
    """A forward step's success: decided once, in Python (`outcome_plans.success`), from the step and the run in
    hand (its steps only when the decision needs them: kept on the run, else read), and written under the guards it
    was decided under: by PostgreSQL's one call (`fastpath.succeed`: a plan that writes the step alone) or by the
    Python writer (`plans.write_outcome`: SQLite, UNWIND_FAST_PATH off, a plan that moves the run, or one the call
    did not take). A failed guard: read the run afresh and decide again; a step moved by someone else is theirs
    (StateConflict). `action` then holds the changes, and `action.run` the run as written."""
    one_call = fastpath.usable(action.tenant_id)
    run = action.run if Action.run.is_cached(action) else None
    for tries in range(OUTCOME_TRIES):
        if run is None:
            if tries and Action.objects.filter(pk=action.pk).values_list("status", flat=True).first() != action.status:
                raise StateConflict(f"action {action.pk} is no longer {action.status}: someone else acted first")
            run = sql.get(Run, pk=action.run_id)
        steps = runsteps.kept(run)
        plan = outcome_plans.success(action, run, changes, latency_ms=latency_ms, actor=actor,
                                     steps_of=lambda: steps if steps is not None else runsteps.read(run.pk))
        written = fastpath.succeed(plan) if one_call else None
        if written is None:
            with ledger_transaction(action.tenant_id) as audit:
                written = plans.write_outcome(plan, log=audit)
        if written != plans.STALE:
            for name, value in plan.changes.items():
                setattr(action, name, value)
            held(run, written, action, steps)
            return
        runsteps.keep(run, None)  # a guard failed: the next decision reads afresh
        run = None
    raise StateConflict(f"run {action.run_id} kept changing while step {action.pk}'s outcome was being recorded; "
                        "try again")


def held(run: Run, written: Run, action: Action, steps: list | None) -> None:
    """The run in hand brought to what was written (`written`: the writer's run), so that the caller, and the next
    decision made from it, see it: its columns, and its kept `steps` with this one moved (None: none kept)."""
    if written is not run:  # (a plan that leaves the run as it is answers the run in hand)
        for field in Run._meta.concrete_fields:
            setattr(run, field.attname, getattr(written, field.attname))
    action.run = run
    runsteps.keep(run, steps)
    if steps is not None:
        runsteps.moved(run, action.pk, action.status)


def record_failure(action: Action, error: ToolError, *, latency_ms: float | None, retry_inline: bool, delay: float,
                   owner: str, actor: str = attempts.SYSTEM) -> bool:
    """Record a failed attempt. Returns True when the action will be retried (inline or scheduled).

    When a step's last attempt ended in an error that leaves its effect unknown (a 5xx, a timeout), it is
    not called failed on faith: the tool is read back first. Found → it succeeded; not found → it failed;
    cannot be told → its outcome is unknown and a person is asked (guarantee 2: never "compensated" with
    an effect possibly still standing).
    """
    failpoints.hit("settle_failure")
    note = {"error_class": error.error_class, "error": error.message[:500]}
    final = not (error.transient and action.attempts < action.max_attempts)
    if final and error.maybe_applied and error.status is None and not action.tool.honours_idempotency_key \
            and action.attempts == action.max_attempts and (action.tool.lookup.get("read") or action.tool.verify):
        # No answer, and the call may still be running at the server: read it back once it must be over,
        # in one more pass (the read-back comes first there), rather than now.
        with ledger_transaction(action.tenant_id) as audit:
            attempts.finish_attempt(action, readback.UNANSWERED_LAST_TRY, latency_ms=latency_ms, error=error, log=audit)
            action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                              next_attempt_at=db_now() + timedelta(seconds=action.tool.timeout_seconds + 1),
                              max_attempts=action.attempts + 1, lease_owner="", lease_expires_at=None,
                              error_class=error.error_class, error_message=error.message[:2000])
        return True
    # A first attempt has no earlier one that could have acted (its own is not finished yet).
    if final and action.kind == ActionKind.FORWARD and (
            error.maybe_applied or (action.attempts > 1 and attempts.an_attempt_may_have_acted(action))):
        try:
            evidence = readback.already_done(action)
        except ToolError as unreadable:
            record_unknown(action, error, why=unreadable.message, latency_ms=latency_ms, actor=actor)
            return False
        if evidence is not None:
            attempts.finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error)
            record_success(action, readback.read_back_outcome(evidence), latency_ms=None, actor=actor)
            return False
    if final and action.kind == ActionKind.FORWARD and not answers_refusal(action, error):
        record_forward_failure(action, error, latency_ms=latency_ms, actor=actor)
        return False
    with ledger_transaction(action.tenant_id) as audit:
        attempts.finish_attempt(action, "failed_transient" if error.transient else "failed_permanent", latency_ms=latency_ms,
                       error=error, log=audit)
        if error.transient and action.attempts < action.max_attempts:
            if retry_inline:
                action_transition(action, A.RUNNING, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                                  attempts=action.attempts + 1,
                                  lease_expires_at=lease_at_write(action.tool.timeout_seconds + delay, row=action),
                                  error_class=error.error_class, error_message=error.message[:2000])
                attempts.start_attempt(action, owner, log=audit)
            else:
                action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note,
                                  next_attempt_at=db_now() + timedelta(seconds=delay), lease_owner="",
                                  lease_expires_at=None, error_class=error.error_class, error_message=error.message[:2000])
            return True
        if answers_refusal(action, error):
            action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="",
                              lease_expires_at=None, error_class=attempts.REFUSED, error_message=error.message[:2000])
            after_refusal(action, error, log=audit, actor=actor)
            return False
        action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="", lease_expires_at=None,
                          error_class=error.error_class, error_message=error.message[:2000])
        after_failure(action, log=audit, actor=actor)  # a compensation's (a forward step's: `record_forward_failure`)
    return False


def record_forward_failure(action: Action, error: ToolError, *, latency_ms: float | None, actor: str) -> None:
    """A forward step's failure for good: decided once, in Python (`outcome_plans.failure`), and written under the
    guards it was decided under. On PostgreSQL the decision reads the run as the unwind that follows reads it
    (`fastpath.run_for_unwind`: one statement, the ids of what it will write drawn with it), and the plan is written
    by one call (`fastpath.outcome`) when it moves no other step and emits nothing; the unwind its caller runs next
    takes that read over (`unwinding.hand_over`). Otherwise the decision reads the run in hand and its steps (kept on
    it, else read with it) and the Python writer writes the plan (`plans.write_outcome`), queueing the unwinder. A
    failed guard: read afresh and decide again; a step moved by someone else is theirs (StateConflict)."""
    one_call = fastpath.usable(action.tenant_id)
    run = action.run if Action.run.is_cached(action) else None
    for tries in range(OUTCOME_TRIES):
        if tries and Action.objects.filter(pk=action.pk).values_list("status", flat=True).first() != action.status:
            raise StateConflict(f"action {action.pk} is no longer {action.status}: someone else acted first")
        read = fastpath.run_for_unwind(action.run_id, checkpoints=2) if one_call else (None,)
        if read[0] is not None:
            run, ids, checkpoint_ids, threshold, rows = read
            steps = [runsteps.Seen(row.pk, row.seq, row.kind, row.status, "", "", "", name, action_class)
                     for row, name, action_class, _ in rows]
        else:
            steps = runsteps.kept(run) if run is not None else None
            if steps is None:
                run, steps = runsteps.run_with_steps(action.run_id)
        plan = outcome_plans.failure(action, run, error, latency_ms=latency_ms, actor=actor, steps_of=lambda: steps,
                                     pending_of=lambda pks: list(Action.objects.filter(pk__in=pks)
                                                                 .select_related("tool").order_by("seq")))
        written = fastpath.outcome(plan.numbered(checkpoint_ids[:len(plan.checkpoints)])) \
            if read[0] is not None else None
        if written is None:
            with ledger_transaction(action.tenant_id) as audit:
                written = plans.write_outcome(plan, log=audit)
        elif written != plans.STALE and plan.unwind_after and not plan.run_changes:
            enqueue("ledger.tasks.unwind_run", run.pk)  # a run unwinding already, which no unwinder holds
        elif written != plans.STALE and plan.unwind_after:
            # The unwind starts here: no unwinder is queued, as the caller unwinds the run next, from this read
            # (`unwinding.unwind_elsewhere` queues one when it will not).
            unwinding.hand_over(unwinding.UnwindState(plan.run, ids, checkpoint_ids[1], threshold, [
                ((fastpath.Step(action.pk, action.seq, action.kind, A.FAILED), *row[1:]) if row[0].pk == action.pk
                 else row) for row in rows]))
        if written != plans.STALE:
            for name, value in plan.changes.items():
                setattr(action, name, value)
            if Action.run.is_cached(action):
                held(action.run, written, action, None if plan.others else runsteps.kept(action.run))
            return
        if Action.run.is_cached(action):
            runsteps.keep(action.run, None)  # a guard failed: the next decision reads afresh
        run = None
    raise StateConflict(f"run {action.run_id} kept changing while step {action.pk}'s outcome was being recorded; "
                        "try again")


def answers_refusal(action: Action, error: ToolError) -> bool:
    """A forward step the tool turned down ("not carried out") is the agent's to answer, unless its tool's policy
    asks for the unwind (`on_refusal: unwind`). Compensations never are: an undo that is turned down is alerted."""
    return error.refused and action.kind == ActionKind.FORWARD and action.tool.on_refusal == OnRefusal.ANSWER


def after_refusal(action: Action, error: ToolError, *, log: AuditLog, actor: str) -> None:
    """The step did nothing: the run stays as it is (the agent re-proposes otherwise, completes or cancels).

    It never counts towards the ordering law, is never compensated and commits no pivot. A run that was
    cancelled or started unwinding while the step was in flight goes on with its unwind.
    """
    run = sql.get_locked(Run, action.run_id)
    log.record("forward.refused", actor=actor, action=action, tool=action.tool.name, status=error.status,
               reason=error.message[:500], run_status=run.status)
    if run.status == R.UNWINDING:
        runstate.enqueue_unwind_after(run)


def record_unknown(action: Action, error: ToolError, *, why: str, latency_ms: float | None, actor: str) -> None:
    """The step may or may not have acted, and nothing can tell: mark it lost and put the run before a person."""
    detail = (f"{action.tool.name} (step {action.seq}) answered {error.message} on its last attempt, so it may have "
              f"acted, and it cannot be read back ({why}). Check the target, then resume, compensate or close.")
    with ledger_transaction(action.tenant_id) as audit:
        attempts.finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error, log=audit)
        action_transition(action, A.LOST, log=audit, actor=actor, note={"error": error.message[:500]},
                          lease_owner="", lease_expires_at=None, error_class="outcome_unknown",
                          error_message=detail[:2000])
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
            runstate.needs_attention(run, "outcome_unknown", detail, action=action, log=audit)
        elif run.status == R.UNWINDING:
            runstate.enqueue_unwind_after(run)


def after_failure(action: Action, *, log: AuditLog, actor: str) -> None:
    """A compensation failed for good: its step is marked so, and the unwind alerts and continues (a forward step's
    failure is decided by `failure`)."""
    run = sql.get_locked(Run, action.run_id)
    forward = Action.objects.select_related("tool").get(pk=action.compensates_id)
    action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=actor,
                      note={"error": action.error_message[:500]})
    events.emit("compensation_failed", action=action, forward=forward)
    if run.status == R.UNWINDING:
        runstate.enqueue_unwind_after(run)
