"""Pages behind an emailed approval link, and the endpoint Slack's buttons call.

The link pages need no password and give no session: GET shows the exact preview and one button (a mail
scanner or link preview that fetches the URL changes nothing); only the POST decides, through
clicks.link_use. Token URLs are never cached, indexed or sent to another site as a Referer.
"""
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from approvals import clicks, link_service, selectors, slack
from approvals.models import ApprovalStatus, Decision
from ledger.api.problems import problem
from ledger.errors import UnwindError, ValidationFailed


def _private(response):
    response["Cache-Control"] = "no-store"
    # Same-origin, not no-referrer: under no-referrer browsers POST with `Origin: null`, which CSRF refuses.
    response["Referrer-Policy"] = "same-origin"
    response["X-Robots-Tag"] = "noindex, nofollow"
    return response


def _refused(request, error: UnwindError):
    return _private(render(request, "approvals/link_refused.html",
                           {"title": error.title, "detail": error.detail, "code": error.code}, status=error.status))


def _confirm_page(request, link, decision: str, *, error: str = "", reason: str = "", status: int = 200):
    approval = link.request
    return _private(render(request, "approvals/link_confirm.html", {
        "link": link, "decision": decision, "approval": approval, "preview": approval.preview,
        "view": selectors.preview_view(approval), "error": error, "reason": reason,
    }, status=status))


@require_http_methods(["GET", "POST"])
def confirm(request, token: str):
    try:
        link, decision = link_service.link_find(token)
        if request.method == "GET":
            clicks.link_check(link, browser_user=request.user)
            return _confirm_page(request, link, decision)
        reason = request.POST.get("reason", "").strip()[:4000]
        try:
            decided = clicks.link_use(link=link, decision=decision, browser_user=request.user, reason=reason)
        except ValidationFailed as invalid:  # a rejection without its reason: nothing used, ask again
            return _confirm_page(request, link, decision, error=invalid.detail, reason=reason, status=400)
    except UnwindError as error:
        return _refused(request, error)
    return _private(render(request, "approvals/link_done.html", {
        "approval": decided, "decision": decision, "person": link.user.get_username(),
        "given": decided.decisions.filter(decision=Decision.APPROVE).count(),
        "approved": decided.status == ApprovalStatus.APPROVED}))


@csrf_exempt  # Slack cannot hold a CSRF token; its signature over the raw body stands in for one
@require_POST
def slack_interactions(request):
    """A click on an Approve / Reject button of a Slack message (approvals/slack.py)."""
    try:
        slack.verify(body=request.body, headers=request.headers)
        decided = clicks.slack_decide(payload=request.POST.get("payload", ""))
    except UnwindError as error:
        body = problem(status=error.status, code=error.code, title=error.title, detail=error.detail,
                       instance=request.path, **error.extra)
        return JsonResponse(body, status=error.status, content_type="application/problem+json")
    if decided is None:  # the "Open" link button: Slack opened the page, nothing to decide here
        return JsonResponse({"ok": True})
    return JsonResponse({"ok": True, "status": decided.status})
