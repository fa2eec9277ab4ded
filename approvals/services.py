"""The approval gate: requests, decisions (separation of duties, quorum, expiry) and the email outbox."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from approvals import link_service, slack, surfaces
from approvals.addresses import names_person
from approvals.models import (
    ApprovalDecision, ApprovalLink, ApprovalRequest, ApprovalStatus, Decision, Notification, NotificationStatus,
)
from approvals.waiting import no_longer_waiting
from ledger.audit.chain import ledger_transaction, recording
from ledger.errors import PermissionDenied, StateConflict, ValidationFailed
from ledger.models import ROLE_ORDER, Action, ActionStatus, Membership, Role, Tool
from ledger.engine import moves
from ledger.engine.actions import action_approve, action_reject

log = logging.getLogger("unwind.approvals")
SEND_BATCH = 50
MAX_SEND_ATTEMPTS = 8
REQUESTED, DIGEST, DIGEST_ENTRY = "approval_requested", "approval_digest", "approval_digest_entry"


class ApprovalVoided(StateConflict):
    """The tool's policy changed while the request waited: approving it would release a call nobody approved."""

    code, title = "approval_voided", "The approval request was voided"


def actor_of(user) -> str:
    return f"user:{user.get_username()}"


def role_of(user, tenant_id: int) -> str | None:
    membership = Membership.objects.filter(user=user, tenant_id=tenant_id).only("role").first()
    return membership.role if membership else None


def require_role(user, tenant_id: int, role: str) -> None:
    have = role_of(user, tenant_id)
    if have is None or ROLE_ORDER[have] < ROLE_ORDER[role]:
        raise PermissionDenied(f"this needs the {role} role in the tenant; you are {have or 'not a member'}")


def build_preview(action: Action) -> dict:
    plan = action.compensation_plan or {}
    forward = action.compensates if action.kind == "compensation" else None
    return {
        "tool": action.tool.name,
        "description": action.tool.description,
        "args": action.args,
        "target": {"type": action.target_type, "id": action.target_id},
        "before": action.before if forward is None else forward.after,
        "proposed": action.args,
        "compensation": None if forward is not None else {
            "strategy": plan.get("strategy"), "tool": plan.get("tool"), "args": plan.get("args"),
        },
        "undoes": None if forward is None else {"seq": forward.seq, "tool": forward.tool.name, "args": forward.args,
                                               "before": forward.before},
        "intent": action.intent,
        "run_goal": action.run.goal,
        "on_behalf_of": action.run.on_behalf_of,
        # What the tool's rules and limits decided, the values they read, the policy version (ledger/engine/decision.py).
        "policy": action.policy_decision,
    }


def approvers_emails(tenant_id: int) -> list[str]:
    roles = [r for r in Role.values if ROLE_ORDER[r] >= ROLE_ORDER[Role.APPROVER]]
    return sorted(set(Membership.objects.filter(tenant_id=tenant_id, role__in=roles)
                      .exclude(user__email="").values_list("user__email", flat=True)))


def approvers(tenant_id: int) -> list:
    """The people who may approve in the tenant and have an email address, one each, by address."""
    roles = [r for r in Role.values if ROLE_ORDER[r] >= ROLE_ORDER[Role.APPROVER]]
    members = (Membership.objects.filter(tenant_id=tenant_id, role__in=roles).exclude(user__email="")
               .select_related("user").order_by("user__email", "user_id"))
    by_email = {}
    for membership in members:
        by_email.setdefault(membership.user.email, membership.user)
    return list(by_email.values())


def what_it_is(action: Action) -> str:
    """A subject's name for the step: the tool and what it is about in money ("payments.charge, €920.00";
    "payments.refund, €610.00" for the refund of that charge: approvals/surfaces.py, `amounts`), so an inbox or the
    outbox list says what a request is about unopened."""
    return ", ".join([action.tool.name, *surfaces.amounts(action)])


