"""The engine: call a claimed action's tool, record the outcome, retry, unwind, settle the run.

A step costs two commits on the fast path: the proposal inserts the action already claimed (status
running, with a lease), and the outcome commit records result, snapshots, verification and the
compensation plan together. Tool calls and snapshot reads always happen outside any transaction.
"""
from __future__ import annotations

import logging
import random
import time
import uuid
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from ledger import egress, events, failpoints, mapping, received, sql
from ledger.audit import AuditLog, ledger_transaction
from ledger.canonical import canonical, digest
from ledger.executors import (
    ToolError, ToolOutcome, http_call, http_read, mcp_call, python_call, python_read, resolve_url,
)
from ledger.models import (
    ActionClass, Action, ActionKind, ActionStatus as A, Attempt, Checkpoint, CompensationStrategy, Executor,
    OnRefusal, Run, RunStatus as R, SagaRole, Tool,
)
from ledger.policy import approvals_needed
from ledger.services.dispatch import HELD, enqueue, new_owner
from ledger.transitions import action_transition, run_transition

log = logging.getLogger("unwind.engine")

SYSTEM = "system:engine"
INLINE_RETRY_LIMIT = 2.0  # seconds: longer backoffs are scheduled, not slept through
PENDING = (A.PLANNED, A.APPROVED, A.AWAITING_APPROVAL, A.RETRY_SCHEDULED)
REFUSED = "refused"  # the error_class of a step the tool turned down and the agent was answered about


def lease_until(seconds: float | None = None):
    return timezone.now() + timedelta(seconds=seconds or settings.UNWIND_LEASE_SECONDS)


def queued_lease(tool: Tool):
    """The lease of an action claimed here but run by a worker task: the tool's timeout plus time in the queue."""
    return lease_until(tool.timeout_seconds + settings.UNWIND_LEASE_SECONDS)


def backoff_delay(tool: Tool, attempt: int) -> float:
    """Exponential backoff with full jitter, capped."""
    base = tool.backoff_seconds * (2 ** max(0, attempt - 1))
    return min(settings.UNWIND_MAX_BACKOFF, random.uniform(base / 2, base))


# --- reading targets -----------------------------------------------------------------------------

def read_target(tool: Tool, target_id: str) -> object:
    """The target's current state through the tool's snapshot reader, or None when it has none."""
    reader = tool.snapshot.get("read")
    if not reader or not target_id:
        return None
    if not egress.is_url(reader):
        return python_read(path=reader, target=target_id, tenant=tool.tenant.slug)
    return http_read(url=resolve_url(reader, target=target_id), timeout=tool.timeout_seconds, tenant=tool.tenant.slug)


def snapshot_fields(tool: Tool, state: object) -> object:
    fields = tool.snapshot.get("fields")
    if fields and isinstance(state, dict):
        return {name: state.get(name) for name in fields}
    return state


def sent_args(action: Action):
    """The args as the agent sent them (numbers as written, strings unnormalised): what its tool receives, and
    what `$args.…` in its compensation and verification resolves to. An action recorded before they were kept
    (or built in memory without them) has only the canonical form."""
    return received.loads(action.args_text) if action.args_text else action.args


def same_value(observed, expected) -> bool:
    """Equal as JSON values (500 and 500.0, composed and decomposed text): a tool may store either form."""
    try:
        return canonical(observed) == canonical(expected)
    except (TypeError, ValueError):
        return observed == expected


def context_for(action: Action, *, after=None) -> dict:
    return {
        "args": sent_args(action), "result": action.result, "before": action.before,
        "after": action.after if after is None else after, "target": action.target_id,
        "key": action.idempotency_key, "intent": action.intent,
    }


def target_from_result(tool: Tool, result) -> str:
    if tool.target_from.startswith("result.") and isinstance(mapping.decoded(result), dict):
        value = mapping.resolve("$" + tool.target_from, {"result": result})
        return "" if value is None else str(value)
    return ""


