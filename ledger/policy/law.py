"""The rules a step is held to at run time: the approval rule and the saga ordering law (compensatable steps,
then at most one pivot, then retriable steps). The engine applies them; the PostgreSQL functions are handed their
results (docs/architecture.md, "Every rule and the one place it is decided").
"""
from __future__ import annotations

from ledger.errors import OrderingViolation, ValidationFailed
from ledger.models import RISK_ORDER, ActionClass, ApprovalRule, SagaRole, Tool


def approvals_needed(*, rule: str, risk: str, required: int, threshold: str) -> int:
    """How many distinct approvals an action needs before it runs (0 = none); `threshold` is the tenant's
    approval threshold (the lowest risk that needs a person under the threshold rule)."""
    if rule == ApprovalRule.AUTO:
        return 0
    if rule == ApprovalRule.MANUAL or RISK_ORDER[risk] >= RISK_ORDER[threshold]:
        return max(1, required)
    return 0


ROLE_RANK = {SagaRole.COMPENSATABLE: 0, SagaRole.PIVOT: 1, SagaRole.RETRIABLE: 2}


def roles_it_may_not_follow(tool: Tool) -> list[str]:
    """The ordering law, in the one place it is written: the saga roles of earlier steps `tool` may not follow.

    Compensatable steps first, then at most one pivot, then retriable steps; read-only tools change nothing and may
    come anywhere. `check_order` explains a refusal from it; `engine/runsteps.order_conflicts` finds the earlier step
    it names, on both paths. No SQL knows the law: the PostgreSQL proposal only checks that the run's steps are
    still those the law was applied to.
    """
    if tool.action_class == ActionClass.READ_ONLY:
        return []
    roles = [role for role, rank in ROLE_RANK.items() if rank > ROLE_RANK[tool.saga_role]]
    if tool.saga_role == SagaRole.PIVOT:
        roles.append(SagaRole.PIVOT)
    return roles


def held_roles_it_must_wait_for(tool: Tool) -> list[str]:
    """The saga roles of earlier steps that, while they are held (an undo window, engine/holds.py), `tool` may not
    be proposed after: those of an earlier rank. Until a held step has run it may still be stopped, and a stopped
    pivot, or a stopped step before it, unwinds the run: a later pivot or retriable step would already have acted
    and could not be undone. A step of the same rank (a compensatable after a compensatable, a retriable after a
    retriable) can wait its turn: stopping the earlier one undoes it too, or leaves the run to end without it."""
    if tool.action_class == ActionClass.READ_ONLY:
        return []
    return [role for role, rank in ROLE_RANK.items() if rank < ROLE_RANK[tool.saga_role]]


def check_not_after_held(held: list[tuple[int, str, str, str]], *, tool: Tool) -> None:
    """Refuse `tool` while an earlier step it must wait for (`held_roles_it_must_wait_for`) is held; `held` is
    (seq, tool, role, when it runs) of the run's held steps."""
    waits_for = held_roles_it_must_wait_for(tool)
    for seq, name, role, executes_at in held:
        if role in waits_for:
            raise OrderingViolation(
                f"{tool.name} is {tool.saga_role}, but {name} (step {seq}) is {role} and held until {executes_at}: "
                f"it may still be stopped, which would undo the run, so propose {tool.name} once step {seq} has run",
                rule="after_a_held_step", conflicts_with={"seq": seq, "tool": name, "executes_at": executes_at})


def check_order(earlier: list[tuple[int, str, str]], *, tool: Tool) -> None:
    """Refuse `tool` if it would break the ordering law after the run's `earlier` (seq, tool, role) steps, naming
    the first earlier step it may not follow (`roles_it_may_not_follow`) and the part of the law it breaks."""
    forbidden = roles_it_may_not_follow(tool)
    role = tool.saga_role
    for seq, name, other in earlier:
        if other not in forbidden:
            continue
        if other == SagaRole.PIVOT and role == SagaRole.PIVOT:
            raise OrderingViolation(
                f"{tool.name} is a pivot, but {name} (step {seq}) already is this run's pivot; a run has at most one",
                rule="one_pivot", conflicts_with={"seq": seq, "tool": name})
        rule = "compensatable_before_pivot" if role == SagaRole.COMPENSATABLE else "pivot_before_retriable"
        raise OrderingViolation(
            f"{tool.name} is {role}, but {name} (step {seq}) is {other}: compensatable steps come first, "
            f"then at most one pivot, then retriable steps",
            rule=rule, conflicts_with={"seq": seq, "tool": name})


def check_plan(plan: list[str], tools: dict[str, Tool]) -> None:
    """Check a declared plan (tool names in order) against the ordering law before anything runs."""
    earlier: list[tuple[int, str, str]] = []
    for index, name in enumerate(plan, start=1):
        tool = tools.get(name)
        if tool is None:
            raise ValidationFailed(f"plan[{index - 1}]: {name!r} is not a registered tool", field=f"plan[{index - 1}]")
        check_order(earlier, tool=tool)
        if tool.action_class != ActionClass.READ_ONLY:
            earlier.append((index, name, tool.saga_role))
