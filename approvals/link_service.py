"""Approve from the inbox: each approver's email carries an approve and a reject link made for that person.

A link is one decision, by the person it was sent to, on exactly the args hash and policy version it was made
for, before it expires (the request's expiry, or UNWIND_APPROVAL_LINK_MAX_AGE sooner). The decision goes through
`approval_decide` like any other, so quorum, separation of duties, expiry and void-on-policy-change hold as they
do on the approval page. A link logs nobody in.

Tokens: HMAC-SHA256 of the link's random nonce and its decision, keyed with SECRET_KEY (outside the database).
The database keeps only each token's SHA-256; the outbox row keeps a placeholder that only the sender fills in,
as the mail leaves. So someone who reads the database (or the outbox) cannot use or rebuild a link, and a retried
send mails the same link again.
"""
from __future__ import annotations

import base64
import hashlib
import re
import secrets
from datetime import timedelta

from django.conf import settings
from django.urls import reverse
from django.utils import timezone
from django.utils.crypto import constant_time_compare, salted_hmac

from approvals.models import ApprovalLink, ApprovalRequest, Decision, Notification
from ledger.errors import UnwindError

PLACEHOLDER = re.compile(r"\[\[approval-link:(\d+):(approve|reject):([0-9a-f]{32})\]\]")


class LinkRefused(UnwindError):
    """A link that cannot decide. Nothing was changed by the attempt."""

    code, status, title = "approval_link_refused", 409, "This link cannot decide"

    def __init__(self, detail: str, *, code: str, status: int, title: str):
        super().__init__(detail)
        self.code, self.status, self.title = code, status, title


def _token(nonce: str, decision: str) -> str:
    digest = salted_hmac("unwind.approval-link", f"{nonce}:{decision}", algorithm="sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def link_url(token: str) -> str:
    return reverse("approval_links:confirm", args=[token])


def _slot(link_id: int, nonce: str, decision: str) -> str:
    """A placeholder's tag: an HMAC (SECRET_KEY) of the link's nonce, which only the server knows and no agent
    ever sees; a placeholder without the right tag is never filled, whoever wrote it."""
    tag = salted_hmac("unwind.approval-link-slot", f"{link_id}:{nonce}:{decision}", algorithm="sha256")
    return tag.hexdigest()[:32]


def placeholder(link: ApprovalLink, decision: str) -> str:
    """What the outbox row holds where the link goes: only `links_fill` turns it into a working URL."""
    return f"[[approval-link:{link.pk}:{decision}:{_slot(link.pk, link.nonce, decision)}]]"


def link_create(*, request: ApprovalRequest, user) -> ApprovalLink:
    """The approve/reject pair for one approver (in the caller's transaction, with the request it belongs to)."""
    nonce = secrets.token_urlsafe(32)
    expires = min(request.expires_at, timezone.now() + timedelta(seconds=settings.UNWIND_APPROVAL_LINK_MAX_AGE))
    return ApprovalLink.objects.create(
        tenant_id=request.tenant_id, request=request, user=user, nonce=nonce,
        approve_hash=token_hash(_token(nonce, Decision.APPROVE)),
        reject_hash=token_hash(_token(nonce, Decision.REJECT)),
        args_hash=request.args_hash, tool_id=request.tool_id, expires_at=expires)


def links_fill(note: Notification, text: str) -> str:
    """The mail as it leaves: each placeholder of a link that belongs to this very notification, with the tag only
    the server can make for it, becomes its URL. A placeholder an agent slipped into its words has no such tag (it
    never saw one, and cannot compute one), so it is never filled: it stays as the agent wrote it."""
    ids = {int(pk) for pk, _, _ in PLACEHOLDER.findall(text)}
    if not ids:
        return text
    nonces = dict(ApprovalLink.objects.filter(pk__in=ids, notification=note).values_list("pk", "nonce"))
    base = settings.UNWIND_BASE_URL.rstrip("/")

    def fill(match: re.Match) -> str:
        link_id, decision, slot = int(match.group(1)), match.group(2), match.group(3)
        nonce = nonces.get(link_id)
        if nonce is None or not constant_time_compare(slot, _slot(link_id, nonce, decision)):
            return match.group(0)
        return base + link_url(_token(nonce, decision))

    return PLACEHOLDER.sub(fill, text)


# --- using a link ---------------------------------------------------------------------------------

def refuse(detail: str, code: str, status: int, title: str):
    raise LinkRefused(detail, code=code, status=status, title=title)


def link_find(token: str) -> tuple[ApprovalLink, str]:
    """The link a token opens and the decision it carries; refused when no link has it (unknown or tampered)."""
    if not isinstance(token, str) or not 20 <= len(token) <= 100:
        refuse("This link is not valid: it may have been cut short or altered. Open it again from the email, "
                "or decide on the approval page.", "approval_link_invalid", 404, "Link not valid")
    digest = token_hash(token)
    links = ApprovalLink.objects.select_related("request__action__tool", "request__tenant", "request__run__agent",
                                                "request__tool", "user", "tool")
    link = links.filter(approve_hash=digest).first()
    if link is not None:
        return link, Decision.APPROVE
    link = links.filter(reject_hash=digest).first()
    if link is None:
        refuse("This link is not valid: it may have been cut short or altered. Open it again from the email, "
                "or decide on the approval page.", "approval_link_invalid", 404, "Link not valid")
    return link, Decision.REJECT
