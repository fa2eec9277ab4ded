from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render

from approvals.models import ApprovalRequest


@login_required
def request_detail(request, pk: int):
    approval = ApprovalRequest.objects.filter(pk=pk, tenant__memberships__user=request.user).select_related("action__tool", "run").first()
    if approval is None:
        raise Http404("No such approval request")
    return render(request, "approvals/detail.html", {"approval": approval})
