"""A decision made by a click: an emailed approval link or a Slack button, each through `approval_decide`.

The surfaces themselves (approvals/link_service.py: tokens and links; approvals/slack.py: messages and signatures)
know nothing of deciding, so the imports run one way: services -> link_service, slack; clicks -> all three.
"""
from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from approvals import slack, surfaces
from approvals.link_service import refuse
from approvals.models import ApprovalLink, ApprovalRequest, ApprovalStatus, Decision, SlackIdentity
from approvals.services import ApprovalVoided, approval_decide, is_requester, role_of
from ledger.errors import NotFound, PermissionDenied, StateConflict
from ledger.models import ROLE_ORDER, Role, Tool


class SlackUserUnmapped(PermissionDenied):
    code, title = "slack_user_unmapped", "Slack user not mapped to a person"


class SlackCannotShow(StateConflict):
    code, title = "slack_cannot_show_request", "Decide this request on its page"


# --- an emailed link --------------------------------------------------------------------------------

def link_check(link: ApprovalLink, *, browser_user) -> None:
    """Why this link cannot decide now, as a refusal; None when it can. `approval_decide` checks again under lock."""
    request = link.request
    now = timezone.now()
    if link.used_at is not None:
        refuse(f"This link was already used {timezone.localtime(link.used_at):%Y-%m-%d %H:%M %Z}. Each link decides "
                "once; open the approval page to see where the request stands.", "approval_link_used", 410,
                "Link already used")
    if browser_user is not None and browser_user.is_authenticated and browser_user.pk != link.user_id:
        refuse(f"This link was sent to {link.user.get_username()}, but this browser is signed in as "
                f"{browser_user.get_username()}. A link decides only for the person it was sent to; decide on the "
                "approval page as yourself instead.", "approval_link_other_person", 403, "Link for someone else")
    _check_person(link)
    if request.status == ApprovalStatus.VOIDED:
        refuse(f"This request was voided: {request.outcome_reason}. Nothing can be approved.", "approval_voided",
                409, "Request voided")
    if request.status != ApprovalStatus.PENDING:
        refuse(f"This request is already {request.status}; nothing is left to decide.", "approval_link_decided",
                409, "Already decided")
    if link.expires_at <= now or request.expires_at <= now:
        refuse("This link has expired. An approval not given in time counts as a rejection.",
                "approval_link_expired", 410, "Link expired")
    if link.args_hash != request.args_hash or request.args_hash != request.action.args_hash:
        refuse("The action's arguments changed after this link was sent: it was made for other arguments and "
                "cannot approve these.", "approval_voided", 409, "Arguments changed")
    if link.tool_id != request.tool_id or not Tool.objects.filter(pk=link.tool_id, is_current=True).exists():
        refuse("The tool's policy changed after this link was sent: nobody approved the new policy, so this link "
                "cannot decide.", "approval_voided", 409, "Policy changed")


def _check_person(link: ApprovalLink) -> None:
    """The page would only refuse later what `approval_decide` refuses: say so before showing a button."""
    role = role_of(link.user, link.request.tenant_id)
    if role is None or ROLE_ORDER[role] < ROLE_ORDER[Role.APPROVER]:
        refuse(f"{link.user.get_username()} no longer has the approver role in {link.request.tenant.name}, so this "
                "link cannot decide.", "permission_denied", 403, "Not an approver")
    if is_requester(link.request, link.user):
        refuse("You asked for this action, or it acts on your behalf, so someone else must decide (separation of "
                "duties).", "permission_denied", 403, "Someone else must decide")
    if link.request.decisions.filter(user=link.user).exists():
        refuse("You have already decided on this request; each person counts once.", "approval_link_decided", 409,
                "Already decided")


def link_use(*, link: ApprovalLink, decision: str, browser_user, reason: str = "") -> ApprovalRequest:
    """Record the link's person's decision through `approval_decide` and use the link up, in one transaction:
    a refused decision leaves the link unused and nothing else changed. A void found on the way stands (and the
    link with it, as there is nothing left to decide)."""
    link_check(link, browser_user=browser_user)
    voided = None
    with transaction.atomic():
        if ApprovalLink.objects.filter(pk=link.pk, used_at__isnull=True).update(
                used_at=timezone.now(), used_for=decision) != 1:
            refuse("This link was already used. Each link decides once.", "approval_link_used", 410,
                    "Link already used")
        try:
            decided = approval_decide(request=link.request, user=link.user, approve=decision == Decision.APPROVE,
                                      reason=reason)
        except ApprovalVoided as error:
            voided = error
    if voided is not None:
        raise voided
    return decided


# --- a Slack button ---------------------------------------------------------------------------------

def slack_decide(*, payload: str) -> ApprovalRequest | None:
    """The decision a verified click asks for, as the mapped person's, through `approval_decide` (which refreshes
    the message after its commit); None for a click on the "Open" link. A request whose message could not show
    everything its decision covers was posted without buttons and cannot be decided from Slack at all."""
    click = slack.parse_click(payload)
    if click is None:
        return None
    slack_user, decision, approval_id, args_hash = click
    request = ApprovalRequest.objects.select_related("action__tool", "run", "tool").filter(pk=approval_id).first()
    if request is None:
        raise NotFound(f"there is no approval request {approval_id}")
    if not surfaces.fits(request, slack.LIMITS):
        raise SlackCannotShow(f"request {request.pk} is too large for a Slack message to show in full, so it cannot be "
                              "decided from Slack; nothing was decided. Open the approval page to decide.")
    identity = SlackIdentity.objects.select_related("user").filter(
        tenant_id=request.tenant_id, slack_user_id=slack_user).first()
    if identity is None:
        raise SlackUserUnmapped(f"Slack user {slack_user} is not mapped to anyone who may decide this; an admin maps "
                                "people with `manage.py slack_identity`")
    if args_hash != request.args_hash or args_hash != request.action.args_hash:
        raise StateConflict("this button was made for other arguments than the action has now; nothing was decided")
    who = identity.user.get_username()
    reason = "" if decision == Decision.APPROVE else f"rejected in Slack by {who} (Slack buttons carry no reason)"
    return approval_decide(request=request, user=identity.user, approve=decision == Decision.APPROVE, reason=reason)