def already_done(action: Action) -> dict | None:
    """After an attempt whose outcome is unknown: did the effect happen? Read back, never guess.

    Returns the evidence (a result) when it did, None when it did not. Raises ToolError when it cannot
    be told (the caller then treats the outcome as unknown).
    """
    tool = action.tool
    lookup = tool.lookup.get("read")
    if lookup:
        if egress.is_url(lookup):
            url = resolve_url(lookup, key=action.tool_key, target=action.target_id)
            found = http_read(url=url, timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
        else:
            found = python_read(path=lookup, target=action.tool_key, tenant=tool.tenant.slug)
        items = found.get("results", found) if isinstance(found, dict) else found
        return {"recovered": True, "evidence": items[0] if isinstance(items, list) else items} if items else None
    if tool.verify.get("expect") and action.target_id:
        state = read_target(tool, action.target_id)
        expected = mapping.resolve(tool.verify["expect"], context_for(action, after=state))
        if isinstance(state, dict) and all(same_value(state.get(k), v) for k, v in expected.items()):
            return {"recovered": True, "evidence": state}
        return None
    raise ToolError("the tool declares no way to read it back: no lookup and no verify rule", transient=False)


# --- calling tools ---------------------------------------------------------------------------------

def call_tool(action: Action) -> ToolOutcome:
    tool = action.tool
    if tool.executor == Executor.HTTP:
        url = resolve_url(tool.endpoint, target=action.target_id)
        return http_call(url=url, args=sent_args(action), idempotency_key=action.tool_key,
                         timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    if tool.executor == Executor.PYTHON:
        return python_call(path=tool.endpoint, args=sent_args(action), idempotency_key=action.tool_key,
                           target=action.target_id or None, tenant=tool.tenant.slug)
    if tool.executor == Executor.MCP:
        return mcp_call(endpoint=tool.endpoint, args=sent_args(action), idempotency_key=action.tool_key,
                        timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
    raise ToolError("client-executed tools are run by the agent, which reports the outcome", transient=False)


def needs_read_back(action: Action) -> bool:
    """A retry or reclaim of a tool that ignores idempotency keys must first check it did not already act."""
    return action.attempts > 1 and not action.tool.honours_idempotency_key


def settles_at(action: Action):
    """When the previous attempt of a key-ignoring tool is surely over, or None when it already is.

    An attempt that got an answer (even a 5xx) is over: the server finished with it, so reading back now
    is reliable. One that got none (a read timeout, a dropped connection, a lost worker) may still be
    running at the server; reading back before it ends could miss its effect and send it again. It is
    over once twice the tool's timeout has passed since it started.
    """
    previous = (Attempt.objects.filter(action=action, number__lt=action.attempts).exclude(outcome="deferred")
                .order_by("-number").only("started_at", "outcome", "error_class").first())
    if previous is None or previous.error_class.startswith("http_"):
        return None
    until = previous.started_at + timedelta(seconds=2 * action.tool.timeout_seconds + 1)
    return until if until > timezone.now() else None


AMBIGUOUS_ATTEMPT = (Q(outcome="lost") | Q(error_class="transient")
                     | (Q(error_class__startswith="http_5") & ~Q(error_class="http_503")))


def an_attempt_may_have_acted(action: Action) -> bool:
    """Did any finished attempt end without telling whether the tool acted (no answer, a lost worker, a 5xx
    but 503)? Then a later clean refusal (a 429, say) does not prove the step never took effect."""
    return action.attempt_set.filter(finished_at__isnull=False).filter(AMBIGUOUS_ATTEMPT).exists()



def still_ours(action: Action, owner: str) -> bool:
    """Fencing before a call that cannot be deduplicated: the lease is still ours and has not run out (a thread
    starved past its lease must not send after the sweep has already handed the step to someone else)."""
    return Action.objects.filter(pk=action.pk, status=A.RUNNING, lease_owner=owner,
                                 lease_expires_at__gt=timezone.now()).exists()


def run_stopped(action: Action) -> bool:
    """The run was cancelled or is being unwound (or is over): a retry there must not call the tool again."""
    status, cancelled = Run.objects.values_list("status", "cancel_requested_at").get(pk=action.run_id)
    return bool(cancelled) or status not in (R.RUNNING, R.AWAITING_APPROVAL)


def resolve_without_calling(action: Action, *, owner: str) -> None:
    """In a stopped run, find out whether the earlier attempt acted, instead of trying again."""
    try:
        evidence = already_done(action)
    except ToolError as unreadable:
        record_unknown(action, ToolError(action.error_message or "no answer", transient=True),
                       why=unreadable.message, latency_ms=None, actor=SYSTEM)
        return
    if evidence is not None:
        record_success(action, ToolOutcome(result=evidence), latency_ms=None)
        return
    record_failure(action, ToolError("not tried again: the run stopped, and the earlier attempt did not act",
                                     transient=False), latency_ms=None, retry_inline=False, delay=0, owner=owner)


def last_call_unanswered(action: Action) -> bool:
    """The newest attempt that called the tool got no answer at all (a timeout, a dropped connection, a lost worker)."""
    previous = (Attempt.objects.filter(action=action, number__lt=action.attempts).exclude(outcome="deferred")
                .order_by("-number").only("outcome", "error_class").first())
    return previous is not None and not previous.error_class.startswith("http_")


def defer(action: Action, until, *, owner: str, actor: str = SYSTEM) -> None:
    """Put a claimed action back to wait until `until` (its retry is claimed again by the sweep)."""
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "deferred", latency_ms=None, log=audit)
        action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, where=Q(lease_owner=owner),
                          note={"why": "waiting for the earlier call to be over before reading it back"},
                          next_attempt_at=until, lease_owner="", lease_expires_at=None)


def execute(action_id: int, *, owner: str, budget: float | None = None, sole_owner: bool = False,
            on_compensated: Callable[[AuditLog, Run], None] | None = None, claimed: Action | None = None) -> Action:
    """Run a claimed action (status running, lease held by `owner`) to an outcome.

    Transient failures are retried inline while the backoff is short and the budget allows;
    otherwise the retry is scheduled for the sweeper. Returns the action as it ends here.
    `on_compensated` runs inside the transaction that records a compensation's success, with its log and the run
    as that transaction locked it (see `unwind`).
    `claimed` is the action as the caller's own claim left it (with its tool), which spares reading it again;
    it is used only with `sole_owner`, where nobody else can have moved it since.

    A queued task may be delivered twice (django-q2 delivers at least once), and both deliveries carry
    the same owner; so unless the caller created the lease itself and shares it with nobody
    (`sole_owner`: the API's fast path, the unwinder), the lease is first taken over with a conditional
    update under a name of this call's own. The second delivery finds it taken and does nothing. A held
    owner (see `new_owner`) is never in a queued task, so a delivery that carries one takes nothing over.
    """
    if not sole_owner:
        mine = f"{owner[:100]}{HELD}{uuid.uuid4().hex[:8]}"
        if HELD in owner or Action.objects.filter(
                pk=action_id, status=A.RUNNING, lease_owner=owner).update(lease_owner=mine) != 1:
            return Action.objects.select_related("tool").get(pk=action_id)
        owner = mine
    started = time.monotonic()
    action = claimed if sole_owner and claimed is not None and claimed.pk == action_id \
        else Action.objects.select_related("tool").get(pk=action_id)
    while True:
        if action.status != A.RUNNING or action.lease_owner != owner:
            return action
        stopped = action.kind == ActionKind.FORWARD and action.attempts > 1 and run_stopped(action)
        if needs_read_back(action) or stopped:
            until = settles_at(action)
            if until is not None:
                defer(action, until, owner=owner)
                return action
        if stopped:
            resolve_without_calling(action, owner=owner)
            return action
        if not action.tool.honours_idempotency_key and not still_ours(action, owner):
            return Action.objects.select_related("tool").get(pk=action.pk)
        t0 = time.monotonic()
        failpoints.hit("before_tool_call")
        try:
            if needs_read_back(action):
                evidence = already_done(action)
                if evidence is None and last_call_unanswered(action):
                    # It may still arrive: a tool that ignores keys is never sent again on a guess.
                    record_unknown(action, ToolError(action.error_message or "no answer", transient=True),
                                   why="an earlier call got no answer and the tool ignores idempotency keys, "
                                       "so sending again could act twice", latency_ms=None, actor=SYSTEM)
                    return action
                outcome = ToolOutcome(result=evidence) if evidence is not None else call_tool(action)
            else:
                outcome = call_tool(action)
        except ToolError as error:
            latency = (time.monotonic() - t0) * 1000
            delay = backoff_delay(action.tool, action.attempts)
            remaining = None if budget is None else budget - (time.monotonic() - started)
            inline = delay <= INLINE_RETRY_LIMIT and (remaining is None or delay < remaining)
            retried = record_failure(action, error, latency_ms=latency, retry_inline=inline, delay=delay, owner=owner)
            if retried and inline:
                time.sleep(delay)
                continue
            return action
        latency = (time.monotonic() - t0) * 1000
        failpoints.hit("after_tool_call")
        record_success(action, outcome, latency_ms=latency, on_compensated=on_compensated)
        return action


def record_success(action: Action, outcome: ToolOutcome, *, latency_ms: float | None, actor: str = SYSTEM,
                   on_compensated: Callable[[AuditLog, Run], None] | None = None) -> None:
    tool = action.tool
    result = outcome.result
    target_id = action.target_id or target_from_result(tool, result)
    after = None
    verification = None
    if action.kind == ActionKind.FORWARD and tool.snapshot.get("read") and target_id:
        try:
            after = snapshot_fields(tool, read_target(tool, target_id))
        except ToolError as error:
            verification = {"ok": False, "detail": f"could not read the target back: {error.message}"}
    if action.kind == ActionKind.FORWARD and tool.verify.get("expect") and verification is None:
        try:
            expected = mapping.resolve(tool.verify["expect"], {**context_for(action, after=after), "result": result, "target": target_id})
            observed = after if after is not None else result
            mismatched = {k: {"expected": v, "observed": (observed or {}).get(k)} for k, v in expected.items()
                          if not isinstance(observed, dict) or not same_value(observed.get(k), v)}
            verification = {"ok": not mismatched, "mismatched": mismatched} if mismatched else {"ok": True}
        except mapping.MappingError as error:
            verification = {"ok": False, "detail": str(error)}
    plan = dict(action.compensation_plan)
    if plan.get("strategy") not in (None, CompensationStrategy.NONE):
        preview_action = Action(args=action.args, result=result, before=action.before, after=after,
                                target_id=target_id, idempotency_key=action.idempotency_key, intent=action.intent)
        try:
            plan["args_preview"] = mapping.resolve(plan.get("args", {}), context_for(preview_action))
            plan.pop("error", None)
        except mapping.MappingError as error:
            plan["error"] = str(error)
    with ledger_transaction(action.tenant_id) as audit:
        run = sql.get_locked(Run, action.run_id)
        action_transition(action, A.SUCCEEDED, log=audit, actor=actor, result=result, after=after,
                          verification=verification, target_id=target_id, compensation_plan=plan,
                          lease_owner="", lease_expires_at=None, error_class="", error_message="")
        finish_attempt(action, "succeeded", latency_ms=latency_ms, log=audit)
        if action.kind == ActionKind.COMPENSATION:
            # The unwinder's claim loaded it, in memory since; a change behind it fails the conditional update.
            forward = action.compensates if Action.compensates.is_cached(action) else sql.get(Action, pk=action.compensates_id)
            action_transition(forward, A.COMPENSATED, log=audit, actor=actor)
            if run.status == R.UNWINDING:
                enqueue_unwind_after(run)
            if on_compensated is not None:
                on_compensated(audit, run)
            return
        if action.saga_role == SagaRole.PIVOT and not run.pivot_committed:
            Run.objects.filter(pk=run.pk).update(pivot_committed=True)
            run.pivot_committed = True
            audit.record("run.pivot_committed", actor=actor, run=run, action=action)
            checkpoint_save(run, "pivot_committed", log=audit)
        if run.status in (R.UNWINDING,) or run.cancel_requested_at:
            # A late completion after a cancel or a failure elsewhere: it is compensated like the rest.
            if run.status == R.UNWINDING:
                enqueue_unwind_after(run)
            return
        if verification is not None and not verification.get("ok"):
            needs_attention(run, "verification_failed", f"{tool.name} (step {action.seq}) did not verify: "
                            f"{verification.get('detail') or verification.get('mismatched')}", action=action, log=audit)
            return
        if run.status == R.AWAITING_APPROVAL and not run.actions.filter(kind=ActionKind.FORWARD, status=A.AWAITING_APPROVAL).exists():
            run_transition(run, R.RUNNING, log=audit, actor=actor)


def record_failure(action: Action, error: ToolError, *, latency_ms: float | None, retry_inline: bool, delay: float,
                   owner: str, actor: str = SYSTEM) -> bool:
    """Record a failed attempt. Returns True when the action will be retried (inline or scheduled).

    When a step's last attempt ended in an error that leaves its effect unknown (a 5xx, a timeout), it is
    not called failed on faith: the tool is read back first. Found → it succeeded; not found → it failed;
    cannot be told → its outcome is unknown and a person is asked (guarantee 2: never "compensated" with
    an effect possibly still standing).
    """
    note = {"error_class": error.error_class, "error": error.message[:500]}
    final = not (error.transient and action.attempts < action.max_attempts)
    if final and error.maybe_applied and error.status is None and not action.tool.honours_idempotency_key \
            and action.attempts == action.max_attempts and (action.tool.lookup.get("read") or action.tool.verify):
        # No answer, and the call may still be running at the server: read it back once it must be over,
        # in one more pass (the read-back comes first there), rather than now.
        with ledger_transaction(action.tenant_id) as audit:
            finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error, log=audit)
            action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                              next_attempt_at=timezone.now() + timedelta(seconds=action.tool.timeout_seconds + 1),
                              max_attempts=action.attempts + 1, lease_owner="", lease_expires_at=None,
                              error_class=error.error_class, error_message=error.message[:2000])
        return True
    if final and action.kind == ActionKind.FORWARD and (error.maybe_applied or an_attempt_may_have_acted(action)):
        try:
            evidence = already_done(action)
        except ToolError as unreadable:
            record_unknown(action, error, why=unreadable.message, latency_ms=latency_ms, actor=actor)
            return False
        if evidence is not None:
            finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error)
            record_success(action, ToolOutcome(result=evidence), latency_ms=None, actor=actor)
            return False
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "failed_transient" if error.transient else "failed_permanent", latency_ms=latency_ms,
                       error=error, log=audit)
        if error.transient and action.attempts < action.max_attempts:
            if retry_inline:
                action_transition(action, A.RUNNING, log=audit, actor=actor, note=note, where=Q(lease_owner=owner),
                                  attempts=action.attempts + 1, lease_expires_at=lease_until(action.tool.timeout_seconds + delay),
                                  error_class=error.error_class, error_message=error.message[:2000])
                start_attempt(action, owner, log=audit)
            else:
                action_transition(action, A.RETRY_SCHEDULED, log=audit, actor=actor, note=note,
                                  next_attempt_at=timezone.now() + timedelta(seconds=delay), lease_owner="",
                                  lease_expires_at=None, error_class=error.error_class, error_message=error.message[:2000])
            return True
        if answers_refusal(action, error):
            action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="",
                              lease_expires_at=None, error_class=REFUSED, error_message=error.message[:2000])
            after_refusal(action, error, log=audit, actor=actor)
            return False
        action_transition(action, A.FAILED, log=audit, actor=actor, note=note, lease_owner="", lease_expires_at=None,
                          error_class=error.error_class, error_message=error.message[:2000])
        after_failure(action, log=audit, actor=actor)
    return False


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
        enqueue_unwind_after(run)