def notify(*, tenant_id: int, kind: str, recipients: list[str], subject: str, template: str, context: dict,
           request: ApprovalRequest | None = None) -> Notification | None:
    """Write an outbox row in the current transaction; a worker sends it after commit. `request`: the approval
    request the message asks someone to decide, so that it is withheld should the request stop waiting first."""
    if not recipients:
        return None
    context = {**context, "base_url": settings.UNWIND_BASE_URL.rstrip("/")}
    return Notification.objects.create(
        tenant_id=tenant_id, kind=kind, request=request, recipients=recipients, subject=subject[:250],
        body_text=render_to_string(f"{template}.txt", context),
        body_html=render_to_string(f"{template}.html", context),
        next_attempt_at=timezone.now(),
    )


# --- engine event handlers (run inside the engine's transaction) -----------------------------------

def on_approval_required(*, action: Action, requested_by: str) -> None:
    tenant = action.run.tenant
    request = ApprovalRequest.objects.create(
        tenant_id=action.tenant_id, run_id=action.run_id, action=action, is_compensation=action.kind == "compensation",
        args_hash=action.args_hash, tool_id=action.tool_id, preview=build_preview(action), risk=action.risk,
        requested_by=requested_by,
        required=max(1, action.approvals_required),
        expires_at=timezone.now() + timedelta(seconds=tenant.approval_ttl_seconds),
    )
    with recording(action.tenant_id) as audit:
        audit.record("approval.requested", actor=requested_by, request=request.pk, for_action=action.pk, rows=[request])
    url = reverse("approvals:detail", args=[request.pk])
    shown = surfaces.shown(request, surfaces.EMAIL)
    for approver in approvers(action.tenant_id):
        if digest_due(tenant_id=action.tenant_id, email=approver.email):
            digest_add(request=request, action=action, email=approver.email, url=url)
            continue
        # One email per approver: each carries approve/reject links made for that person alone (link_service.py),
        # only when the email shows everything the decision covers (approvals/surfaces.py). Who may not decide
        # (separation of duties) gets the email without links.
        decides = shown.complete and not is_requester(request, approver)
        link = link_service.link_create(request=request, user=approver) if decides else None
        context = {"request": request, "action": action, "url": url, "shown": shown,
                   "approve_url": link and link_service.placeholder(link, Decision.APPROVE),
                   "reject_url": link and link_service.placeholder(link, Decision.REJECT)}
        note = notify(tenant_id=action.tenant_id, kind=REQUESTED, recipients=[approver.email], request=request,
                      subject=f"[Unwind] Approval needed: {what_it_is(action)} ({action.risk} risk)",
                      template="approvals/email/approval_requested", context=context)
        if link is not None:
            ApprovalLink.objects.filter(pk=link.pk).update(notification=note)
    slack.on_approval_requested(request=request)


# --- the digest: one email for many requests ---------------------------------------------------------
# More than UNWIND_APPROVAL_DIGEST_AFTER requests for one approver within UNWIND_APPROVAL_DIGEST_WINDOW seconds:
# each further request becomes an entry row (an outbox row never sent by itself: no next_attempt_at), and one
# digest row, sent a window after it was opened, lists every entry waiting for that address. The entries are
# written in the request's transaction like any email and gathered by the worker as it sends, so nothing is
# counted in a process's memory and a crash between the two loses nothing (an entry stays pending until the
# digest that lists it has gone out). A digest carries no decision: each entry links to its approval page.
# The digest is written as it leaves, from the entries whose request still waits then (`digest_compose`): an
# entry whose request was decided, withdrawn, voided or expired meanwhile is withheld, and a digest with none
# left is not sent. Withheld rows do not count towards the threshold: nobody received them.

def digest_due(*, tenant_id: int, email: str) -> bool:
    """Whether this approver already had UNWIND_APPROVAL_DIGEST_AFTER requests mailed (singly or as digest
    entries) within the window, so that the next one goes into a digest."""
    since = timezone.now() - timedelta(seconds=settings.UNWIND_APPROVAL_DIGEST_WINDOW)
    recent = Notification.objects.filter(tenant_id=tenant_id, kind__in=[REQUESTED, DIGEST_ENTRY], recipients=[email],
                                         created_at__gte=since).exclude(status=NotificationStatus.WITHHELD)
    return recent.count() >= settings.UNWIND_APPROVAL_DIGEST_AFTER


