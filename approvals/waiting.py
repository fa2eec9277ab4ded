"""Whether an approval request still waits for a decision: the one rule that every message asking people to decide
it (its email, its digest entry, its Slack message) is checked against as it leaves (approvals/services.py,
approvals/slack.py). A request decided, withdrawn, voided or expired is not put in front of anyone again."""
from __future__ import annotations

from datetime import datetime, timezone

from approvals.models import ApprovalRequest, ApprovalStatus


def no_longer_waiting(request: ApprovalRequest, *, now: datetime) -> str:
    """Why nobody should be asked to decide `request` at `now`, in words for the outbox row ("" while it waits). A
    pending request past its expiry no longer waits either, though the sweep has not marked it expired yet."""
    if request.status == ApprovalStatus.PENDING:
        if request.expires_at > now:
            return ""
        return f"request {request.pk} expired at {utc(request.expires_at)}"
    verb = "expired" if request.status == ApprovalStatus.EXPIRED else f"was {request.status}"
    when = f" at {utc(request.decided_at)}" if request.decided_at else ""
    why = f": {request.outcome_reason}" if request.outcome_reason else ""
    return f"request {request.pk} {verb}{when}{why}"[:1900]


def utc(moment: datetime) -> str:
    return f"{moment.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
