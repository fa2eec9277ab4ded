"""The correction trail's pages: the share page the person acted for reads (with its Stop and ask forms), the
links and emails that reach them, stopping a held step, and the operator's reply to a customer's request.
"""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from ledger.api import selectors as ledger_selectors
from ledger.errors import NotFound, PermissionDenied, StateConflict, UnwindError, ValidationFailed
from ledger.archive.chain import instance as archived_instance
from ledger.models import Run
from recovery.models import CustomerRequest
from recovery import requests as customer_requests, selectors, stops, views
from recovery.trail import (
    correction_trail,
    trail_link_create,
    trail_link_erased,
    trail_link_open,
    trail_archived_open,
    trail_link_revoke,
    trail_send,
    trail_share_url,
)


@login_required
@require_POST
def trail_link_new(request, pk: int):
    """Make a share link to the run's trail and show its URL, this once (only its hash is kept)."""
    access, run = views.run_or_404(request, pk)
    try:
        _, token = trail_link_create(run=run, user=request.user)
    except PermissionDenied:
        return views.forbidden(request, f"Sharing the correction trail needs the operator role in {run.tenant.slug}; "
                                   f"you are {access.roles.get(run.tenant_id)}.")
    # Rendered, not redirected: the URL exists nowhere else, and must not travel through a cookie or a log.
    return views.run_page(request, access, run, new_link_url=request.build_absolute_uri(trail_share_url(token)))


@login_required
@require_POST
def trail_link_revoke_view(request, pk: int, link_id: int):
    """Revoke a share link: whoever holds it gets the not-found page from now on."""
    access, run = views.run_or_404(request, pk)
    try:
        trail_link_revoke(run=run, link_id=link_id, user=request.user)
    except PermissionDenied:
        return views.forbidden(request, f"Revoking a share link needs the operator role in {run.tenant.slug}; "
                                   f"you are {access.roles.get(run.tenant_id)}.")
    except NotFound:
        raise Http404("No such share link") from None
    messages.success(request, "The share link is revoked: it no longer opens the trail.")
    return redirect(reverse("recovery:run", args=[run.pk]) + "#trail")


@login_required
@require_POST
def trail_email(request, pk: int):
    """Send the trail's share link to the person the run acted for."""
    access, run = views.run_or_404(request, pk)
    try:
        recipient = trail_send(run=run, user=request.user)
    except PermissionDenied:
        return views.forbidden(request, f"Sending the correction trail needs the operator role in {run.tenant.slug}; "
                                   f"you are {access.roles.get(run.tenant_id)}.")
    except ValidationFailed as refusal:
        messages.error(request, f"Not sent: {refusal.detail}.")
        return redirect("recovery:run", pk=run.pk)
    messages.success(request, f"The correction trail is on its way to {recipient}.")
    return redirect("recovery:run", pk=run.pk)


def trail_share(request, token: str):
    """The correction trail for someone without an account, behind a random link that expires and can be revoked."""
    run = trail_link_open(token)
    if run is None:
        archived = trail_archived_open(token)
        if archived is not None:
            return _archived_share_page(request, archived)
        # One answer for an unknown, expired or revoked link: the page must not help anyone guess.
        return _link_refused(request, token)
    return _share_page(request, run, token)


def _archived_share_page(request, view):
    """The trail of an archived run (docs/archive.md), read from its segment: the same account, nothing to stop or
    ask any more."""
    asked = [archived_instance(CustomerRequest, row) for row in view.rows.get("recovery.customerrequest", [])]
    response = render(request, "recovery/trail_share.html", {
        "run": view.run, "trail": correction_trail(view.run, actions=view.actions, events=view.events),
        "stoppable": [], "token": "", "can_ask": False, "askable": [], "can_undo": False,
        "requests": sorted(asked, key=lambda r: r.created_at, reverse=True), "ask_error": "", "asked": {},
        "archived_at": view.archived_at})
    response["X-Robots-Tag"] = "noindex"
    response["Referrer-Policy"] = "no-referrer"
    return response


def _share_page(request, run: Run, token: str, *, ask_error: str = "", status: int = 200, asked: dict | None = None):
    stoppable = stops.customer_stoppable(run)
    can_ask = customer_requests.window_open(run)
    response = render(request, "recovery/trail_share.html", {
        "run": run, "trail": correction_trail(run), "stoppable": stoppable, "token": token,
        "can_ask": can_ask, "askable": customer_requests.askable_steps(run) if can_ask else [],
        "can_undo": bool(customer_requests.undoable_steps(run)) if can_ask else False,
        "requests": customer_requests.requests_for(run), "ask_error": ask_error, "asked": asked or {},
        "max_text": customer_requests.MAX_TEXT}, status=status)
    response["X-Robots-Tag"] = "noindex"
    # The link never leaves in a Referer. With a Stop form on the page, same-origin: a browser then sends the form's
    # POST with its real Origin (no-referrer makes it "null", which the CSRF check rightly refuses), and still no
    # Referer to any other site.
    response["Referrer-Policy"] = "same-origin" if stoppable or can_ask else "no-referrer"
    return response


