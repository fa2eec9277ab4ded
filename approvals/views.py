"""Approver pages: the inbox and one request's exact preview with its decision panel.

Pages are server-rendered; htmx polls the inbox's rows and swaps the decision panel in place. Every
form also works as a plain POST without JavaScript.
"""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from approvals import selectors
from approvals.forms import DecisionForm, InboxFilterForm
from approvals.models import ApprovalRequest, ApprovalStatus, Decision
from approvals.services import approval_decide, require_role
from ledger.engine import moves
from ledger.errors import UnwindError
from ledger.models import Action, ActionStatus, Role, RunStatus


@login_required
@require_GET
def inbox(request):
    memberships = selectors.memberships_of(request.user)
    tenant_ids = [m.tenant_id for m in memberships]
    form = InboxFilterForm(request.GET, tenants=[m.tenant for m in memberships],
                           tool_names=selectors.tool_names(tenant_ids=tenant_ids))
    filters = form.filters()
    page = Paginator(selectors.inbox_requests(tenant_ids=tenant_ids, **filters), selectors.INBOX_PAGE_SIZE).get_page(
        request.GET.get("page"))
    context = {"form": form, "filters": filters, "page": page, "requests": page.object_list,
               "many_tenants": len(memberships) > 1, "now": timezone.now()}
    template = "approvals/_inbox_rows.html" if request.htmx else "approvals/inbox.html"
    return render(request, template, context)


@login_required
@require_GET
def request_detail(request, pk: int):
    return render(request, "approvals/detail.html", detail_context(request, _approval_or_404(request.user, pk)))


@login_required
@require_POST
def request_decide(request, pk: int):
    approval = _approval_or_404(request.user, pk)
    form = DecisionForm(request.POST)
    try:
        require_role(request.user, approval.tenant_id, Role.APPROVER)
        if not form.is_valid():
            return _refused(request, approval, form=form, error="", status=400)
        decided = approval_decide(request=approval, user=request.user, approve=form.approve,
                                  reason=form.cleaned_data["reason"])
    except UnwindError as error:
        return _refused(request, approval, form=form, error=error.detail, status=error.status)
    notice = _outcome_sentence(decided, approved=form.approve)
    if request.htmx:
        approval = _approval_or_404(request.user, pk)
        return render(request, "approvals/_decision_response.html", detail_context(request, approval, notice=notice))
    messages.success(request, notice)
    return redirect("approvals:detail", pk=pk)


def _approval_or_404(user, pk: int) -> ApprovalRequest:
    approval = selectors.approval_for(user, pk)
    if approval is None:
        raise Http404("No such approval request")
    return approval


def detail_context(request, approval: ApprovalRequest, *, form: DecisionForm | None = None, error: str = "",
                   notice: str = "") -> dict:
    return {
        "approval": approval,
        "preview": approval.preview,
        "view": selectors.preview_view(approval),
        "state": selectors.decision_state(approval, request.user),
        "steps": selectors.run_steps(approval.run_id),
        "may_stop": selectors.may_stop_held(approval, request.user),
        "reject_move": moves.run_moves(approval.run).get(moves.APPROVER, "reject", approval.action_id)
        if approval.status == "pending" else None,
        "form": form or DecisionForm(),
        "error": error,
        "notice": notice,
    }


def _refused(request, approval: ApprovalRequest, *, form: DecisionForm, error: str, status: int):
    """A refusal says why, in the decision panel (htmx) or on the page (plain POST), with its HTTP status."""
    approval = _approval_or_404(request.user, approval.pk)  # as it stands now, after whatever refused us
    context = detail_context(request, approval, form=form, error=error)
    template = "approvals/_decision_response.html" if request.htmx else "approvals/detail.html"
    return render(request, template, context, status=status)


def _outcome_sentence(approval: ApprovalRequest, *, approved: bool) -> str:
    run = approval.run
    run.refresh_from_db(fields=["status"])
    if approved and approval.status == ApprovalStatus.APPROVED:
        held = Action.objects.filter(pk=approval.action_id, status=ActionStatus.HELD).values_list(
            "next_attempt_at", flat=True).first()
        if held is not None:
            return (f"Approved. Its tool holds it until {held:%H:%M:%S} UTC (an undo window): it runs then unless "
                    f"someone stops it, and you can stop it on this page until then.")
        return "Approved. Unwind runs the action now; the run continues in the background."
    if approved:
        given = approval.decisions.filter(decision=Decision.APPROVE).count()
        return f"Your approval is recorded ({given} of {approval.required}). It runs once enough people approve."
    if approval.is_compensation:
        return "Rejected. That step stays as it is; the run goes to the recovery queue for an operator."
    if run.status == RunStatus.NEEDS_ATTENTION:
        return "Rejected. The run had passed its pivot, so it waits in the recovery queue for an operator."
    return "Rejected. The agent is told your reason, and Unwind undoes the run's earlier steps, newest first."