def record_unknown(action: Action, error: ToolError, *, why: str, latency_ms: float | None, actor: str) -> None:
    """The step may or may not have acted, and nothing can tell: mark it lost and put the run before a person."""
    detail = (f"{action.tool.name} (step {action.seq}) answered {error.message} on its last attempt, so it may have "
              f"acted, and it cannot be read back ({why}). Check the target, then resume, compensate or close.")
    with ledger_transaction(action.tenant_id) as audit:
        finish_attempt(action, "failed_transient", latency_ms=latency_ms, error=error, log=audit)
        action_transition(action, A.LOST, log=audit, actor=actor, note={"error": error.message[:500]},
                          lease_owner="", lease_expires_at=None, error_class="outcome_unknown",
                          error_message=detail[:2000])
        run = sql.get_locked(Run, action.run_id)
        if run.status in (R.RUNNING, R.AWAITING_APPROVAL):
            needs_attention(run, "outcome_unknown", detail, action=action, log=audit)
        elif run.status == R.UNWINDING:
            enqueue_unwind_after(run)


def after_failure(action: Action, *, log: AuditLog, actor: str) -> None:
    """An action failed for good: unwind before the pivot, recovery queue after it; compensations alert and continue."""
    run = sql.get_locked(Run, action.run_id)
    if action.kind == ActionKind.COMPENSATION:
        forward = Action.objects.select_related("tool").get(pk=action.compensates_id)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=actor,
                          note={"error": action.error_message[:500]})
        events.emit("compensation_failed", action=action, forward=forward)
        if run.status == R.UNWINDING:
            enqueue_unwind_after(run)
        return
    if run.status in (R.UNWINDING, R.NEEDS_ATTENTION) or run.status in (R.COMPLETED, R.COMPENSATED, R.CLOSED):
        if run.status == R.UNWINDING:
            enqueue_unwind_after(run)
        return
    if run.pivot_committed:
        needs_attention(run, "step_failed", f"{action.tool.name} (step {action.seq}) failed after the pivot and "
                        f"{action.attempts} attempt(s): {action.error_message}. The run only moves forward from here.",
                        action=action, log=log)
    else:
        start_unwind(run, f"{action.tool.name} (step {action.seq}) failed: {action.error_message}", log=log, actor=actor)


