"""Proposing a step: the agent's arguments checked against the tool's policy, the target and keys derived, a
replay found by key or by content, the ordering law and the approval rule applied, and the action recorded (claimed
for its caller, queued for a worker, or waiting for a person), on PostgreSQL in one call of `unwind_propose`.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError

from ledger import events, tracing
from ledger.audit.chain import ledger_transaction
from ledger.canonical import digest, storable
from ledger.db import received, sql
from ledger.engine import attempts, decision, fastpath, holds, readback, runstate, runsteps
from ledger.engine.dispatch import new_owner
from ledger.engine.transitions import run_transition
from ledger.errors import (
    IdempotencyMismatch, RepeatMismatch, RunCancelled, RunNotActive, SameContentInFlight, StateConflict, StillInFlight,
    TargetMismatch, TargetNotFound, TargetUnreadable, TooManyOpenApprovals, UnknownTool, UnwindError, ValidationFailed,
)
from ledger.executors.call import ToolError
from ledger.models import Action, ActionClass, ActionKind, ActionStatus as A, Executor, Run, RunStatus as R, Tool
from ledger.policy import limits as tool_limits, schemas
from ledger.policy.law import approvals_needed, check_not_after_held, check_order
from ledger.policy.tool_entry import TARGET_FROM_AGENT
from ledger.engine.runsteps import CONTENT_IN_FLIGHT, CONTENT_MATCHES

IN_FLIGHT = (A.PLANNED, A.APPROVED, A.RUNNING, A.RETRY_SCHEDULED, A.HELD)


MAX_KEY_LENGTH = 255


@dataclass
class Proposal:
    action: Action
    replayed: bool
    owner: str = ""
    matched_by: str = ""  # for a replay: "key" (the Idempotency-Key, sent or derived) or "content"

    @property
    def claimed(self) -> bool:
        """The proposal inserted the action already running, for the caller to execute now."""
        return bool(self.owner) and not self.replayed


def validate_args(tool: Tool, args) -> dict:
    """The canonical form of valid args (numbers that remember their literal validate as the numbers they are)."""
    if not isinstance(args, dict):
        raise ValidationFailed(f"args must be a JSON object, not {type(args).__name__}", field="args")
    errors = schemas.errors(tool.args_schema or {}, args)
    if errors:
        problems = [{"field": ".".join(["args", *map(str, e.absolute_path)]), "message": e.message} for e in errors]
        first = problems[0]
        raise ValidationFailed(f"{first['field']}: {first['message']}", field=first["field"], errors=problems)
    return storable(args, field="args")


def target_of(tool: Tool, args: dict, explicit: str | None) -> str:
    """The record the step acts on, which Unwind snapshots, verifies and restores: where the tool's policy derives it
    (`target.from: args.<name>` or `result.<name>`), the policy's, and an explicit `target` that differs is refused;
    the agent's own only where the policy says the agent names it (`target.from: agent`, confirmed by the tool's
    read before anything is recorded: `_propose`)."""
    sent = "" if explicit is None else str(explicit)
    where = tool.target_from
    if where == TARGET_FROM_AGENT:
        return sent[:200]
    derived = ""
    if where.startswith("args."):
        value = args
        for part in where.split(".")[1:]:
            value = value.get(part) if isinstance(value, dict) else None
        derived = "" if value is None else str(value)[:200]
    if sent and sent != derived:
        what = tool.target_type or "target"
        if where.startswith("args."):
            why = f"{tool.name} acts on the {what} its {where} names, {derived!r}" if derived else \
                f"{tool.name} acts on the {what} its {where} names, and this call has none"
        elif where.startswith("result."):
            why = f"{tool.name}'s {what} is the one its call creates ({where})"
        else:
            why = f"{tool.name}'s policy does not let the agent name a {what}"
        raise TargetMismatch(f"target {sent!r} was sent, but {why}: send the call without target (or with that one); "
                             f"nothing was done", field="target", sent=sent, derived=derived, target_from=where)
    return derived


def key_material(tool: Tool, args: dict):
    """What identifies the logical action among its args: the tool's `key_fields` when declared, else all of them."""
    return {name: args.get(name) for name in tool.key_fields} if tool.key_fields else args


