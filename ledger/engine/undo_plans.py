"""An undo a person completes: a step found done by reading it back, whose record lacks what its undo needs.

The read-back proved the effect (issue 32), but the compensation's arguments name parts of the step's result the
tool's record does not give (`$result.id`, say), so no undo can be put together from it and the step goes to a person
(`read_back_incomplete`). They see the record and complete the undo here: the arguments that could be resolved from
the step stay as the policy maps them (they are not the person's to change), the others are theirs to fill in,
and the whole is checked against the undo tool's JSON Schema, as an agent's arguments are. Recorded as their decision
in the audit chain, the completed arguments are what every later undo of the step uses (`unwinding.undo_args`).
"""
from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from ledger.audit import sealed
from ledger.db import mapping, sql
from ledger.engine import attempts, readback, unwinding
from ledger.audit.chain import ledger_transaction
from ledger.canonical import dumps as canonical_text
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import Action, ActionKind, ActionStatus as A, Run, RunStatus as R, Tool
from ledger.engine.proposal import validate_args


@dataclass(frozen=True)
class UndoDraft:
    """What a person completes: the undo tool (None when it is not registered), its arguments as the policy maps
    them (`template`), those resolved from the step (`fixed`), those that could not be (`missing`: each with why),
    and the whole as the form starts (`prefilled`: the fixed values, null for the missing)."""

    tool: Tool | None
    template: object
    fixed: dict
    missing: dict
    prefilled: dict


def undo_draft(step: Action) -> UndoDraft | None:
    """The undo of `step` to complete, or None when it has none (no compensation, or one that is not a twin tool)."""
    if step.kind != ActionKind.FORWARD or not attempts.compensable(step):
        return None
    plan = step.compensation_plan
    if not isinstance(plan.get("tool"), str):
        return None
    template = plan.get("args", {})
    context = readback.context_for(step)
    fixed, missing = {}, {}
    if isinstance(template, dict):
        for name, value in template.items():
            try:
                fixed[name] = mapping.resolve(value, context)
            except mapping.MappingError as error:
                missing[name] = str(error)
    else:
        missing[""] = "the undo's arguments as a whole come from the step's result"
    tool = unwinding.compensation_tool(step.run, plan)
    prefilled = {name: fixed.get(name) for name in template} if isinstance(template, dict) else {}
    return UndoDraft(tool=tool, template=template, fixed=fixed, missing=missing, prefilled=prefilled)


def undo_plan_check(step: Action, args) -> dict:
    """The completed arguments, in their canonical form, or a ValidationFailed saying what is wrong with them."""
    draft = undo_draft(step)
    if draft is None:
        raise StateConflict(f"step {step.seq} has no undo to complete")
    if draft.tool is None:
        raise StateConflict(f"the undo's tool {step.compensation_plan.get('tool')!r} is not registered")
    if not isinstance(args, dict):
        raise ValidationFailed(f"the undo's arguments must be a JSON object, not {type(args).__name__}", field="args")
    if isinstance(draft.template, dict) and (extra := [name for name in args if name not in draft.template]):
        raise ValidationFailed(f"args.{extra[0]} is not one of the undo's arguments ({', '.join(draft.template)}): the "
                               f"plan is completed, not extended", field=f"args.{extra[0]}")
    for name, value in draft.fixed.items():
        if name not in args or not readback.same_value(args[name], value):
            template = canonical_text(draft.template[name])
            raise ValidationFailed(
                f"args.{name} comes from the step ({template}, which is {canonical_text(value)}) and cannot be changed "
                f"here; fill in only what could not be resolved", field=f"args.{name}")
    return validate_args(draft.tool, args)


def undo_plan_complete(*, step: Action, args, actor: str, reason: str = "") -> Action:
    """Record `args` as the arguments of `step`'s undo, `actor`'s decision, while its run waits for a person.

    Checked under the locks: the run still needs attention, the step is still succeeded (not yet undone), and it is
    what its success recorded (`sealed.undo_seal_problem`): the completion seals the undo anew, which must not take
    in an edit made behind the services' back since."""
    with ledger_transaction(step.tenant_id) as audit:
        run = sql.get_locked(Run, step.run_id)
        if run.status != R.NEEDS_ATTENTION:
            raise StateConflict(f"run {run.pk} is {run.status.replace('_', ' ')}; its undo plans are no longer "
                                f"completed by hand")
        step = sql.get(Action, pk=step.pk)
        step.run = run
        if step.status != A.SUCCEEDED:
            raise StateConflict(f"step {step.seq} is {step.status.replace('_', ' ')}; only a step that stands can "
                                f"have its undo completed")
        try:
            recorded, seq = sealed.recorded_undo_seal(step)
            problem = sealed.undo_seal_problem(step, recorded, event=seq) if recorded is not None else ""
        except sealed.Tampered as tampered:
            problem = tampered.problem
        if problem:
            raise StateConflict(f"{problem}; its undo is not completed from it")
        clean = undo_plan_check(step, args)
        plan = {**step.compensation_plan, "completed_args": clean, "completed_by": actor, "args_preview": clean}
        plan.pop("error", None)
        if sql.update(Action, {"pk": step.pk, "status": A.SUCCEEDED}, compensation_plan=plan,
                      updated_at=timezone.now()) != 1:
            raise StateConflict(f"step {step.seq} moved while its undo was completed")
        step.compensation_plan = plan
        audit.record("compensation.plan_completed", actor=actor, action=step, args=clean, reason=reason[:1000])
    return step
