"""Who may stop a held step (ledger/engine/holds.py), and the stop itself for each of them.

The engine records a stop and goes on by the saga law; this module decides whether the person asking may: an
operator of the run's tenant, an approver who approved that very step, or the holder of a live share link to the
run's correction trail when the step's policy lets the customer stop it (`hold: {customer_can_stop: true}`). The
agent stops a held step by cancelling its run (ledger/engine/runs.py).
"""
from __future__ import annotations

from django.utils import timezone

from approvals.models import ApprovalDecision
from approvals.services import actor_of, role_of
from ledger.engine import holds, moves
from ledger.errors import NotFound, PermissionDenied
from ledger.models import ROLE_ORDER, Action, ActionKind, ActionStatus, Role, Run
from recovery.models import TrailShareLink
from recovery.trail import SHARE_TOKEN, _token_hash


def stopper_role(user, action: Action) -> str | None:
    """How `user` may stop `action` ("operator" or "approver"), or None when they may not."""
    role = role_of(user, action.tenant_id)
    if role is not None and ROLE_ORDER[role] >= ROLE_ORDER[Role.OPERATOR]:
        return "operator"
    approved = ApprovalDecision.objects.filter(request__action=action, user=user, decision="approve").exists()
    return "approver" if approved else None


def stop_as_person(*, action: Action, user, reason: str = "") -> Action:
    """An operator, or an approver who approved the step, stops it. PermissionDenied for anyone else."""
    by = stopper_role(user, action)
    if by is None:
        raise PermissionDenied("stopping a held step needs the operator role, or to have approved it")
    return holds.action_stop(action_id=action.pk, actor=actor_of(user), by=by, reason=reason)


def _live_link(token: str) -> TrailShareLink | None:
    if not isinstance(token, str) or not SHARE_TOKEN.match(token):
        return None
    return (TrailShareLink.objects.select_related("run__tenant")
            .filter(token_hash=_token_hash(token), revoked_at__isnull=True, expires_at__gt=timezone.now()).first())


def customer_stoppable(run: Run) -> list[Action]:
    """The run's held steps the person it acts for may stop, soonest first, each with `customer_words`: what it
    would do, and `also_words`: what else stopping it does (the moves model's plan, in the trail's words)."""
    from recovery.trail import _proposed, _sentence, consequence_words

    actions = list(run.actions.select_related("tool").order_by("seq"))
    offered = moves.run_moves(run, actions)
    held = sorted((a for a in actions if a.kind == ActionKind.FORWARD and a.status == ActionStatus.HELD
                   and holds.customer_can_stop(a.tool)), key=lambda a: (a.next_attempt_at, a.seq))
    for action in held:
        action.customer_words = _sentence(f"we are about to {_proposed(action)}")
        action.also_words = consequence_words(offered.get(moves.CUSTOMER, "stop", action.pk), doing="Stopping it")
    return held


def with_stop_moves(steps: list[Action], *, actor: str = moves.OPERATOR) -> list[Action]:
    """Attach to each held step `stop_move`: what stopping it does (ledger/engine/moves.py), reading the runs' steps
    in one query whatever the number of steps."""
    by_run: dict[int, list[Action]] = {}
    for action in Action.objects.filter(run_id__in={s.run_id for s in steps}).select_related("tool").order_by("seq"):
        by_run.setdefault(action.run_id, []).append(action)
    for step in steps:
        step.stop_move = moves.stop_move(step.run, by_run.get(step.run_id, []), step, actor)
    return steps


def stop_as_customer(*, token: str, action_id: int) -> Action:
    """The holder of a live share link stops a held step of that run whose policy allows it. NotFound for a link
    that is unknown, expired or revoked, and for a step not of its run (one answer: nothing to guess from);
    PermissionDenied for a step of its run the customer may not stop."""
    link = _live_link(token)
    if link is None:
        raise NotFound("this link does not open a correction trail")
    action = Action.objects.select_related("tool").filter(pk=action_id, run_id=link.run_id,
                                                          kind=ActionKind.FORWARD).first()
    if action is None:
        raise NotFound("this link does not open a correction trail")
    if not holds.customer_can_stop(action.tool):
        raise PermissionDenied("this step cannot be stopped from the trail")
    who = f"customer:{link.sent_to or 'share link'} (link {link.pk})"
    return holds.action_stop(action_id=action.pk, actor=who[:160], by="customer")


def on_action_held(*, action: Action, run: Run) -> None:
    """A step the customer may stop is held: send the person the run acts for the trail's link and the deadline, if
    the tenant knows that address and the agent is within its bound of notices; else record why not
    (recovery/hold_notices.py). An outbox row in the engine's transaction, with the new link and its audit events."""
    from recovery.hold_notices import hold_notice_send

    if holds.customer_can_stop(action.tool):
        hold_notice_send(action=action, run=run)