def derive_key(*, run: Run, tool: Tool, target_id: str, args: dict, repeat_of: int | None = None) -> str:
    """Guarantee 1's fallback: a key from the action's content, never from its position in the run. A declared
    repeat is another call than the one it repeats, and a retry of the repeat is the repeat again."""
    repeat = [{"repeat_of": repeat_of}] if repeat_of is not None else []
    return "uw-" + digest(run.tenant_id, run.pk, tool.name, target_id, key_material(tool, args), *repeat)


def content_key_of(*, tool: Tool, target_id: str, args: dict) -> str:
    """The digest a later proposal in the same run is matched on, whatever key it carries (see `_match_content`).

    A read-only tool has no effect to repeat, so reading again is never matched ("")."""
    if tool.action_class == ActionClass.READ_ONLY:
        return ""
    return digest(tool.name, target_id, key_material(tool, args))


def check_key(key: str) -> str:
    key = key.strip()
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise ValidationFailed(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable characters", field="Idempotency-Key")
    return key


def replay(existing: Action, *, run: Run, tool: Tool, args_hash: str, repeat_of: int | None = None) -> Proposal:
    # By name: a replay after a policy change is the same logical call, answered with what the first one got.
    if existing.run_id != run.pk or existing.tool.name != tool.name or existing.args_hash != args_hash:
        raise IdempotencyMismatch(
            f"key {existing.idempotency_key!r} was first used for {existing.tool.name} in run {existing.run_id} "
            f"with other arguments; use a new key for a different action",
            action_id=existing.pk)
    if repeat_of is not None and existing.repeat_of_id != repeat_of:
        raise IdempotencyMismatch(
            f"key {existing.idempotency_key!r} was first used for action {existing.pk}, not for a repeat of action "
            f"{repeat_of}; a repeat is a call of its own: send it with a new key (or none)", action_id=existing.pk)
    if existing.status in IN_FLIGHT:
        raise StillInFlight(f"action {existing.pk} with this key is still {existing.status}; wait for it or poll",
                            action_id=existing.pk)
    return Proposal(action=existing, replayed=True, matched_by="key")


class _SameContent(Exception):
    """A succeeded step of the run has the proposal's content: answer with it (after rolling back the step number)."""

    def __init__(self, action_id: int):
        super().__init__(action_id)
        self.action_id = action_id


def _match_content(steps: list[runsteps.Seen], content_key: str, repeat_of: int | None, run: Run) -> None:
    """One effect per logical action: refuse to record a step whose content the run already holds in a step that
    succeeded or is in flight (`runsteps.same_content`), unless the agent names that step in `repeat_of`. Decided
    from `steps` read with the run row locked (`take_seq`), so of two concurrent proposals with the same content
    only the first is recorded."""
    if repeat_of is not None:
        if not content_key:
            raise RepeatMismatch("a read-only call is never matched by content, so it repeats nothing; send it "
                                 "without repeat_of", repeat_of=repeat_of)
        if not any(s.pk == repeat_of and s.kind == ActionKind.FORWARD and s.content_key == content_key
                   and s.status in CONTENT_MATCHES for s in steps):
            raise RepeatMismatch(_why_not_a_repeat(run, content_key, repeat_of), repeat_of=repeat_of)
        return
    found = runsteps.same_content(steps, content_key)
    if found is None:
        return
    if found.status in CONTENT_IN_FLIGHT:
        raise SameContentInFlight(
            f"action {found.pk} of this run has the same content (tool, target, arguments) and is still "
            f"{found.status.replace('_', ' ')}; wait for it (or poll it) instead of sending it again. To do it twice "
            f"on purpose, send \"repeat_of\": {found.pk}", action_id=found.pk, matched_by="content")
    raise _SameContent(found.pk)


def _why_not_a_repeat(run: Run, content_key: str, repeat_of: int) -> str:
    """The refusal's sentence (only on the refusal path: one more read)."""
    named = Action.objects.filter(pk=repeat_of, run_id=run.pk, kind=ActionKind.FORWARD).values_list(
        "content_key", "status").first()
    if named is None:
        return f"repeat_of names action {repeat_of}, which is not a step of run {run.pk}"
    if named[0] != content_key:
        return (f"repeat_of names action {repeat_of}, whose content (tool, target, arguments) differs from this "
                f"call's; repeat_of is only for doing the same call again")
    return (f"action {repeat_of} is {named[1].replace('_', ' ')}: it neither succeeded nor is in flight, so this "
            f"call does not repeat it; send it without repeat_of")


def action_propose(
    *, run: Run, tool_name: str, args, actor: str, target: str | None = None, intent: dict | None = None,
    idempotency_key: str | None = None, inline: bool = False, queued: bool = False, repeat_of: int | None = None,
) -> Proposal:
    """Record a proposed tool call: validate, check policy and the ordering law, claim it or gate it.

    Returns the recorded action. When `claimed`, the action is already `running` with a lease owned
    by `owner`, and the caller executes it (`execution.execute`), inline or in a worker. `inline` says the
    caller runs it itself, now: its lease is then held, and no queued delivery can take it over. `queued` says the
    caller queues it for a worker: its lease then also covers the time in the queue (as after an approval).

    A proposal with the content of a step of the run that succeeded answers as its replay (`matched_by`
    "content"); one with the content of a step in flight is refused (`in_flight`); `repeat_of` names such a step
    to do the call again on purpose. The args are hashed and compared in their canonical form, and kept as
    received for the tool (`args_text`).
    """
    fast = isinstance(tool_name, str) and fastpath.usable(run.tenant_id)
    request = dict(run=run, tool_name=tool_name, args=args, actor=actor, target=target, intent=intent,
                   idempotency_key=idempotency_key, inline=inline, queued=queued, repeat_of=repeat_of)
    if fast and repeat_of is None:
        # PostgreSQL: the tool as this process kept it, checked by the one call that records the proposal; anything
        # but that plain case is decided again from the tool as it stands now.
        kept = fastpath.kept_tool(run.tenant_id, tool_name)
        if kept is not None:
            try:
                proposed = _propose(**request, fast=True, read=kept, plain_only=True)
            except UnwindError:
                proposed = None
            if proposed is not None:
                return proposed
            fastpath.forget_tool(run.tenant_id, tool_name)
    return _propose(**request, fast=fast, read=None, plain_only=False)


def _propose(*, run: Run, tool_name, args, actor: str, target, intent, idempotency_key, inline: bool, queued: bool,
             repeat_of, fast: bool, read: tuple | None, plain_only: bool) -> Proposal | None:
    """`action_propose`, from the tool `read` already (see `fastpath.kept_tool`) or read here. `plain_only`: None
    unless the one call records it, with nothing done (not even the target's before-snapshot read)."""
    # The current version: the action is bound to it for good (its executor, limits, compensation, approval).
    # On PostgreSQL the same read draws the action's id and the approval threshold for the one-call proposal.
    if fast:
        tool, new_id, threshold, twin = read or fastpath.current_tool(run.tenant_id, tool_name)
    else:
        tool = sql.get(Tool, tenant=run.tenant_id, name=tool_name, is_current=True) if isinstance(tool_name, str) else None
    if tool is None:
        raise UnknownTool(f"{tool_name!r} is not a registered tool of this tenant", field="tool")
    if repeat_of is not None and (isinstance(repeat_of, bool) or not isinstance(repeat_of, int)):
        raise ValidationFailed("repeat_of must be the id of an earlier action of this run", field="repeat_of")
    clean = validate_args(tool, args)
    args_text = received.dumps(args)
    args_hash = digest(clean)
    target_id = target_of(tool, clean, target)
    key = check_key(idempotency_key) if idempotency_key is not None else derive_key(
        run=run, tool=tool, target_id=target_id, args=clean, repeat_of=repeat_of)
    source = "header" if idempotency_key is not None else "derived"
    if Run.tenant.is_cached(run):
        tool.tenant = run.tenant  # the same row: its slug signs the tool call
    # A target the agent named is read first whatever the tool does: the tool's own read must find it.
    names_target = tool.target_from == TARGET_FROM_AGENT
    reads_before = bool(target_id and tool.snapshot.get("read") and (
        tool.action_class != ActionClass.READ_ONLY or names_target))
    if plain_only and reads_before:
        return None
    # A replay is answered before the target is read. The one-call proposal checks the key itself.
    checked = not fast or reads_before
    if checked:
        found = _replay_of_key(run=run, tool=tool, key=key, args_hash=args_hash, repeat_of=repeat_of)
        if found is not None:
            return found
    if intent is not None and not isinstance(intent, dict):
        raise ValidationFailed("intent must be an object with goal, reasoning, confidence, model", field="intent")
    intent = storable(intent or {}, field="intent")
    before = None
    if reads_before:
        try:
            state = readback.read_target(tool, target_id)
        except ToolError as error:
            what = f"could not read {tool.target_type or 'the target'} {target_id} before acting: {error.message}"
            if error.transient:  # nothing was recorded: the same request, sent again, starts afresh
                raise TargetUnreadable(f"{what}; nothing was done, send the same request again", retry_after=1) from None
            raise StateConflict(what) from None
        if names_target and state is None:
            raise TargetNotFound(f"{tool.target_type or 'target'} {target_id!r} was not found by {tool.name}'s own read; "
                                 f"nothing was done", field="target")
        before = readback.snapshot_fields(tool, state)
    content_key = content_key_of(tool=tool, target_id=target_id, args=clean)
    try:
        if fast and repeat_of is None:
            proposed = _propose_in_one_call(
                run=run, tool=tool, action_id=new_id, threshold=threshold, twin=twin, args=clean, args_text=args_text,
                args_hash=args_hash, target_id=target_id, key=key, source=source, intent=intent or {}, before=before,
                actor=actor, inline=inline, queued=queued, content_key=content_key)
            if proposed is not None or plain_only:
                return proposed
        if not checked:  # the call found something to look at closer: a replay first
            found = _replay_of_key(run=run, tool=tool, key=key, args_hash=args_hash, repeat_of=repeat_of)
            if found is not None:
                return found
        return _record(run=run, tool=tool, args=clean, args_text=args_text, args_hash=args_hash, target_id=target_id,
                       key=key, source=source, intent=intent or {}, before=before, actor=actor, inline=inline,
                       queued=queued, content_key=content_key, repeat_of=repeat_of)
    except _SameContent as match:
        return Proposal(action=Action.objects.select_related("tool").get(pk=match.action_id), replayed=True,
                        matched_by="content")
    except IntegrityError:
        if plain_only:
            return None
        # A concurrent request with the same key won the insert: answer as its duplicate.
        existing = Action.objects.select_related("tool").get(tenant_id=run.tenant_id, key_agent=run.agent_id or 0,
                                                             idempotency_key=key)
        return replay(existing, run=run, tool=tool, args_hash=args_hash, repeat_of=repeat_of)


def _replay_of_key(*, run: Run, tool: Tool, key: str, args_hash: str, repeat_of: int | None) -> Proposal | None:
    """The answer to a key already used (a replay, or a refusal), or None for a new key."""
    # A narrow look-up: most keys are new, and only a replay needs the recorded action itself. Agents are separated
    # like tenants: only the run's agent's keys are looked at, with those it used before keys were scoped by agent
    # (`key_agent` 0, in its own runs); another agent's key is unknown here, and taking it takes nothing from it.
    agent = run.agent_id or 0
    # Each scope is looked up on all three columns of the key's unique index: as one query with an OR, PostgreSQL
    # on statistics older than the table read every key of the tenant (0.6 ms at 4,000 actions, growing).
    existing = sql.fetch_one(
        "SELECT id FROM (SELECT a.id, a.key_agent FROM ledger_action a"
        " WHERE a.tenant_id = %s AND a.key_agent = %s AND a.idempotency_key = %s"
        " UNION ALL SELECT a.id, a.key_agent FROM ledger_action a"
        " WHERE a.tenant_id = %s AND a.key_agent = 0 AND a.idempotency_key = %s"
        " AND (SELECT coalesce(r.agent_id, 0) FROM ledger_run r WHERE r.id = a.run_id AND r.tenant_id = %s) = %s)"
        " keyed ORDER BY key_agent DESC LIMIT 1",
        [run.tenant_id, agent, key, run.tenant_id, key, run.tenant_id, agent])
    if existing is None:
        return None
    return replay(Action.objects.select_related("tool").get(pk=existing[0]), run=run, tool=tool, args_hash=args_hash,
                  repeat_of=repeat_of)


# The run statuses a step is proposed in (`_record` refuses the others, saying why), and the key scope of keys used
# before keys were scoped by agent, which `_replay_of_key` looks in too.
TAKES_STEPS = (R.RUNNING, R.AWAITING_APPROVAL)
LEGACY_KEY_AGENT = 0


def plain(run: Run, steps: list[runsteps.Seen], tool: Tool, content_key: str) -> bool:
    """Whether the proposal is the plain case the one-call writer records, decided from the run in hand and its
    `steps`: the run takes steps, no step has the same content, the ordering law finds no conflict and no step of the
    run is held (whether it must wait for one is `_record`'s to say). Anything else `_record` decides under locks."""
    return (run.status in TAKES_STEPS and not run.cancel_requested_at
            and runsteps.same_content(steps, content_key) is None and not runsteps.order_conflicts(steps, tool)
            and not runsteps.any_held(steps))


def _propose_in_one_call(*, run, tool, action_id, threshold, twin, args, args_text, args_hash, target_id, key, source, intent,
                         before, actor, inline, queued, content_key) -> Proposal | None:
    """PostgreSQL: decide, then write. Python decides the plain proposal (`plain`, the tool's rules and approval
    rule, no hold) from the run in hand and its steps (kept on it by the previous call, or read now with the run in
    one statement), and `fastpath.propose` writes it in one call under the guards it was decided with. A failed
    guard ('stale') is decided again once from a fresh read. None: nothing was recorded, and `_record` decides."""
    if holds.window(tool):
        return None
    steps = runsteps.kept(run)
    for _ in range(2):
        fresh = steps is None
        if fresh:
            read, steps = runsteps.run_with_steps(run.pk)
            if read is None:
                return None
            run.status, run.cancel_requested_at, run.next_seq = read.status, read.cancel_requested_at, read.next_seq
            runsteps.keep(run, steps)
        ruled = decision.in_one_call(tool=tool, run=run, args=args, threshold=threshold)
        if ruled is None or not plain(run, steps, tool, content_key):
            return None
        owner = new_owner(held=inline)
        action = decision.bind(_new_action(
            run=run, tool=tool, seq=0, defaults_version=0, args=args, args_text=args_text, args_hash=args_hash,
            content_key=content_key, repeat_of=None, target_id=target_id, key=key, source=source, required=0,
            owner=owner, inline=inline, queued=queued, before=before, intent=intent, twin=twin), ruled.decided)
        action.pk = action_id
        guards = fastpath.ProposeGuards(
            run_status=run.status, cancelled=bool(run.cancel_requested_at), step=run.next_seq,
            steps=runsteps.guard(steps), threshold=threshold, key_free_in=(LEGACY_KEY_AGENT,))
        outcome, used = fastpath.propose(
            action, guards=guards, owner=owner, actor=actor, event={"tool": tool.name, "key_source": source},
            limits=ruled.limits, counted=tool_limits.COUNTED)
        if outcome == "ok":
            ruled.counted(used)
            run.next_seq = action.seq + 1  # as the call left it: the caller's next proposal in this run reads it
            runsteps.keep(run, [*steps, runsteps.Seen(
                action.pk, action.seq, action.kind, action.status, content_key, action.saga_role, action.error_class,
                tool.name, tool.action_class)])
            action.tool = tool
            return Proposal(action=action, replayed=False, owner="" if tool.executor == Executor.CLIENT else owner)
        if outcome != "stale":
            return None  # nothing written, the steps as they were: `_record` decides (a replay, a limit, …)
        runsteps.keep(run, None)  # a guard failed: the next decision reads afresh
        if fresh:
            return None
        steps = None
    return None


def _new_action(*, run, tool, seq, defaults_version, args, args_text, args_hash, content_key, repeat_of, target_id, key,
                source, required, owner, inline, queued, before, intent, twin=None) -> Action:
    """The proposed forward step as it is recorded: gated (`required` approvals) or claimed by `owner`."""
    client = tool.executor == Executor.CLIENT
    lease = attempts.queued_lease(tool) if queued and not client else attempts.lease_until(
        tool.timeout_seconds if client else tool.timeout_seconds + 1)
    return Action(
        tenant_id=run.tenant_id, run=run, seq=seq, kind=ActionKind.FORWARD, tool=tool, saga_role=tool.saga_role,
        risk=tool.risk, args=args, args_text=args_text, args_hash=args_hash, content_key=content_key,
        repeat_of_id=repeat_of, target_type=tool.target_type, target_id=target_id,
        idempotency_key=key, key_agent=run.agent_id or 0, key_source=source,
        status=A.AWAITING_APPROVAL if required else A.RUNNING,
        approvals_required=required, defaults_version=defaults_version, attempts=0 if required else 1,
        max_attempts=tool.max_attempts, lease_owner=owner, lease_expires_at=None if required else lease,
        before=before, intent=intent, compensation_plan=compensation_plan_of(tool, run.tenant_id, twin=twin),
        trace_context=tracing.current_carrier() or None,
    )


def compensation_plan_of(tool: Tool, tenant_id: int, *, twin: tuple[int, int] | None = None) -> dict:
    """The tool's compensation, bound to the current version of its twin: undoing the step later runs that
    version (`unwinding.compensation_tool`), whatever the twin's policy has become by then. An inline twin is
    bound to the version written with this version of the tool (`twin_version`, services.tools._write_tools).
    `twin`: its (id, version), when read already with the tool (`fastpath.current_tool`)."""
    plan = dict(tool.compensation)
    if not isinstance(plan.get("tool"), str):
        return plan
    if twin is not None:
        plan["tool_id"], plan["tool_version"] = twin
        return plan
    if isinstance(plan.get("twin_version"), int):
        twin = sql.get(Tool, tenant=tenant_id, name=plan["tool"], version=plan["twin_version"])
    elif plan["tool"] == tool.name:
        twin = tool
    else:
        twin = sql.get(Tool, tenant=tenant_id, name=plan["tool"], is_current=True)
    if twin is not None:
        plan["tool_id"], plan["tool_version"] = twin.pk, twin.version
    return plan


def _record(*, run, tool, args, args_text, args_hash, target_id, key, source, intent, before, actor, inline, queued,
            content_key, repeat_of) -> Proposal:
    runsteps.keep(run, None)  # the caller's copy: what this writes is not in it
    with ledger_transaction(run.tenant_id) as audit:
        # Lock the run and take the next step number in one statement (a refusal below rolls the number back),
        # reading the tenant's approval threshold as it stands now with it.
        run, threshold, defaults_version = attempts.take_seq(run.pk)
        steps = runsteps.read(run.pk)  # what the content match and the ordering law decide from, under the lock
        if content_key or repeat_of is not None:
            _match_content(steps, content_key, repeat_of, run)
        if run.cancel_requested_at:
            raise RunCancelled(f"run {run.pk} was cancelled; it starts no new action")
        if run.status not in (R.RUNNING, R.AWAITING_APPROVAL):
            # Why it stopped, when it was unwound or put before a person (an agent that went idle learns it here).
            stopped = run.status in (R.UNWINDING, R.COMPENSATED, R.NEEDS_ATTENTION) and run.attention_detail
            why = f" ({run.attention_detail[:300]})" if stopped else ""
            raise RunNotActive(f"run {run.pk} is {run.status.replace('_', ' ')}{why}; it accepts no new actions",
                               run_status=run.status)
        check_order(runsteps.order_conflicts(steps, tool), tool=tool)
        check_not_after_held(runsteps.held_it_waits_for(steps, tool), tool=tool)
        # The tool's rules and limits (ledger/engine/decision.py), counted under the locks just taken.
        decided = decision.decide(tool=tool, run=run, args=args, threshold=threshold) if decision.applies(tool) else None
        required = decided.required if decided else approvals_needed(
            rule=tool.approval, risk=tool.risk, required=tool.approvals_required, threshold=threshold)
        if required:
            _check_open_approvals(run)
        denied = bool(decided and decided.denied)
        owner = "" if required or denied else new_owner(held=inline)
        client = tool.executor == Executor.CLIENT
        action = decision.bind(_new_action(
            run=run, tool=tool, seq=run.next_seq - 1, defaults_version=defaults_version, args=args,
            args_text=args_text, args_hash=args_hash, content_key=content_key, repeat_of=repeat_of,
            target_id=target_id, key=key, source=source, required=required, owner=owner, inline=inline,
            queued=queued, before=before, intent=intent), decided)
        held = not required and not denied and holds.hold_new(action, tool)
        if held:
            owner = ""
        action = sql.insert(action)
        action.tool = tool
        repeat = {"repeat_of": repeat_of} if repeat_of is not None else {}
        audit.record("forward.proposed", actor=actor, action=action, tool=tool.name, key_source=source, **repeat)
        if denied:
            decision.record_refusal(action, decided, log=audit, actor=actor, run=run)
        elif held:
            holds.announce(action, run, log=audit, actor=actor)
        elif required:
            if run.status == R.RUNNING:
                run_transition(run, R.AWAITING_APPROVAL, log=audit, actor=actor)
            runstate.checkpoint_save(run, "awaiting_approval", log=audit)
            events.emit("approval_required", action=action, requested_by=actor)
        else:
            attempts.start_attempt(action, owner, log=audit)
    if denied:
        raise decision.refusal(action, decided)
    return Proposal(action=action, replayed=False, owner="" if client else owner)


def _check_open_approvals(run: Run) -> None:
    """One agent cannot flood the people: a run, and an agent across its runs, have at most
    UNWIND_MAX_OPEN_APPROVALS_PER_RUN and _PER_AGENT forward steps waiting for approval. Counted under the tenant's
    chain lock (`ledger_transaction`, which every writer of the tenant takes first), so no two proposals both pass."""
    waiting = [A.AWAITING_APPROVAL, ActionKind.FORWARD]
    in_run = sql.fetch_one("SELECT count(*) FROM ledger_action WHERE run_id = %s AND status = %s AND kind = %s",
                           [run.pk, *waiting])[0]
    limit = settings.UNWIND_MAX_OPEN_APPROVALS_PER_RUN
    if in_run >= limit:
        raise TooManyOpenApprovals(
            f"run {run.pk} already has {in_run} steps waiting for approval (at most {limit} at once); nothing was "
            f"recorded: wait for people to decide, then propose again", scope="run", limit=limit, retry_after=60)
    if run.agent_id is None:
        return
    by_agent = sql.fetch_one(
        "SELECT count(*) FROM ledger_action a JOIN ledger_run r ON r.id = a.run_id WHERE r.tenant_id = %s"
        " AND r.agent_id = %s AND r.status = %s AND a.status = %s AND a.kind = %s",
        [run.tenant_id, run.agent_id, R.AWAITING_APPROVAL, *waiting])[0]
    limit = settings.UNWIND_MAX_OPEN_APPROVALS_PER_AGENT
    if by_agent >= limit:
        raise TooManyOpenApprovals(
            f"this agent already has {by_agent} steps waiting for approval across its runs (at most {limit} at "
            f"once); nothing was recorded: wait for people to decide, then propose again", scope="agent",
            limit=limit, retry_after=60)