def digest_add(*, request: ApprovalRequest, action: Action, email: str, url: str) -> None:
    """In the request's transaction: its entry for this approver, and the digest that will carry it (the open one,
    locked so that the worker cannot claim it meanwhile, or a new one due a window from now)."""
    context = {"request": request, "action": action, "url": url, "shown": surfaces.shown(request, surfaces.EMAIL),
               "base_url": settings.UNWIND_BASE_URL.rstrip("/")}
    Notification.objects.create(
        tenant_id=request.tenant_id, kind=DIGEST_ENTRY, request=request, recipients=[email], next_attempt_at=None,
        subject=f"In the next digest: {what_it_is(action)} ({action.risk} risk), request {request.pk}"[:250],
        body_text=render_to_string("approvals/email/approval_digest_entry.txt", context),
        body_html=render_to_string("approvals/email/approval_digest_entry.html", context))
    open_digest = (Notification.objects.select_for_update(no_key=True)
                   .filter(tenant_id=request.tenant_id, kind=DIGEST, recipients=[email],
                           status=NotificationStatus.PENDING)
                   .order_by("pk").first())
    if open_digest is None:
        Notification.objects.create(
            tenant_id=request.tenant_id, kind=DIGEST, recipients=[email],
            subject="[Unwind] Approval requests are waiting for you",
            body_text="(written when it is sent: every request waiting for this address by then)",
            next_attempt_at=timezone.now() + timedelta(seconds=settings.UNWIND_APPROVAL_DIGEST_WINDOW))


def digest_compose(note: Notification, *, now: datetime) -> tuple[list[int], str]:
    """Write the digest's subject and body from the entries for its address whose request still waits `now`,
    withholding the others (each with its reason). Returns the listed entries' ids (to mark sent once the mail is
    out) and "", or no ids and why the digest must not be sent: none of its requests waits any more."""
    pending = list(Notification.objects.filter(
        tenant_id=note.tenant_id, kind=DIGEST_ENTRY, recipients=note.recipients, status=NotificationStatus.PENDING,
        next_attempt_at__isnull=True).select_related("request").order_by("created_at", "pk"))
    if not pending:
        return [], _digest_not_sent(note, "an earlier digest already listed every request that was waiting for "
                                          "this address")
    entries, gone = [], []
    for entry in pending:
        why = no_longer_waiting(entry.request, now=now) if entry.request is not None else ""
        if why:
            Notification.objects.filter(pk=entry.pk, status=NotificationStatus.PENDING).update(
                status=NotificationStatus.WITHHELD, last_error=f"not sent: {why}"[:2000])
            gone.append(why)
        else:
            entries.append(entry)
    if not entries:
        return [], _digest_not_sent(note, "none of the requests it would list waits any more: " + "; ".join(gone))
    context = {"entries": entries, "count": len(entries), "gone": len(gone),
               "after": settings.UNWIND_APPROVAL_DIGEST_AFTER, "window": settings.UNWIND_APPROVAL_DIGEST_WINDOW,
               "base_url": settings.UNWIND_BASE_URL.rstrip("/")}
    note.subject = f"[Unwind] {len(entries)} approval request{'s' if len(entries) != 1 else ''} waiting for you"
    note.body_text = render_to_string("approvals/email/approval_digest.txt", context)
    note.body_html = render_to_string("approvals/email/approval_digest.html", context)
    Notification.objects.filter(pk=note.pk).update(subject=note.subject, body_text=note.body_text,
                                                   body_html=note.body_html)
    return [entry.pk for entry in entries], ""


def _digest_not_sent(note: Notification, reason: str) -> str:
    """The digest's row, rewritten to say it was not sent and why (the outbox lists it so); the reason."""
    reason = reason[:2000]
    note.subject, note.body_text, note.body_html = "[Unwind] Approval digest not sent: nothing waits", reason, ""
    Notification.objects.filter(pk=note.pk).update(subject=note.subject, body_text=note.body_text, body_html="")
    return reason