_TENANT_THRESHOLD = "(SELECT approval_threshold FROM ledger_tenant WHERE ledger_tenant.id = ledger_run.tenant_id)"
_DEFAULTS_VERSION = ("(SELECT COALESCE(MAX(version), 0) FROM ledger_tenantpolicyversion"
                     " WHERE ledger_tenantpolicyversion.tenant_id = ledger_run.tenant_id)")


def take_seq(run_id: int) -> tuple[Run, str, int]:
    """Lock the run and take its next step number (the returned run's `next_seq - 1`), in one statement, reading
    the tenant's approval threshold and the version of its defaults as they stand now with it. A rolled-back
    transaction gives the number back."""
    run, (threshold, defaults_version) = sql.increment(Run, run_id, "next_seq",
                                                       also=(_TENANT_THRESHOLD, _DEFAULTS_VERSION))
    if run is None:
        raise Run.DoesNotExist(f"run {run_id} does not exist")
    return run, threshold, defaults_version


def start_attempt(action: Action, owner: str, *, log: AuditLog | None = None) -> None:
    """Open the action's current attempt; with `log`, as part of that transaction's commit (nothing reads it before)."""
    statement = sql.insert_statement(Attempt(action=action, number=action.attempts, worker=owner[:120],
                                             started_at=timezone.now()))
    _write(statement, log)


