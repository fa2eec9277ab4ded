"""Reading a step's target and reading a step back: snapshots, the tool's own record of an effect (`lookup`), and
what that record means for the step (acted, did not act, or cannot tell).
"""
from __future__ import annotations

from dataclasses import dataclass

from ledger.canonical import canonical, dumps as canonical_text
from ledger.db import mapping, received
from ledger.db.partitions import recent
from ledger.engine import attempts, failpoints
from ledger.executors import egress
from ledger.executors.call import ToolError, ToolOutcome, http_read, python_read, resolve_url
from ledger.models import Action, Attempt, Tool


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
    return context(args=sent_args(action), result=action.result, before=action.before,
                   after=action.after if after is None else after, target=action.target_id,
                   key=action.idempotency_key, intent=action.intent)


def context(*, args, result, before, after, target, key, intent) -> dict:
    """What `$args`, `$result`, `$before`, `$after`, `$target`, `$key` and `$intent` resolve to (`context_for` of a
    step, or of values in hand without building one)."""
    return {"args": args, "result": result, "before": before, "after": after, "target": target, "key": key,
            "intent": intent}


def target_from_result(tool: Tool, result) -> str:
    """The step's target as its result gives it (`target.from: result.…`); "" when the result does not give it."""
    if tool.target_from.startswith("result.") and isinstance(mapping.decoded(result), dict):
        try:
            value = mapping.resolve("$" + tool.target_from, {"result": result})
        except mapping.MappingError:
            return ""
        return "" if value is None else str(value)
    return ""


@dataclass(frozen=True)
class ReadBack:
    """What reading a step back found: its effect happened. `evidence` is the record as read (the tool's own record
    of the effect from its lookup, or the target's state that its verify rule matched); `result` is that record in
    the shape of the tool's answer (`lookup.result` maps it there; without one the record is taken as it is), which
    the agent receives and the compensation resolves `$result.…` from. `problem`: why it could not be shaped."""

    result: object
    evidence: object
    by: str  # "lookup" or "target"
    problem: str = ""


def shaped(action: Action, record) -> tuple[object, str]:
    """`record` in the shape of the tool's answer (its `lookup.result`, resolved with `$result` the record) and "";
    or, when that cannot be resolved, the record as it is and why."""
    template = action.tool.lookup.get("result")
    if template is None:
        return record, ""
    try:
        return mapping.resolve(template, {**context_for(action), "result": record}), ""
    except mapping.MappingError as error:
        return record, f"its lookup.result could not be resolved from the record: {error}"


def already_done(action: Action) -> ReadBack | None:
    """After an attempt whose outcome is unknown: did the effect happen? Read back, never guess.

    Returns what was read when it did, None when it did not. Raises ToolError when it cannot
    be told (the caller then treats the outcome as unknown).
    """
    tool = action.tool
    lookup = tool.lookup.get("read")
    failpoints.hit("settle_read_back")
    if lookup:
        if egress.is_url(lookup):
            url = resolve_url(lookup, key=action.tool_key, target=action.target_id)
            found = http_read(url=url, timeout=tool.timeout_seconds, tenant=tool.tenant.slug)
        else:
            found = python_read(path=lookup, target=action.tool_key, tenant=tool.tenant.slug)
        items = found.get("results", found) if isinstance(found, dict) else found
        if not items:
            return None
        record = items[0] if isinstance(items, list) else items
        result, problem = shaped(action, record)
        return ReadBack(result, evidence=record, by="lookup", problem=problem)
    if tool.verify.get("expect") and action.target_id:
        state = read_target(tool, action.target_id)
        expected = mapping.resolve(tool.verify["expect"], context_for(action, after=state))
        if isinstance(state, dict) and all(same_value(state.get(k), v) for k, v in expected.items()):
            result, problem = shaped(action, state)
            return ReadBack(result, evidence=state, by="target", problem=problem)
        return None
    raise ToolError("the tool declares no way to read it back: no lookup and no verify rule", transient=False)


def read_back_outcome(found: ReadBack) -> ToolOutcome:
    return ToolOutcome(result=found.result, read_back=found)


def read_back_pass(action: Action) -> bool:
    """This attempt is the one more pass `record_failure` gave a key-ignoring tool's last unanswered try, to read it
    back once it is over: it reads back, and does not send again (a reclaim after a lost worker does)."""
    previous = (Attempt.objects.filter(action=action, number__lt=action.attempts, started_at__gte=recent(action.created_at)).exclude(outcome="deferred")
                .order_by("-number").values_list("outcome", flat=True).first())
    return previous == UNANSWERED_LAST_TRY


# How the last of a key-ignoring tool's tries ends when it got no answer: the pass after it reads it back, only.
UNANSWERED_LAST_TRY = "unanswered_last_try"


def read_back_detail(action: Action, verification: dict) -> str:
    """What a person reads of a step found done by reading it back whose record is not a result Unwind can use."""
    plan = action.compensation_plan
    evidence = canonical_text(verification["read_back"]["evidence"])
    undo = (f" Its undo, {plan.get('tool')}, takes {canonical_text(plan.get('args', {}))}: complete those "
             f"arguments from the record on this item's page, then undo the step with them or keep them and resume."
             if attempts.compensable(action) else "")
    return (f"{action.tool.name} (step {action.seq}) did act: reading it back ({verification['read_back']['by']}) found "
            f"{evidence[:1500]}. But {verification['detail']}.{undo} Resume to accept it as done and go on, "
            f"or close the run.")