def on_approval_withdrawn(*, action: Action, reason: str) -> None:
    now = timezone.now()
    with recording(action.tenant_id) as audit:
        for request in ApprovalRequest.objects.filter(action=action, status=ApprovalStatus.PENDING):
            if ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING).update(
                    status=ApprovalStatus.WITHDRAWN, decided_at=now, outcome_reason=reason[:2000]) != 1:
                continue
            request.status, request.decided_at, request.outcome_reason = ApprovalStatus.WITHDRAWN, now, reason[:2000]
            slack.on_request_changed(request.pk)
            audit.record("approval.withdrawn", actor="system:engine", request=request.pk, for_action=action.pk,
                         rows=[request])


def void_reason(tool_name: str, bound: int, current: int | None) -> str:
    if current is None:
        return f"the policy of {tool_name} version {bound} was retired while this waited"
    return f"the policy of {tool_name} changed from version {bound} to {current} while this waited"


def approval_void(*, request: ApprovalRequest, reason: str, actor: str) -> bool:
    """Close a pending request as voided and refuse its action as a rejection would (unwind before the pivot,
    recovery queue after it). In the caller's ledger transaction when there is one. False if it was not pending."""
    with ledger_transaction(request.tenant_id) as audit:
        if ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING).update(
                status=ApprovalStatus.VOIDED, decided_at=timezone.now(), outcome_reason=reason[:4000]) != 1:
            return False
        request.refresh_from_db()
        action = Action.objects.select_related("tool").get(pk=request.action_id)
        slack.on_request_changed(request.pk)
        audit.record("approval.voided", actor=actor, action=action, request=request.pk, tool=action.tool.name,
                     version=action.tool.version, reason=reason[:1000], rows=[request])
        if action.status == ActionStatus.AWAITING_APPROVAL:
            action_reject(action=action, reason=f"approval voided: {reason}", actor=actor, voided=True)
    return True


def on_policy_changed(*, retired: Tool, current: Tool, actor: str) -> None:
    """A tool got a new policy version: every request still waiting under the retired one is voided."""
    waiting = ApprovalRequest.objects.filter(
        Q(tool=retired) | Q(tool__isnull=True, action__tool=retired), status=ApprovalStatus.PENDING)
    for request in waiting.order_by("pk"):
        approval_void(request=request, reason=void_reason(retired.name, retired.version, current.version), actor=actor)


# --- decisions ------------------------------------------------------------------------------------

def is_requester(request: ApprovalRequest, user) -> bool:
    """Separation of duties: whoever asked for the action, or on whose behalf it acts, cannot approve it, under any
    spelling of their address (`approvals.addresses`: NFKC, parsed, the domain without its trailing dot and through
    IDNA, the sub-address and the local part's case as the tenant's defaults say)."""
    if request.requested_by == actor_of(user):
        return True
    tenant = request.tenant
    return names_person(request.run.on_behalf_of, username=user.get_username(), email=user.email,
                        local_part_case_sensitive=tenant.local_part_case_sensitive,
                        subaddress_separators=tenant.subaddress_separators)


def approval_decide(*, request: ApprovalRequest, user, approve: bool, reason: str = "") -> ApprovalRequest:
    """One person's decision. Rejections need a reason; approvals count distinct people up to the quorum."""
    require_role(user, request.tenant_id, Role.APPROVER)
    if not approve and not reason.strip():
        raise ValidationFailed("a rejection needs a reason the agent and the requester will read", field="reason")
    actor = actor_of(user)
    voided = _decide(request=request, user=user, approve=approve, reason=reason, actor=actor)
    if voided:
        # Raised after the commit: the void itself (and the run's rejection path) must stand.
        raise ApprovalVoided(f"this request was voided: {voided}; nothing was approved")
    request.refresh_from_db()
    return request