def finish_attempt(action: Action, outcome: str, *, latency_ms: float | None, error: ToolError | None = None,
                   log: AuditLog | None = None) -> None:
    """Close the action's current attempt, if still open; with `log`, as part of that transaction's commit."""
    statement = sql.update_statement(
        Attempt, {"action": action.pk, "number": action.attempts, "finished_at": None},
        finished_at=timezone.now(), outcome=outcome, latency_ms=latency_ms,
        error_class=error.error_class if error else "", error_message=error.message[:2000] if error else "")
    _write(statement, log)


def _write(statement: tuple[str, list], log: AuditLog | None) -> None:
    if log is not None:
        log.write_at_commit(statement)
    else:
        sql.execute(*statement)


# --- run-level decisions ----------------------------------------------------------------------------

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
    actions = [dict(zip(("id", "seq", "status", "tool__name"), row)) for row in run_steps(run.pk)]
    completed = [a["id"] for a in actions if a["status"] in (A.SUCCEEDED, A.COMPENSATED)]
    pending = [a["id"] for a in actions if a["status"] in (*PENDING, A.RUNNING, A.FAILED, A.LOST)]
    summary = ", ".join(f"{a['tool__name']} {a['status'].replace('_', ' ')}" for a in actions) or "no actions yet"
    mode = {R.UNWINDING: "compensate", R.NEEDS_ATTENTION: "resume_or_compensate",
            R.AWAITING_APPROVAL: "await_approval"}.get(run.status, "resume")
    checkpoint = sql.insert(Checkpoint(tenant_id=run.tenant_id, run=run, label=label, state={
        "run_status": run.status, "pivot_committed": run.pivot_committed,
        "completed_action_ids": completed, "pending_action_ids": pending,
        "awaiting_approval_ids": [a["id"] for a in actions if a["status"] == A.AWAITING_APPROVAL],
        "recovery_mode": mode, "summary": summary,
    }))
    log.record("run.checkpoint", actor=SYSTEM, run=run, label=label, checkpoint=checkpoint.pk)
    return checkpoint


