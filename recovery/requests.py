"""Customer requests: the person a run acted for asks, from the trail's share page, for a step to be corrected.

Off unless the tenant's defaults say `customer_requests: 7d` (the window after the run's start in which they may
ask). Only the holder of a live share link can ask, about a step of that run; a request is a short text and a
choice ("undo this", "something else is wrong"), at most MAX_PER_HOUR per link in any hour and MAX_PER_LINK in all
(counted in the database, so every web process sees the same count). It puts the run before a person (a recovery
item with its own reason, `customer_request`), unless one is already looking at it; the operator resumes,
compensates or closes it as any other and writes a reply, which the share page shows and an email brings to the
person. Every request and reply is recorded in the audit chain.
"""
from __future__ import annotations

from datetime import timedelta

from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.utils import timezone

from approvals.services import actor_of, notify, require_role
from ledger.agent_text import mail_text, neutral
from ledger.audit.chain import ledger_transaction
from ledger.errors import NotFound, PermissionDenied, StateConflict, UnwindError, ValidationFailed
from ledger.models import ActionKind, ActionStatus, Role, Run, RunStatus
from ledger.engine import moves, runstate
from recovery.models import CustomerRequest, ItemStatus, RecoveryItem, RequestKind, TrailShareLink
from recovery.trail import SHARE_TOKEN, _proposed, _sentence, _token_hash, trail_share_url

MAX_TEXT = 1000
MAX_REPLY = 4000
MAX_PER_HOUR = 3
MAX_PER_LINK = 10
ACTOR = "customer"
NOT_SHOWN = (ActionStatus.SKIPPED, ActionStatus.REJECTED, ActionStatus.EXPIRED)


class TooManyRequests(UnwindError):
    code, status, title = "too_many_requests", 429, "Too many requests"


def live_link(token: str) -> TrailShareLink | None:
    if not isinstance(token, str) or not SHARE_TOKEN.match(token):
        return None
    return (TrailShareLink.objects.select_related("run__tenant")
            .filter(token_hash=_token_hash(token), revoked_at__isnull=True, expires_at__gt=timezone.now()).first())


def window_open(run: Run, *, now=None) -> bool:
    seconds = run.tenant.customer_requests_seconds
    return bool(seconds) and (now or timezone.now()) < run.created_at + timedelta(seconds=seconds)


def askable_steps(run: Run) -> list:
    """The steps of the run the person may ask about (those that did or may do something), with their words."""
    steps = list(run.actions.filter(kind=ActionKind.FORWARD).exclude(status__in=NOT_SHOWN)
                 .exclude(tool__action_class="read_only").select_related("tool").order_by("seq"))
    for step in steps:
        step.customer_words = _sentence(_proposed(step))
    return steps


def undoable_steps(run: Run) -> list[int]:
    """The steps whose undo the person may ask for: those the moves model offers "undo this" on (their effect
    still stands and has an undo). A run already undone offers none."""
    return [move.action_id for move in moves.run_moves(run).allowed(moves.CUSTOMER) if move.name == "ask_undo"]