def _decide(*, request: ApprovalRequest, user, approve: bool, reason: str, actor: str) -> str:
    """`approval_decide` in one ledger transaction. Returns the reason when it voided the request instead."""
    with ledger_transaction(request.tenant_id) as audit:
        request = ApprovalRequest.objects.select_for_update().select_related("action", "run").get(pk=request.pk)
        if request.status == ApprovalStatus.VOIDED:
            raise ApprovalVoided(f"this request was voided: {request.outcome_reason}; nothing to decide")
        if request.status != ApprovalStatus.PENDING:
            raise StateConflict(f"this request is already {request.status}; nothing to decide")
        if request.expires_at <= timezone.now():
            raise StateConflict("this request has expired; the run has gone on without it")
        bound = (Tool.objects.filter(pk=request.tool_id or request.action.tool_id)
                 .values("name", "version", "is_current").get())
        if not bound["is_current"]:
            # A policy change that got here first without voiding the request (it races this decision, or the
            # request predates versioned approvals): what was asked for is no longer what would run.
            current = Tool.objects.filter(tenant_id=request.tenant_id, name=bound["name"], is_current=True).values_list(
                "version", flat=True).first()
            why = void_reason(bound["name"], bound["version"], current)
            approval_void(request=request, reason=why, actor="system:approvals")
            return why
        if is_requester(request, user):
            raise PermissionDenied("you asked for this action (or it acts on your behalf); someone else must decide")
        moves.require(request.run, moves.APPROVER, "approve" if approve else "reject",
                      action_id=request.action_id)
        if request.args_hash != request.action.args_hash:
            raise StateConflict("the action's arguments changed since this request was made; it no longer applies")
        try:
            with transaction.atomic():
                decision = ApprovalDecision.objects.create(
                    request=request, user=user, reason=reason[:4000],
                    decision=Decision.APPROVE if approve else Decision.REJECT)
        except IntegrityError:
            raise StateConflict("you have already decided on this request") from None
        now = timezone.now()
        decided = not approve or request.decisions.filter(
            decision=Decision.APPROVE).values("user").distinct().count() >= request.required
        if decided:
            # In the same transaction: if the action moved on meanwhile, the decision rolls back too.
            status = ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED
            outcome = "" if approve else reason[:4000]
            ApprovalRequest.objects.filter(pk=request.pk).update(status=status, decided_at=now, outcome_reason=outcome)
            request.status, request.decided_at, request.outcome_reason = status, now, outcome
        # The request and the decision are fingerprinted as they now stand, so neither can be edited unseen.
        slack.on_request_changed(request.pk)
        audit.record("approval.approve" if approve else "approval.reject", actor=actor, run=request.run,
                     action=request.action, request=request.pk, reason=reason[:1000], rows=[request, decision])
        if not approve:
            action_reject(action=request.action, reason=reason, actor=actor)
        elif decided:
            action_approve(action=Action.objects.select_related("tool").get(pk=request.action_id),
                           args_hash=request.args_hash, actor=actor)
    return ""


def approvals_expire(*, now=None) -> int:
    """Expire overdue requests: an expiry counts as a rejection, and the run goes on by policy."""
    now = now or timezone.now()
    expired = 0
    for request in ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=now).select_related("action")[:200]:
        with ledger_transaction(request.tenant_id) as audit:
            if ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING).update(
                    status=ApprovalStatus.EXPIRED, decided_at=now, outcome_reason="no decision before it expired") != 1:
                continue
            request.status, request.decided_at = ApprovalStatus.EXPIRED, now
            request.outcome_reason = "no decision before it expired"
            slack.on_request_changed(request.pk)
            audit.record("approval.expired", actor="system:sweeper", action=request.action, request=request.pk,
                         rows=[request])
            action = Action.objects.select_related("tool").get(pk=request.action_id)
            if action.status == ActionStatus.AWAITING_APPROVAL:
                action_reject(action=action, reason=f"no decision within {request.tenant.approval_ttl_seconds}s: expired",
                              actor="system:sweeper", expired=True)
            notify(tenant_id=request.tenant_id, kind="approval_expired", recipients=approvers_emails(request.tenant_id),
                   subject=f"[Unwind] Approval expired: {what_it_is(action)}", template="approvals/email/approval_expired",
                   context={"request": request, "action": action, "url": reverse("approvals:detail", args=[request.pk])})
            expired += 1
    return expired


