"""The approvals API, for programmatic approvers: list, get, approve, reject.

People only: an agent key is refused (separation of duties: agents request, people decide).
Authenticate with HTTP Basic from a script or with the session in the browsable API. The rules
(approver role, not your own request, quorum, expiry, the args hash) live in `approval_decide`.
"""
from __future__ import annotations

from django.urls import reverse
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response

from approvals import selectors
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.services import approval_decide
from ledger.api.auth import PERSON_FIRST, IsPerson
from ledger.api.base import PAGE_PARAMETERS, ApiView, NewestFirst, StrictSerializer, absolute
from ledger.api.problems import problems
from ledger.errors import NotFound
from ledger.models import Risk

TAG = ["approvals"]


def approvals_of_actions(actions) -> dict[int, dict]:
    """The newest approval request of each gated action, for the agent API's answers (one query)."""
    found: dict[int, dict] = {}
    rows = (ApprovalRequest.objects.filter(action_id__in=[action.pk for action in actions])
            .order_by("action_id", "-id").values("id", "action_id", "status", "expires_at"))
    for row in rows:
        if row["action_id"] not in found:
            found[row["action_id"]] = {
                "id": row["id"], "status": row["status"], "expires_at": row["expires_at"],
                "page": reverse("approvals:detail", args=[row["id"]]),
                "api": reverse("approvals-api:detail", args=[row["id"]]),
            }
    return found




class DecisionOut(serializers.Serializer):
    user = serializers.CharField(source="user.username")
    decision = serializers.CharField()
    reason = serializers.CharField()
    created_at = serializers.DateTimeField()


class ApprovalLinksOut(serializers.Serializer):
    self = serializers.URLField()
    page = serializers.URLField(help_text="The approver page with the exact preview.")
    approve = serializers.URLField()
    reject = serializers.URLField()
    action = serializers.URLField(help_text="The gated action in the agent API.")


class ApprovalOut(serializers.Serializer):
    id = serializers.IntegerField()
    status = serializers.ChoiceField(ApprovalStatus.choices)
    tenant = serializers.CharField(source="tenant.slug")
    run = serializers.IntegerField(source="run_id")
    action = serializers.IntegerField(source="action_id")
    tool = serializers.CharField(source="action.tool.name")
    tool_version = serializers.IntegerField(
        source="tool.version", allow_null=True,
        help_text="The version of the tool's policy the request is bound to; a new version while it waits voids it.")
    is_compensation = serializers.BooleanField()
    risk = serializers.ChoiceField(Risk.choices)
    required = serializers.IntegerField(help_text="Distinct approvals needed (quorum).")
    decisions = serializers.SerializerMethodField()
    preview = serializers.JSONField(help_text="What the approver sees: args, target, before-state, compensation, intent.")
    args_hash = serializers.CharField(help_text="The approval binds to exactly these arguments.")
    requested_by = serializers.CharField()
    expires_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()
    decided_at = serializers.DateTimeField(allow_null=True)
    outcome_reason = serializers.CharField()
    links = serializers.SerializerMethodField()


    @extend_schema_field(DecisionOut(many=True))
    def get_decisions(self, approval):
        return DecisionOut(approval.decisions.all(), many=True).data

    @extend_schema_field(ApprovalLinksOut)
    def get_links(self, approval):
        request = self.context.get("request")
        return {
            "self": absolute(request, reverse("approvals-api:detail", args=[approval.pk])),
            "page": absolute(request, reverse("approvals:detail", args=[approval.pk])),
            "approve": absolute(request, reverse("approvals-api:approve", args=[approval.pk])),
            "reject": absolute(request, reverse("approvals-api:reject", args=[approval.pk])),
            "action": absolute(request, reverse("api:action-detail", args=[approval.action_id])),
        }


def member_tenant_ids(user) -> list[int]:
    return [membership.tenant_id for membership in selectors.memberships_of(user)]


def approval_get(user, pk: int) -> ApprovalRequest:
    approval = selectors.approval_for(user, pk)
    if approval is None:
        raise NotFound(f"there is no approval request {pk}")
    return approval


class ApprovalFilterIn(serializers.Serializer):
    status = serializers.ChoiceField([*ApprovalStatus.values, selectors.ANY_STATUS], required=False,
                                     default=ApprovalStatus.PENDING)
    tenant = serializers.SlugField(required=False, max_length=64)
    risk = serializers.ChoiceField(Risk.choices, required=False)
    tool = serializers.CharField(required=False, max_length=120)
    run = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)


class ApprovalListView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]
    pagination_class = NewestFirst

    @extend_schema(tags=TAG, operation_id="approvals_list", summary="List approval requests (pending by default)",
                   parameters=[ApprovalFilterIn, *PAGE_PARAMETERS], responses={200: ApprovalOut(many=True), **problems(400)})
    def get(self, request):
        query = ApprovalFilterIn(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        filters = dict(query.validated_data)
        run = filters.pop("run", None)
        requests = selectors.inbox_requests(tenant_ids=member_tenant_ids(request.user), **filters)
        if run is not None:
            requests = requests.filter(run_id=run)
        requests = requests.prefetch_related("decisions__user")
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(requests, request, view=self)
        return paginator.get_paginated_response(ApprovalOut(page, many=True, context={"request": request}).data)


class ApprovalDetailView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]

    @extend_schema(tags=TAG, operation_id="approvals_get", summary="Get an approval request with its preview",
                   responses={200: ApprovalOut, **problems(404)})
    def get(self, request, pk: int):
        return Response(ApprovalOut(approval_get(request.user, pk), context={"request": request}).data)


class DecisionIn(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=4000,
                                   help_text="Why. Required to reject: the agent and the requester read it.")


DECISION_PROBLEMS = problems(404, 409, body=True, codes={
    400: "validation_error (a rejection needs a reason), parse_error",
    403: "permission_denied (not an approver; your own request or one on your behalf; an agent key)",
    409: "state_conflict (already decided or expired; you already decided; the arguments changed), "
         "approval_voided (the tool's policy changed while the request waited)"})


class ApprovalDecideView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]
    approve = True

    def post(self, request, pk: int):
        approval = approval_get(request.user, pk)
        body = DecisionIn(data=request.data)
        body.is_valid(raise_exception=True)
        approval_decide(request=approval, user=request.user, approve=self.approve,
                        reason=body.validated_data.get("reason", ""))
        return Response(ApprovalOut(approval_get(request.user, pk), context={"request": request}).data)


class ApprovalApproveView(ApprovalDecideView):
    approve = True

    @extend_schema(tags=TAG, operation_id="approvals_approve", summary="Approve",
                   description="Counts towards the quorum; the last approval needed releases the action to run.",
                   request=DecisionIn, responses={200: ApprovalOut, **DECISION_PROBLEMS})
    def post(self, request, pk: int):
        return super().post(request, pk)


class ApprovalRejectView(ApprovalDecideView):
    approve = False

    @extend_schema(tags=TAG, operation_id="approvals_reject", summary="Reject, with a reason",
                   description="Before the pivot the run unwinds; after it, the run goes to the recovery queue.",
                   request=DecisionIn, responses={200: ApprovalOut, **DECISION_PROBLEMS},
                   examples=[OpenApiExample("reject", request_only=True,
                                            value={"reason": "Amount exceeds the customer's plan; charge 49 EUR."})])
    def post(self, request, pk: int):
        return super().post(request, pk)