def needs_attention(run: Run, reason: str, detail: str, *, action: Action | None, log: AuditLog, actor: str = SYSTEM) -> None:
    run_transition(run, R.NEEDS_ATTENTION, log=log, actor=actor, note={"reason": reason},
                   attention_reason=reason, attention_detail=detail[:4000], lease_expires_at=None)
    checkpoint_save(run, f"needs_attention:{reason}", log=log)
    events.emit("run_needs_attention", run=run, reason=reason, detail=detail, action=action)


def skip_pending(run: Run, *, log: AuditLog, actor: str, why: str, forward_only: bool = False) -> None:
    """Skip what has not started. An unwind skips only forward steps: its own compensations may be waiting
    for approval and must still run."""
    if not run_steps(run.pk, statuses=list(PENDING), forward_only=forward_only):
        return  # the common case, told by one narrow query
    pending_actions = run.actions.filter(status__in=PENDING).select_related("tool")
    if forward_only:
        pending_actions = pending_actions.filter(kind=ActionKind.FORWARD)
    for pending in pending_actions:
        if pending.status == A.RETRY_SCHEDULED and pending.kind == ActionKind.FORWARD and an_attempt_may_have_acted(pending):
            continue  # it may have acted: its retry finds out (reading back, never calling again) first
        was_waiting = pending.status == A.AWAITING_APPROVAL
        action_transition(pending, A.SKIPPED, log=log, actor=actor, note={"why": why}, lease_owner="",
                          lease_expires_at=None, next_attempt_at=None)
        if was_waiting:
            events.emit("approval_withdrawn", action=pending, reason=why)


def start_unwind(run: Run, why: str, *, log: AuditLog, actor: str) -> None:
    skip_pending(run, log=log, actor=actor, why=why, forward_only=True)
    run_transition(run, R.UNWINDING, log=log, actor=actor, note={"why": why[:500]}, attention_detail=why[:4000])
    checkpoint_save(run, "unwind_started", log=log)
    enqueue_unwind_after(run)


def enqueue_unwind_after(run: Run) -> None:
    """Queue an unwinder unless one holds the run's lease (it will see the new state itself)."""
    if run.lease_expires_at is None or run.lease_expires_at < timezone.now():
        enqueue("ledger.tasks.unwind_run", run.pk)


# --- unwinding ----------------------------------------------------------------------------------------

def compensable(action: Action) -> bool:
    return action.compensation_plan.get("strategy") not in (None, "", CompensationStrategy.NONE)


def unwind(run_id: int, *, budget: float | None = None) -> Run:
    """Compensate the run's succeeded actions newest-first, then settle it. Safe to call any number of times.

    Holds the run's lease while it works, so one unwinder at a time; a crashed unwinder's lease
    expires and the sweeper starts another, which picks up exactly where the ledger says.

    A compensation costs one commit, not two: the commit that records one compensation's outcome also
    claims the next one (or settles the run), so every compensation is still recorded, with its lease,
    before its tool is called.
    """
    owner = new_owner(held=True)
    started = time.monotonic()
    tenant_id = Run.objects.values_list("tenant_id", flat=True).get(pk=run_id)

    def within_budget() -> bool:
        return budget is None or time.monotonic() - started <= budget

    def following() -> Action | None:
        if not within_budget():
            enqueue("ledger.tasks.unwind_run", run_id)
            return None
        return next_compensation(run_id, tenant_id=tenant_id, owner=owner)

    claimed, compensation = claim_unwind(run_id, tenant_id=tenant_id, owner=owner)
    if not claimed:
        return Run.objects.get(pk=run_id)
    try:
        while compensation is not None:
            failpoints.hit("mid_unwind")
            if compensation.tool.executor == Executor.CLIENT:
                break  # the agent runs it and reports; its report continues the unwind
            if drift_detected(compensation):
                compensation = following()
                continue
            chained: list[Action | None] = []

            def claim_next_in_same_commit(log: AuditLog, run: Run) -> None:
                if within_budget():
                    chained.append(claim_next_compensation(run_id, owner=owner, log=log, run=run))

            execute(compensation.pk, owner=owner, sole_owner=True, on_compensated=claim_next_in_same_commit,
                    claimed=compensation,
                    budget=None if budget is None else max(0.0, budget - (time.monotonic() - started)))
            if chained:
                compensation = chained[0]
                continue
            compensation.refresh_from_db(fields=["status"])
            if compensation.status != A.SUCCEEDED and compensation.status != A.FAILED:
                break  # scheduled for a later retry; its completion continues the unwind
            compensation = following()
    finally:
        # Settling already cleared the lease; only a run left unwinding still holds it.
        Run.objects.filter(pk=run_id, lease_expires_at__isnull=False).update(lease_expires_at=None)
    return Run.objects.get(pk=run_id)