# --- outbox ---------------------------------------------------------------------------------------

def notification_withhold(*, note: Notification, reason: str) -> bool:
    """Mark a claimed outbox row as not sent, and why. False if it was not ours to mark (its lease was lost)."""
    withheld = Notification.objects.filter(pk=note.pk, status=NotificationStatus.SENDING).update(
        status=NotificationStatus.WITHHELD, last_error=f"not sent: {reason}"[:2000], lease_expires_at=None) == 1
    if withheld:
        log.info("notification %s withheld: %s", note.pk, reason)
    return withheld


def notifications_send(*, now=None) -> int:
    """Send due outbox rows. Each is claimed with a conditional update, so two workers never both send it. A
    message that asks someone to decide a request is checked against the request as it leaves, and withheld
    when the request no longer waits (approvals/waiting.py)."""
    now = now or timezone.now()
    sent = 0
    due = Notification.objects.filter(
        Q(status=NotificationStatus.PENDING, next_attempt_at__lte=now)
        | Q(status=NotificationStatus.SENDING, lease_expires_at__lt=now)).values_list("pk", "status")[:SEND_BATCH]
    for pk, status in list(due):
        lease = now + timedelta(seconds=60)
        if Notification.objects.filter(pk=pk, status=status).update(
                status=NotificationStatus.SENDING, lease_expires_at=lease) != 1:
            continue
        note = Notification.objects.select_related("request").get(pk=pk)
        entries, withhold, moment = [], "", max(now, timezone.now())  # as it leaves, not as the batch began
        if note.kind == DIGEST:
            entries, withhold = digest_compose(note, now=moment)
        elif note.request is not None:
            withhold = no_longer_waiting(note.request, now=moment)
        if withhold:
            notification_withhold(note=note, reason=withhold)
            continue
        # Approval links exist only in the mail as it leaves, never in the stored row (link_service.py).
        message = EmailMultiAlternatives(note.subject, link_service.links_fill(note, note.body_text),
                                         settings.DEFAULT_FROM_EMAIL, note.recipients)
        if note.body_html:
            message.attach_alternative(link_service.links_fill(note, note.body_html), "text/html")
        try:
            message.send(fail_silently=False)
        except Exception as exc:  # noqa: BLE001 - any mail-server failure is retried later, never lost
            attempts = note.attempts + 1
            final = attempts >= MAX_SEND_ATTEMPTS
            Notification.objects.filter(pk=pk, status=NotificationStatus.SENDING).update(
                status=NotificationStatus.FAILED if final else NotificationStatus.PENDING, attempts=attempts,
                last_error=f"{exc.__class__.__name__}: {exc}"[:2000], lease_expires_at=None,
                next_attempt_at=now + timedelta(seconds=min(600, 2 ** attempts)))
            log.warning("notification %s not sent (attempt %s): %s", pk, attempts, exc)
            continue
        Notification.objects.filter(pk=pk, status=NotificationStatus.SENDING).update(
            status=NotificationStatus.SENT, attempts=note.attempts + 1, sent_at=timezone.now(), lease_expires_at=None,
            last_error="")
        Notification.objects.filter(pk__in=entries, status=NotificationStatus.PENDING).update(
            status=NotificationStatus.SENT, sent_at=timezone.now())
        sent += 1
    return sent


def on_sweep(*, now) -> None:
    approvals_expire(now=now)
    notifications_send(now=now)
    slack.slack_messages_post(now=now)


def on_compensation_failed(*, action: Action | None, forward: Action) -> None:
    operators = sorted(set(Membership.objects.filter(tenant_id=forward.tenant_id, role__in=[Role.OPERATOR, Role.ADMIN])
                           .exclude(user__email="").values_list("user__email", flat=True)))
    notify(tenant_id=forward.tenant_id, kind="compensation_failed", recipients=operators,
           subject=f"[Unwind] Compensation failed: {forward.tool.name} in run {forward.run_id}",
           template="approvals/email/compensation_failed", context={"forward": forward, "compensation": action,
                                                    "url": f"/console/runs/{forward.run_id}/"})

