"""The saga strip: a run's shape at a glance, for the run page and the recovery item.

Each forward step is a box, in order, grouped by its saga role (compensatable steps, then the pivot, then the
retriable steps that only ever move forward). Beneath a step that can be undone sits the compensation that
undid it (or would); the strip is read left to right for what the agent did and right to left for what
Unwind undid. A marker says where the run stopped or waits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ledger.models import Action, ActionClass, ActionKind, ActionStatus, CompensationStrategy, Run, RunStatus, SagaRole

# (icon, words) per status: a box never says its state by colour alone.
STATUS_MARKS = {
    ActionStatus.PLANNED: ("○", "planned"), ActionStatus.AWAITING_APPROVAL: ("⏸", "awaiting approval"),
    ActionStatus.APPROVED: ("○", "approved"), ActionStatus.RUNNING: ("▶", "running"),
    ActionStatus.RETRY_SCHEDULED: ("↻", "retry scheduled"), ActionStatus.SUCCEEDED: ("✓", "succeeded"),
    ActionStatus.FAILED: ("✕", "failed"), ActionStatus.LOST: ("?", "outcome unknown"),
    ActionStatus.REJECTED: ("⊘", "rejected"), ActionStatus.EXPIRED: ("⊘", "expired"),
    ActionStatus.SKIPPED: ("–", "skipped"), ActionStatus.HELD: ("⏳", "held"),
    ActionStatus.COMPENSATING: ("↺", "compensating"),
    ActionStatus.COMPENSATED: ("↺", "compensated"), ActionStatus.COMPENSATION_FAILED: ("⚠", "compensation failed"),
}
# The legend lists these, in this order, with the same classes the boxes use.
LEGEND = [ActionStatus.SUCCEEDED, ActionStatus.AWAITING_APPROVAL, ActionStatus.RUNNING, ActionStatus.FAILED,
          ActionStatus.LOST, ActionStatus.REJECTED, ActionStatus.COMPENSATED, ActionStatus.COMPENSATION_FAILED,
          ActionStatus.SKIPPED]
ROLE_ORDER = [SagaRole.COMPENSATABLE, SagaRole.PIVOT, SagaRole.RETRIABLE]
ROLE_WORDS = {SagaRole.COMPENSATABLE: "compensatable: undone if the run fails",
              SagaRole.PIVOT: "pivot: the point of no return",
              SagaRole.RETRIABLE: "retriable: only moves forward"}
# A step where the run rests: the first of these (after the recovery item's own step) gets the marker.
UNSETTLED = {ActionStatus.FAILED, ActionStatus.LOST, ActionStatus.REJECTED, ActionStatus.EXPIRED,
             ActionStatus.COMPENSATION_FAILED, ActionStatus.AWAITING_APPROVAL, ActionStatus.RUNNING,
             ActionStatus.RETRY_SCHEDULED, ActionStatus.PLANNED, ActionStatus.APPROVED, ActionStatus.COMPENSATING,
             ActionStatus.HELD}
RESTING = {RunStatus.NEEDS_ATTENTION, RunStatus.COMPENSATED, RunStatus.CLOSED}


def can_be_compensated(action: Action, *, after_pivot: bool = False) -> bool:
    """Whether Unwind would ever undo this step on its own: a retriable step after the run's pivot (the run only
    moves forward from there), a read-only call and a step whose policy declares no compensation are never
    undone, so the strip draws no compensation for them (unless one actually ran: facts beat rules)."""
    return (not (after_pivot and action.saga_role == SagaRole.RETRIABLE)
            and action.tool.action_class != ActionClass.READ_ONLY
            and (action.compensation_plan or {}).get("strategy") not in (None, "", CompensationStrategy.NONE))


def mark_undoable(actions: list[Action]) -> None:
    """Set `undoable` on each forward action of a run (`actions` in order), as `can_be_compensated` says."""
    pivot_seq = next((a.seq for a in actions if a.kind == ActionKind.FORWARD and a.saga_role == SagaRole.PIVOT), None)
    for action in actions:
        after_pivot = pivot_seq is not None and action.seq > pivot_seq
        action.undoable = action.kind == ActionKind.FORWARD and can_be_compensated(action, after_pivot=after_pivot)


@dataclass
class Box:
    action: Action
    status: str
    icon: str
    words: str

    @classmethod
    def of(cls, action: Action) -> Box:
        icon, words = STATUS_MARKS.get(action.status, ("•", action.status))
        return cls(action=action, status=action.status, icon=icon, words=words)


@dataclass
class Step:
    forward: Box
    compensation: Box | None
    undoable: bool
    marker: str = ""

    @property
    def stoppers(self) -> str:
        """Who can stop a held step, in words (ledger/engine/holds.py)."""
        action = self.forward.action
        who = ["the agent", "an operator"]
        if action.approvals_required:
            who.append("its approvers")
        if (action.tool.hold or {}).get("customer_can_stop"):
            who.append("the customer")
        return ", ".join(who[:-1]) + " or " + who[-1]

    @property
    def ready(self) -> bool:
        """Its effect stands and it could be undone: drawn as a dashed "undo ready, not run" box."""
        return self.compensation is None and self.undoable and self.forward.status == ActionStatus.SUCCEEDED


@dataclass
class Group:
    role: str
    words: str
    steps: list[Step] = field(default_factory=list)


@dataclass
class Strip:
    groups: list[Group]
    legend: list[Box]
    marker_words: str
    compensations: int

    @property
    def steps(self) -> list[Step]:
        return [step for group in self.groups for step in group.steps]


def saga_strip(run: Run, actions: list[Action], *, stop_action_id: int | None = None) -> Strip:
    """The strip for `actions` (a run's actions in order, `undone_by` attached as `run_timeline` does)."""
    if any(not hasattr(a, "undoable") for a in actions):
        mark_undoable(actions)
    forwards = [a for a in actions if a.kind == ActionKind.FORWARD]
    steps = []
    for action in forwards:
        undone_by = getattr(action, "undone_by", None)
        if undone_by is None:
            undone_by = [a for a in actions if a.compensates_id == action.pk]
        latest = undone_by[-1] if undone_by else None
        steps.append(Step(forward=Box.of(action), compensation=Box.of(latest) if latest else None,
                          undoable=action.undoable))
    marker_words = "stopped here" if run.status in RESTING else "waiting here"
    stop = _stop_step(steps, stop_action_id)
    if stop is not None and run.status != RunStatus.COMPLETED:
        stop.marker = marker_words
        stop.forward.action.marker = marker_words  # the step's card on the page opens where the run stopped
    groups: list[Group] = []
    for step in sorted(steps, key=lambda s: (ROLE_ORDER.index(s.forward.action.saga_role)
                                             if s.forward.action.saga_role in ROLE_ORDER else 0, s.forward.action.seq)):
        role = step.forward.action.saga_role
        if not groups or groups[-1].role != role:
            groups.append(Group(role=role, words=ROLE_WORDS.get(role, role)))
        groups[-1].steps.append(step)
    legend = [Box(action=None, status=s, icon=STATUS_MARKS[s][0], words=STATUS_MARKS[s][1]) for s in LEGEND]
    return Strip(groups=groups, legend=legend, marker_words=marker_words,
                 compensations=sum(1 for s in steps if s.compensation))


def _stop_step(steps: list[Step], stop_action_id: int | None) -> Step | None:
    if stop_action_id is not None:
        for step in steps:
            if step.forward.action.pk == stop_action_id:
                return step
    return next((step for step in steps if step.forward.status in UNSETTLED), None)