def customer_request_open(*, token: str, action_id: int | None, kind: str, text: str) -> CustomerRequest:
    """The share-link holder asks for a correction. NotFound: no live link (one answer for unknown, expired and
    revoked), or a step not of its run; PermissionDenied: the tenant does not take requests, or its window ended;
    ValidationFailed: bad kind or text; TooManyRequests: the link's rate is used up."""
    link = live_link(token)
    if link is None:
        raise NotFound("this link does not open a correction trail")
    run = link.run
    if not window_open(run):
        raise PermissionDenied("requests cannot be made from this page" if not run.tenant.customer_requests_seconds
                               else "the time to ask for a correction of this request has passed")
    if kind not in RequestKind.values:
        raise ValidationFailed("choose what is wrong: undo this, or something else is wrong", field="kind")
    text = (text or "").strip()
    if not text:
        raise ValidationFailed("say in a few words what is wrong", field="text")
    if len(text) > MAX_TEXT or "\x00" in text:
        raise ValidationFailed(f"your message is {len(text)} characters long; at most {MAX_TEXT} are accepted",
                               field="text")
    action = None
    if action_id is not None:
        action = next((step for step in askable_steps(run) if step.pk == action_id), None)
        if action is None:
            raise NotFound("this link does not open a correction trail")
    if kind == RequestKind.UNDO:
        undoable = undoable_steps(run)
        if action is not None and action.pk not in undoable:
            raise StateConflict("that step has nothing left to undo: it was already undone, or it cannot be taken "
                                "back; choose “something else is wrong” to tell us what to do")
        if not undoable:
            raise StateConflict("nothing done for this request still stands to be undone; choose “something else is "
                                "wrong” to tell us what to do")
    with ledger_transaction(run.tenant_id) as audit:
        # The link's row, locked: two requests through one link are counted one after the other.
        TrailShareLink.objects.select_for_update(no_key=True).filter(pk=link.pk).first()
        now = timezone.now()
        made = CustomerRequest.objects.filter(link=link)
        if made.count() >= MAX_PER_LINK or made.filter(created_at__gt=now - timedelta(hours=1)).count() >= MAX_PER_HOUR:
            raise TooManyRequests(f"this link has already been used for {MAX_PER_HOUR} requests in the last hour (or "
                                  f"{MAX_PER_LINK} in all); {run.tenant.name} has them and will answer")
        locked = Run.objects.select_for_update(no_key=True).get(pk=run.pk)
        request = CustomerRequest.objects.create(tenant_id=run.tenant_id, run=run, action=action, link=link,
                                                 kind=kind, text=text)
        audit.record("customer.request", actor=f"{ACTOR}:{link.sent_to or 'share link'} (link {link.pk})"[:160],
                     run=locked, action=action, request=request.pk, choice=kind, text=text)
        what = f"step {action.seq} ({action.tool.name})" if action is not None else "the run"
        # Their words on one line with bidi controls shown: the detail reaches the operators' email as plain text.
        detail = (f"The person the run acted for asks about {what}: {RequestKind(kind).label}. "
                  f"In their words: {' '.join(neutral(text).split())}")
        if locked.status != RunStatus.NEEDS_ATTENTION:
            runstate.needs_attention(locked, "customer_request", detail, action=action, log=audit,
                                      actor=f"{ACTOR}:link {link.pk}")
        request.item = RecoveryItem.objects.filter(run=run, status=ItemStatus.OPEN).first()
        CustomerRequest.objects.filter(pk=request.pk).update(item=request.item)
    return request


def customer_request_reply(*, request: CustomerRequest, user, text: str) -> CustomerRequest:
    """An operator answers a customer request: shown on the share page, and emailed to the person."""
    require_role(user, request.tenant_id, Role.OPERATOR)
    text = (text or "").strip()
    if not text:
        raise ValidationFailed("write the reply the person will read", field="reply")
    if len(text) > MAX_REPLY:
        raise ValidationFailed(f"the reply is {len(text)} characters long; at most {MAX_REPLY}", field="reply")
    actor = actor_of(user)
    run = request.run
    with ledger_transaction(request.tenant_id) as audit:
        if CustomerRequest.objects.filter(pk=request.pk, replied_at__isnull=True).update(
                reply=text, replied_by=actor, replied_at=timezone.now()) != 1:
            raise StateConflict(f"request {request.pk} was already answered")
        request.refresh_from_db()
        audit.record("customer.reply", actor=actor, run=run, request=request.pk, text=text)
        recipient = (request.link.sent_to or run.on_behalf_of or "").strip()
        try:
            validate_email(recipient)
        except ValidationError:
            recipient = ""
        if recipient:
            token_url = trail_share_url_for(request)
            notify(tenant_id=run.tenant_id, kind="customer_reply", recipients=[recipient],
                   subject=f"{run.tenant.name} answered your request (reference {run.pk})",
                   template="recovery/email/customer_reply",
                   context={"run": run, "request": request, "company": run.tenant.name, "url": token_url,
                            "their_text": mail_text(request.text), "reply_text": mail_text(request.reply)})
    return request


def trail_share_url_for(request: CustomerRequest) -> str:
    """A new link to the trail for the reply's email (the one they used is not stored, only its hash), made by the
    system and audited like any other."""
    from recovery.trail import new_share_link

    token = new_share_link(run=request.run, actor="system:customer-reply", sent_to=request.link.sent_to)
    return trail_share_url(token)


def requests_for(run: Run) -> list[CustomerRequest]:
    return list(CustomerRequest.objects.filter(run=run).select_related("action__tool").order_by("created_at", "pk"))


def request_get(*, user, pk: int) -> CustomerRequest:
    request = CustomerRequest.objects.select_related("run__tenant", "link").filter(pk=pk).first()
    if request is None:
        raise NotFound(f"there is no request {pk}")
    try:
        require_role(user, request.tenant_id, Role.VIEWER)
    except PermissionDenied:
        raise NotFound(f"there is no request {pk}") from None
    return request