@login_required
@require_POST
def hold_stop(request, pk: int):
    """Stop a held step: an operator of its tenant, or an approver who approved it (recovery/stops.py)."""
    access = selectors.access_for(request.user)
    try:
        action = ledger_selectors.action_get(tenant_ids=access.tenant_ids, agent_id=None, action_id=pk)
    except NotFound:
        raise Http404("No such step") from None
    try:
        stopped = stops.stop_as_person(action=action, user=request.user, reason=request.POST.get("reason", "")[:500])
    except PermissionDenied:
        return views.forbidden(request, "Stopping a held step needs the operator role in its tenant, or to have approved "
                                   "that step.")
    except StateConflict as conflict:
        messages.error(request, f"Not stopped: {conflict.detail}.")
    else:
        messages.success(request, f"Step {stopped.seq} ({stopped.tool.name}) is stopped: it will not be executed.")
    return redirect(reverse("recovery:run", args=[action.run_id]) + f"#action-{action.pk}")


@require_POST
def trail_share_stop(request, token: str, action_id: int):
    """The person the run acts for stops a held step from the trail's share page (where its policy allows)."""
    try:
        stops.stop_as_customer(token=token, action_id=action_id)
    except NotFound:
        return _link_refused(request, token)
    except PermissionDenied as refused:
        return render(request, "recovery/refused.html", {"title": "Not allowed", "detail": refused.detail}, status=403)
    except StateConflict:
        pass  # it ran (or was stopped) first: the page says which
    return redirect(reverse("recovery:trail_share", args=[token]) + "#trail")


@require_POST
def trail_share_ask(request, token: str):
    """The person the run acts for asks for a correction from the share page (recovery/requests.py)."""
    raw_action = request.POST.get("action", "")
    asked = {"kind": request.POST.get("kind", ""), "text": request.POST.get("text", ""), "action": raw_action}
    try:
        customer_requests.customer_request_open(
            token=token, action_id=int(raw_action) if raw_action.isdigit() else None,
            kind=asked["kind"], text=asked["text"])
    except NotFound:
        return _link_refused(request, token)
    except UnwindError as refused:
        link = customer_requests.live_link(token)
        if link is None:
            return _link_refused(request, token)
        run = link.run
        return _share_page(request, run, token, ask_error=_sentence_of(refused.detail), status=refused.status,
                           asked=asked)
    return redirect(reverse("recovery:trail_share", args=[token]) + "#requests")


def _sentence_of(text: str) -> str:
    return (text[:1].upper() + text[1:]).rstrip(".") + "."


@login_required
@require_POST
def customer_request_reply_view(request, pk: int):
    """An operator answers a customer's request: the share page shows it and the person gets an email."""
    try:
        asked = customer_requests.request_get(user=request.user, pk=pk)
    except NotFound:
        raise Http404("No such request") from None
    back = reverse("recovery:run", args=[asked.run_id]) if asked.item_id is None else \
        reverse("recovery:item", args=[asked.item_id]) + "#customer-requests"
    try:
        customer_requests.customer_request_reply(request=asked, user=request.user, text=request.POST.get("reply", ""))
    except PermissionDenied:
        return views.forbidden(request, "Answering a customer's request needs the operator role in its tenant.")
    except (ValidationFailed, StateConflict) as refused:
        messages.error(request, f"Not sent: {refused.detail}.")
    else:
        messages.success(request, "Your reply is on the customer's trail page, and an email tells them.")
    return redirect(back)


def _link_refused(request, token: str):
    """The answer to a share link that opens nothing: 410 for a run whose person's data was erased (the holder had
    the link, and is told why it ends), otherwise the one 404 of every unknown, expired or revoked link."""
    erased_at = trail_link_erased(token)
    if erased_at is not None:
        response = render(request, "recovery/refused.html", {
            "title": "Correction trail erased",
            "detail": f"This correction trail was erased on {erased_at:%Y-%m-%d} at the person's request: "
                      "it no longer exists, and this link no longer opens anything."}, status=410)
    else:
        response = _trail_missing(request, "This link does not open a correction trail. "
                                           "Ask the person who shared it for a new one.")
    response["X-Robots-Tag"] = "noindex"
    return response


def _trail_missing(request, sentence: str):
    return render(request, "recovery/refused.html", {"title": "Correction trail not found", "detail": sentence},
                  status=404)