def claim_unwind(run_id: int, *, tenant_id: int, owner: str) -> tuple[bool, Action | None]:
    """Take the run's unwind lease and claim its first compensation in one commit.

    Returns (False, None) when another unwinder holds the lease or the run is not unwinding.
    """
    with ledger_transaction(tenant_id) as audit:
        claimed = Run.objects.filter(pk=run_id, status=R.UNWINDING).filter(
            Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=timezone.now())
        ).update(lease_expires_at=lease_until())
        if claimed != 1:
            return False, None
        return True, claim_next_compensation(run_id, owner=owner, log=audit)


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
    steps = run_steps(run.pk)
    if any(status in PENDING for _, _, status, _ in steps):
        skip_pending(run, log=log, actor=SYSTEM, why="the run is being unwound", forward_only=True)
        steps = run_steps(run.pk)
    steps = [step for step in steps if step[2] in (A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED, A.COMPENSATING)]
    if any(status in (A.RUNNING, A.RETRY_SCHEDULED) for _, _, status, _ in steps):
        return None  # a step in flight, or one that may have acted; when it lands it re-enqueues the unwind
    candidate, tool_name = None, ""
    for action_id, _, _, tool_name in reversed(steps):  # newest first; usually the newest is the one
        step = sql.get(Action, pk=action_id)
        if compensable(step):
            candidate = step
            break
    if candidate is None:
        settle(run, log=log)
        return None
    if candidate.status == A.COMPENSATING:
        compensation = candidate.compensations.select_related("tool").order_by("-id").first()
        if compensation is None or compensation.status in (A.REJECTED, A.EXPIRED):
            return plan_compensation(run, candidate, tool_name, owner=owner, log=log)
        if compensation.status in (A.FAILED, A.APPROVED):
            retry = compensation.status == A.FAILED
            action_transition(compensation, A.RUNNING, log=log, actor=SYSTEM, attempts=compensation.attempts + 1,
                              max_attempts=compensation.attempts + compensation.tool.max_attempts if retry
                              else compensation.max_attempts,
                              lease_owner=owner, lease_expires_at=lease_until(compensation.tool.timeout_seconds))
            start_attempt(compensation, owner, log=log)
            return compensation
        return None  # awaiting approval, running elsewhere, waiting for a retry or for the agent's report
    return plan_compensation(run, candidate, tool_name, owner=owner, log=log)


def compensation_tool(run: Run, plan: dict) -> Tool | None:
    """The version of the compensation's tool bound when the forward step was proposed (`tool_id` in its plan),
    so an undo runs with the policy the step was taken under. A plan without one (recorded before tool versions,
    or whose client-executed twin was not registered then) takes the current version of the named tool."""
    if isinstance(plan.get("tool_id"), int):
        return sql.get(Tool, pk=plan["tool_id"], tenant=run.tenant_id)
    if isinstance(plan.get("tool"), str):
        return sql.get(Tool, tenant=run.tenant_id, name=plan["tool"], is_current=True)
    return None


