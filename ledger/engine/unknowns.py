"""One decision per run: what an operator who compensates a run says about its steps whose outcome is unknown.

Without it, compensating a run whose last step is `lost` undoes the earlier steps and brings the run straight back
to the queue for the unknown one, so a person decides twice. With it, the compensate decision carries the answer for
the unknown steps too, and the whole run is settled at once:

- `happened`: it did act, undo it with the rest (`lost → succeeded`, marked unverified, then compensated newest-first;
  an undo that cannot be built without the tool's answer is recorded and alerted like any failed compensation);
- `not_happened`: it did not act, nothing to undo (`lost → failed`);
- `mine`: the operator settles it by hand; the rest is compensated and the run is closed, naming who took it.
"""
from __future__ import annotations

from ledger.audit.chain import AuditLog
from ledger.errors import ValidationFailed
from ledger.models import Action, ActionKind, ActionStatus as A, Run
from ledger.engine.transitions import action_transition

CHOICES = {
    "happened": "it happened: undo it",
    "not_happened": "it did not happen",
    "mine": "leave it to me",
}
LEFT = "left to "  # the start of a lost step's decision_reason once a person took it over (`mine`)


def unknown_steps(run: Run):
    return run.actions.filter(kind=ActionKind.FORWARD, status=A.LOST).select_related("tool").order_by("seq")


def left_to_person(action: Action) -> bool:
    return action.status == A.LOST and action.decision_reason.startswith(LEFT)


def decide_unknown(run: Run, choice: str, *, actor: str, log: AuditLog) -> int:
    """Apply the operator's `choice` to every forward step of `run` whose outcome is unknown; how many there were."""
    if choice not in CHOICES:
        raise ValidationFailed(f"say what became of the step whose outcome is unknown: one of {', '.join(CHOICES)}",
                               field="unknown")
    steps = list(unknown_steps(run))
    for step in steps:
        note = {"decision": CHOICES[choice]}
        if choice == "happened":
            action_transition(step, A.SUCCEEDED, log=log, actor=actor, note=note, verification={
                "ok": False, "detail": f"its outcome was unknown; {actor} decided it happened"})
        elif choice == "not_happened":
            action_transition(step, A.FAILED, log=log, actor=actor, note=note, error_class="did_not_act",
                              error_message=f"its outcome was unknown; {actor} decided it did not act")
        else:
            Action.objects.filter(pk=step.pk, status=A.LOST).update(
                decision_reason=f"{LEFT}{actor} to settle by hand")
            log.record("forward.left_to_person", actor=actor, action=step, **note)
    return len(steps)
