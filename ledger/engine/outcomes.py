"""Recording a step's outcome: success (result, snapshots, verification, the compensation plan), failure
(retry, refusal, unknown), and `settling`, which makes sure every outcome ends in a recorded state.
"""
from __future__ import annotations

import copy
import logging
from datetime import timedelta
from typing import Callable

from django.db import InterfaceError, OperationalError
from django.db.models import Q
from django.utils import timezone

from ledger import events
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.db import mapping, sql
from ledger.engine import attempts, failpoints, fastpath, plans, readback, runstate, runsteps, unwinding
from ledger.engine.leases import db_now, lease_at_write
from ledger.engine.transitions import ACTION_TRANSITIONS, action_transition, moved, run_moved
from ledger.errors import StateConflict
from ledger.executors.call import ToolError, ToolOutcome
from ledger.models import (
    Action,
    ActionKind,
    ActionStatus as A,
    Attempt,
    Checkpoint,
    CompensationStrategy,
    OnRefusal,
    Run,
    RunStatus as R,
    SagaRole,
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
                   on_compensated: Callable[[AuditLog, Run], None] | None = None) -> None:
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
        preview_action = Action(args=action.args, result=result, before=action.before, after=after,
                                target_id=target_id, idempotency_key=action.idempotency_key, intent=action.intent)
        try:
            plan["args_preview"] = mapping.resolve(plan.get("args", {}), readback.context_for(preview_action))
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
    if action.kind == ActionKind.COMPENSATION and isinstance(on_compensated, unwinding.NextUndo) and action.status == A.RUNNING \
            and Action.compensates.is_cached(action) and fastpath.usable(action.tenant_id) \
            and unwinding.compensated_in_one_call(action, changes, latency_ms=latency_ms, actor=actor, chain=on_compensated):
        return  # PostgreSQL, the unwinder's plain case: recorded with the next claim (or the settling) in one call
    with ledger_transaction(action.tenant_id) as audit:
        run = action.run = sql.get_locked(Run, action.run_id)  # the answer shows the run as this leaves it
        action_transition(action, A.SUCCEEDED, log=audit, actor=actor, **changes)
        attempts.finish_attempt(action, "succeeded", latency_ms=latency_ms, log=audit)
        # The unwinder's claim loaded it, in memory since; a change behind it fails the conditional update.
        forward = action.compensates if Action.compensates.is_cached(action) else sql.get(Action, pk=action.compensates_id)
        action_transition(forward, A.COMPENSATED, log=audit, actor=actor)
        if run.status == R.UNWINDING:
            runstate.enqueue_unwind_after(run)
        if on_compensated is not None:
            on_compensated(audit, run)


OUTCOME_TRIES = 3  # decisions of one outcome: a guard fails again only while the run keeps changing under it


