"""Where an answer of the agent API points into other apps, without the ledger importing them.

The approvals app registers how to find the approval request of gated actions when its API module
loads (the URLconf imports it before any request is served). Until then, or without that app, an
action simply carries no approval link.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from ledger.models import Action

ApprovalLookup = Callable[[Iterable[Action]], dict[int, dict]]
_approval_lookup: ApprovalLookup | None = None


def register_approval_lookup(lookup: ApprovalLookup) -> None:
    """`lookup(actions)` answers {action_id: {"id", "status", "expires_at", "page", "api"}} in one query."""
    global _approval_lookup
    _approval_lookup = lookup


def approvals_for(actions: Iterable[Action]) -> dict[int, dict]:
    gated = [action for action in actions if action.approvals_required]
    if _approval_lookup is None or not gated:
        return {}
    return _approval_lookup(gated)