def plan_compensation(run: Run, forward: Action, forward_tool: str, *, owner: str, log: AuditLog) -> Action | None:
    """Create the compensation action for `forward` (a call of the tool named `forward_tool`), with its args
    resolved just in time."""
    plan = forward.compensation_plan
    tool = compensation_tool(run, plan)
    try:
        if tool is None:
            raise mapping.MappingError(f"compensation tool {plan.get('tool')!r} is not registered")
        args = mapping.resolve(plan.get("args", {}), context_for(forward))
    except mapping.MappingError as error:
        if forward.status == A.SUCCEEDED:
            action_transition(forward, A.COMPENSATING, log=log, actor=SYSTEM)
        action_transition(forward, A.COMPENSATION_FAILED, log=log, actor=SYSTEM, note={"error": str(error)})
        events.emit("compensation_failed", action=None, forward=forward)
        return None
    args_text = received.dumps(args)  # the values `$args.…` took, as the agent wrote them: what the tool receives
    args = canonical(args)
    taken, threshold, defaults_version = take_seq(run.pk)
    run.next_seq = taken.next_seq
    seq = run.next_seq - 1
    required = approvals_needed(rule=plan.get("approval", "threshold"), risk=plan.get("risk", forward.risk),
                                required=plan.get("approvals_required", 1), threshold=threshold)
    claim_now = not required and tool.executor != Executor.CLIENT
    # A forward step still `succeeded` has never had a compensation planned: no need to count them.
    earlier = 0 if forward.status == A.SUCCEEDED else forward.compensations.count()
    compensation = sql.insert(Action(
        tenant_id=run.tenant_id, run=run, seq=seq, kind=ActionKind.COMPENSATION, compensates=forward, tool=tool,
        saga_role=tool.saga_role, risk=plan.get("risk", forward.risk), args=args, args_text=args_text,
        args_hash=digest(args),
        target_type=forward.target_type, target_id=forward.target_id,
        idempotency_key=f"{forward.idempotency_key}:undo" + (f":{earlier + 1}" if earlier else ""),
        key_source="compensation",
        status=A.AWAITING_APPROVAL if required else A.RUNNING, approvals_required=required,
        defaults_version=defaults_version, attempts=0 if required else 1, max_attempts=tool.max_attempts,
        lease_owner=owner if claim_now else "",
        lease_expires_at=lease_until(tool.timeout_seconds) if not required else None,
        intent={"goal": f"undo step {forward.seq} ({forward_tool})", "strategy": plan.get("strategy")},
        compensation_plan={"strategy": CompensationStrategy.NONE, "force": bool(plan.get("force"))},
    ))
    log.record("compensation.proposed", actor=SYSTEM, action=compensation, compensates=forward.pk,
               strategy=plan.get("strategy"))
    if forward.status == A.SUCCEEDED:
        action_transition(forward, A.COMPENSATING, log=log, actor=SYSTEM, note={"compensation": compensation.pk})
    if required:
        events.emit("approval_required", action=compensation, requested_by=SYSTEM)
        return None
    if claim_now:
        start_attempt(compensation, owner, log=log)
    return compensation if claim_now else None


def drift_detected(compensation: Action) -> bool:
    """Guarantee 7: before a snapshot restore, compare the target now with the after-snapshot.

    If someone changed it since, do not overwrite: fail the compensation as `drift` and let the run
    go to the recovery queue. An operator may force it (`force` on the plan).
    """
    # The unwinder planned or picked this compensation from its forward step a moment ago, in the same
    # transaction: the forward step is already in memory (its plan and after-snapshot no longer change).
    forward = compensation.compensates
    if forward.compensation_plan.get("strategy") != CompensationStrategy.SNAPSHOT or compensation.compensation_plan.get("force"):
        return False
    try:
        current = snapshot_fields(forward.tool, read_target(forward.tool, forward.target_id))
    except ToolError as error:
        record_failure(compensation, ToolError(f"drift check could not read the target: {error.message}",
                                               transient=error.transient, status=error.status),
                       latency_ms=None, retry_inline=False, delay=backoff_delay(compensation.tool, compensation.attempts),
                       owner=compensation.lease_owner)
        return True
    if current == forward.after:
        return False
    changed = sorted(k for k in (current or {}) if (forward.after or {}).get(k) != (current or {}).get(k)) \
        if isinstance(current, dict) else ["state"]
    error = ToolError(f"{forward.target_type or 'target'} {forward.target_id} changed since step {forward.seq} "
                      f"({', '.join(changed)}); not overwriting someone else's change", transient=False)
    error_class = "drift"
    with ledger_transaction(compensation.tenant_id) as audit:
        finish_attempt(compensation, "drift", latency_ms=None, error=error, log=audit)
        action_transition(compensation, A.FAILED, log=audit, actor=SYSTEM, note={"current": current},
                          lease_owner="", lease_expires_at=None, error_class=error_class, error_message=error.message)
        after_failure(compensation, log=audit, actor=SYSTEM)
    return True


def settle(run: Run, *, log: AuditLog) -> None:
    """Nothing is left to compensate: the run is compensated, or a person must look at what remains."""
    actions = list(run.actions.select_related("tool").order_by("seq"))
    failed = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.COMPENSATION_FAILED]
    standing = [a for a in actions if a.kind == ActionKind.FORWARD and a.status == A.SUCCEEDED
                and a.tool.action_class != ActionClass.READ_ONLY and not compensable(a)]
    lost = [a for a in actions if a.status == A.LOST]
    if not failed and not standing and not lost:
        run_transition(run, R.COMPENSATED, log=log, actor=SYSTEM, lease_expires_at=None)
        checkpoint_save(run, "compensated", log=log)
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
    lost_reason = "outcome_unknown" if any(a.error_class == "outcome_unknown" for a in lost) else "lease_lost"
    reason = "drift" if drift else "compensation_failed" if failed else lost_reason if lost else "irreversible_effects"
    first = (drift or failed or lost or standing)[0]
    needs_attention(run, reason, "; ".join(parts), action=first, log=log)