def record_forward_success(action: Action, changes: dict, *, latency_ms: float | None, actor: str) -> None:
    """A forward step's success: decided once, in Python (`success`), from the step and the run in hand (its steps
    only when the decision needs them: kept on the run, else read), and written under the guards it was decided
    under: by PostgreSQL's one call (`fastpath.succeed`: a plan that writes the step alone) or by the Python writer
    (`plans.write_outcome`: SQLite, UNWIND_FAST_PATH off, a plan that moves the run, or one the call did not take).
    A failed guard: read the run afresh and decide again; a step moved by someone else is theirs (StateConflict).
    `action` then holds the changes, and `action.run` the run as written."""
    one_call = fastpath.usable(action.tenant_id)
    run = action.run if Action.run.is_cached(action) else None
    for tries in range(OUTCOME_TRIES):
        if run is None:
            if tries and Action.objects.filter(pk=action.pk).values_list("status", flat=True).first() != action.status:
                raise StateConflict(f"action {action.pk} is no longer {action.status}: someone else acted first")
            run = sql.get(Run, pk=action.run_id)
        steps = runsteps.kept(run)
        plan = success(action, run, changes, latency_ms=latency_ms, actor=actor,
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
    decision made from it, see it: its columns, and its kept steps with this one moved."""
    if written is not run:
        for field in Run._meta.concrete_fields:
            setattr(run, field.attname, getattr(written, field.attname))
    action.run = run
    if steps is not None:
        runsteps.keep(run, steps)
        runsteps.moved(run, action.pk, action.status)


def success(action: Action, run: Run, changes: dict, *, latency_ms: float | None, actor: str,
            steps_of: Callable[[], list[runsteps.Seen]]) -> plans.Outcome:
    """The success of forward step `action` decided from it and `run` (and its steps, `steps_of`, read only when
    the decision needs them): the step succeeded with `changes`, its attempt ended, and what follows for the run.
    A pivot commits (the run's mark, its event and checkpoint). A run that is unwinding or cancelled takes the step
    as a late completion, undone like the rest (an unwinder queued when none holds the run). Otherwise a step that
    did not verify puts the run before a person, and a run waiting for approvals runs again once none is awaited.
    StateConflict when the step cannot move to succeeded."""
    if A.SUCCEEDED not in ACTION_TRANSITIONS[action.status]:
        raise StateConflict(f"action {action.pk} cannot go from {action.status} to {A.SUCCEEDED}")
    now = timezone.now()
    after, moved_columns = moved(action, A.SUCCEEDED, now=now, **changes)
    log = AuditLog(run.tenant_id, head=None)  # its entries, not appended here: the writer appends them
    log.record(f"{action.kind}.{A.SUCCEEDED}", actor=actor, action=after, status_from=action.status)
    attempt = Attempt(action_id=action.pk, number=action.attempts, finished_at=now, outcome="succeeded",
                      latency_ms=latency_ms, error_class="", error_message="")
    late = run.status == R.UNWINDING or run.cancel_requested_at is not None
    verification = changes.get("verification")
    unverified = verification is not None and not verification.get("ok")
    pivot = action.saga_role == SagaRole.PIVOT and not run.pivot_committed
    steps = None
    if pivot or (not late and (unverified or run.status == R.AWAITING_APPROVAL)):
        steps = steps_of()
    left = [(s.pk, s.seq, A.SUCCEEDED if s.pk == action.pk else s.status, s.tool_name)
            for s in steps or () if s.kind == ActionKind.FORWARD]
    settled, run_changes, checkpoints, attention = copy.copy(run), {}, [], None

    def checkpoint(label: str) -> None:
        checkpoints.append(Checkpoint(tenant_id=run.tenant_id, run_id=run.pk, label=label,
                                      state=runstate.checkpoint_state(settled, left)))
        log.record(plans.Completion.CHECKPOINT_EVENT, actor=attempts.SYSTEM, run=settled, label=label, checkpoint=None)

    def run_to(status: str, mover: str, note: dict, **fields) -> None:
        nonlocal settled
        was = settled.status
        settled, columns = run_moved(settled, status, now=now, **fields)
        run_changes.update(columns)
        log.record(f"run.{status}", actor=mover, run=settled, status_from=was, **note)

    if pivot:
        settled.pivot_committed = run_changes["pivot_committed"] = True
        log.record("run.pivot_committed", actor=actor, run=settled, action=after)
        checkpoint("pivot_committed")
    if late:
        pass
    elif unverified:
        reason, detail = ("read_back_incomplete", readback.read_back_detail(after, verification)) \
            if "read_back" in verification else \
            ("verification_failed", f"{action.tool.name} (step {action.seq}) did not verify: "
                                    f"{verification.get('detail') or verification.get('mismatched')}")
        run_to(R.NEEDS_ATTENTION, attempts.SYSTEM, {"reason": reason}, attention_reason=reason,
               attention_detail=detail[:4000], lease_expires_at=None)
        checkpoint(f"needs_attention:{reason}")
        attention = (reason, detail)
    elif run.status == R.AWAITING_APPROVAL and not any(status == A.AWAITING_APPROVAL for *_, status, _ in left):
        run_to(R.RUNNING, actor, {})
    unwind_after = run.status == R.UNWINDING and (run.lease_expires_at is None or run.lease_expires_at < now)
    return plans.Outcome(after, moved_columns, attempt, settled, run_changes, tuple(checkpoints), log.pending,
                         plans.StepGuards.of(run, steps, action.status), attention, unwind_after)


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
    if final and action.kind == ActionKind.FORWARD and action.status == A.RUNNING and action.attempts == 1 \
            and not answers_refusal(action, error) and fastpath.usable(action.tenant_id) \
            and failed_in_one_call(action, error, latency_ms=latency_ms, actor=actor):
        return False  # PostgreSQL, the plain case (a first attempt before the pivot): recorded in one call
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
        after_failure(action, log=audit, actor=actor)
    return False


def failed_in_one_call(action: Action, error: ToolError, *, latency_ms: float | None, actor: str) -> bool:
    """PostgreSQL: a forward step's first attempt failed for good in a run still before its pivot: the step failed
    and the run starting to unwind (`after_failure` → `start_unwind`) in one call, from the run's actions read just
    before and checked again under the locks. False with nothing written for anything else (a pivot committed, a
    pending step to skip, a run not running)."""
    run, ids, checkpoint_ids, threshold, rows = fastpath.run_for_unwind(action.run_id, checkpoints=2)
    checkpoint_id = checkpoint_ids[0] if checkpoint_ids else None
    read = {row.pk: row for row, *_ in rows}
    if run is None or run.status != R.RUNNING or run.pivot_committed or run.lease_expires_at is not None \
            or getattr(read.get(action.pk), "status", None) != A.RUNNING:
        return False
    status = {row.pk: row.status for row, *_ in rows}
    status[action.pk] = A.FAILED
    steps = [row for row in rows if row[0].kind == ActionKind.FORWARD]
    if any(status[step.pk] in attempts.PENDING for step, *_ in steps):
        return False  # `skip_pending` first
    now = timezone.now()
    failed, failed_moved = moved(action, A.FAILED, now=now, lease_owner="", lease_expires_at=None,
                                 error_class=error.error_class, error_message=error.message[:2000])
    log = AuditLog(run.tenant_id, head=None)
    log.record(f"{action.kind}.{A.FAILED}", actor=actor, action=failed, status_from=A.RUNNING,
               error_class=error.error_class, error=error.message[:500])
    why = f"{action.tool.name} (step {action.seq}) failed: {failed.error_message}"
    run.status, run.attention_detail, run.updated_at = R.UNWINDING, why[:4000], now
    log.record(f"run.{R.UNWINDING}", actor=actor, run=run, status_from=R.RUNNING, why=why[:500], cause="failed",
               for_action=action.pk)
    checkpoint = Checkpoint(pk=checkpoint_id, tenant_id=run.tenant_id, run=run, label="unwind_started",
                            state=runstate.checkpoint_state(run, [(s.pk, s.seq, status[s.pk], name) for s, name, *_ in steps]))
    log.record("run.checkpoint", actor=attempts.SYSTEM, run=run, label="unwind_started", checkpoint=checkpoint_id)
    attempt = Attempt(action=action, number=action.attempts, finished_at=now, latency_ms=latency_ms,
                      outcome="failed_transient" if error.transient else "failed_permanent",
                      error_class=error.error_class, error_message=error.message[:2000])
    if not fastpath.failed(run=run, run_status=R.RUNNING, steps=[[row.pk, row.status] for row, *_ in rows],
                           action=failed, status_from=A.RUNNING, attempt=attempt, checkpoint=checkpoint,
                           pending=log.pending, now=now):
        return False
    for name, value in failed_moved.items():
        setattr(action, name, value)
    # No unwind is queued: the caller unwinds the run next, from this state (`unwind_elsewhere` when it will not).
    unwinding.hand_over(unwinding.UnwindState(run, ids, checkpoint_ids[1], threshold, [
        ((fastpath.Step(action.pk, action.seq, action.kind, A.FAILED), *row[1:]) if row[0].pk == action.pk else row)
        for row in rows]))
    return True


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
    """An action failed for good: unwind before the pivot, recovery queue after it; compensations alert and continue."""
    run = sql.get_locked(Run, action.run_id)
    if action.kind == ActionKind.COMPENSATION:
        forward = Action.objects.select_related("tool").get(pk=action.compensates_id)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=actor,
                          note={"error": action.error_message[:500]})
        events.emit("compensation_failed", action=action, forward=forward)
        if run.status == R.UNWINDING:
            runstate.enqueue_unwind_after(run)
        return
    if run.status in (R.UNWINDING, R.NEEDS_ATTENTION) or run.status in (R.COMPLETED, R.COMPENSATED, R.CLOSED):
        if run.status == R.UNWINDING:
            runstate.enqueue_unwind_after(run)
        return
    if run.pivot_committed:
        runstate.needs_attention(run, "step_failed", f"{action.tool.name} (step {action.seq}) failed after the pivot and "
                        f"{action.attempts} attempt(s): {action.error_message}. The run only moves forward from here.",
                        action=action, log=log)
    else:
        runstate.start_unwind(run, f"{action.tool.name} (step {action.seq}) failed: {action.error_message}", log=log,
                              actor=actor, cause="failed", step=action)
