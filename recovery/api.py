"""The recovery API for programmatic operators, the correction trail for agents and people, and /metrics.

Recovery items are for people (an agent key is refused): list, get, and the three decisions — resume,
compensate, close — whose rules (operator role, the item still open) live in `recovery.services`.
"""
from __future__ import annotations

from datetime import timedelta

from django.db.models import Count
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import renderers, serializers
from rest_framework.response import Response

from approvals.models import ApprovalRequest, ApprovalStatus
from ledger.api import selectors as ledger_selectors
from ledger.api.auth import PERSON_FIRST, IsAgentOrMember, IsPerson, IsStaff, caller_of
from ledger.api.base import PAGE_PARAMETERS, ApiView, NewestFirst, StrictSerializer, absolute
from ledger.api.problems import problems
from ledger.engine import moves
from ledger.errors import NotFound
from ledger.models import Action, Risk, Run, RunStatus, Tenant
from recovery import selectors, services
from recovery.metrics import percentile, unwind_latencies
from recovery.models import ItemStatus, Reason, RecoveryItem, Resolution
from recovery.trail import correction_trail

TAG = ["recovery"]


# --- recovery items ------------------------------------------------------------------------------------------

class ItemLinksOut(serializers.Serializer):
    self = serializers.URLField()
    page = serializers.URLField(help_text="The item in the operator console.")
    run = serializers.URLField(help_text="The run in the agent API.")
    resume = serializers.URLField()
    compensate = serializers.URLField()
    close = serializers.URLField()


class RecoveryItemOut(serializers.Serializer):
    id = serializers.IntegerField()
    status = serializers.ChoiceField(ItemStatus.choices)
    tenant = serializers.CharField(source="tenant.slug")
    run = serializers.IntegerField(source="run_id")
    run_status = serializers.ChoiceField(RunStatus.choices, source="run.status")
    action = serializers.IntegerField(source="action_id", allow_null=True)
    reason = serializers.ChoiceField(Reason.choices)
    reason_text = serializers.CharField(source="get_reason_display")
    risk = serializers.ChoiceField(Risk.choices)
    tool = serializers.CharField(source="tool_name")
    detail = serializers.CharField(help_text="What is left, step by step.")
    suggestion = serializers.CharField()
    resolution = serializers.ChoiceField(Resolution.choices, allow_blank=True)
    resolved_by = serializers.CharField()
    resolution_note = serializers.CharField()
    created_at = serializers.DateTimeField()
    resolved_at = serializers.DateTimeField(allow_null=True)
    links = serializers.SerializerMethodField()

    @extend_schema_field(ItemLinksOut)
    def get_links(self, item):
        request = self.context.get("request")
        found = {operation: absolute(request, reverse(f"recovery-api:{operation}", args=[item.pk]))
                 for operation in ("resume", "compensate", "close")}
        return found | {
            "self": absolute(request, reverse("recovery-api:detail", args=[item.pk])),
            "page": absolute(request, reverse("recovery:item", args=[item.pk])),
            "run": absolute(request, reverse("api:run-detail", args=[item.run_id])),
        }


class MoveOut(serializers.Serializer):
    name = serializers.ChoiceField(["resume", "compensate", "close"])
    allowed = serializers.BooleanField()
    label = serializers.CharField(help_text="The button's words on the console.")
    does = serializers.CharField(source="staff_words", help_text="What the move will do, step by step.")
    refusal = serializers.CharField(help_text="Why it is not offered (409 with this sentence if tried).")
    url = serializers.SerializerMethodField()

    def get_url(self, move) -> str | None:
        request, item = self.context.get("request"), self.context["item"]
        return absolute(request, reverse(f"recovery-api:{move.name}", args=[item.pk])) if move.allowed else None


class RecoveryItemDetailOut(RecoveryItemOut):
    moves = serializers.SerializerMethodField(help_text=(
        "The decisions on this item, from the one model of legal moves the engine obeys: each allowed or refused "
        "with its sentence, and what it will do."))

    @extend_schema_field(MoveOut(many=True))
    def get_moves(self, item):
        if item.status != ItemStatus.OPEN:
            return []
        offered = moves.run_moves(item.run)
        return MoveOut([offered.get(moves.OPERATOR, name) for name in ("resume", "compensate", "close")], many=True,
                       context={**self.context, "item": item}).data


def item_get(user, pk: int) -> RecoveryItem:
    item = selectors.item_get(access=selectors.access_for(user), pk=pk)
    if item is None:
        raise NotFound(f"there is no recovery item {pk}")
    return item


class ItemFilterIn(serializers.Serializer):
    status = serializers.ChoiceField([*ItemStatus.values, "all"], required=False, default=ItemStatus.OPEN)
    reason = serializers.ChoiceField(Reason.choices, required=False)
    risk = serializers.ChoiceField(Risk.choices, required=False)
    tenant = serializers.SlugField(required=False, max_length=64)
    run = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)


class RecoveryItemListView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]
    pagination_class = NewestFirst

    @extend_schema(tags=TAG, operation_id="recovery_items_list", summary="List recovery items (open by default)",
                   parameters=[ItemFilterIn, *PAGE_PARAMETERS], responses={200: RecoveryItemOut(many=True), **problems(400)})
    def get(self, request):
        query = ItemFilterIn(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        filters = query.validated_data
        access = selectors.access_for(request.user)
        items = selectors.queue_filter(access=access, status=filters["status"], risk=filters.get("risk", ""))
        if filters.get("reason"):
            items = items.filter(reason=filters["reason"])
        if filters.get("tenant"):
            items = items.filter(tenant__slug=filters["tenant"])
        if filters.get("run"):
            items = items.filter(run_id=filters["run"])
        items = items.select_related("tenant", "run")
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(items, request, view=self)
        return paginator.get_paginated_response(RecoveryItemOut(page, many=True, context={"request": request}).data)


class RecoveryItemDetailView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]

    @extend_schema(tags=TAG, operation_id="recovery_items_get", summary="Get a recovery item",
                   responses={200: RecoveryItemDetailOut, **problems(404)})
    def get(self, request, pk: int):
        return Response(RecoveryItemDetailOut(item_get(request.user, pk), context={"request": request}).data)


class ResolveIn(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=4000,
                                   help_text="Why: kept in the audit chain. Required to close.")


RESOLVE_PROBLEMS = problems(404, 409, body=True, codes={
    400: "validation_error (closing needs a reason), parse_error",
    403: "permission_denied (needs the operator role; an agent key)",
    409: "state_conflict (already resolved; the run cannot take this decision)"})


class RecoveryResolveView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsPerson]
    resolve = None  # the recovery service each subclass applies

    def post(self, request, pk: int):
        item = item_get(request.user, pk)
        body = ResolveIn(data=request.data)
        body.is_valid(raise_exception=True)
        self.resolve(item=item, user=request.user, reason=body.validated_data.get("reason", ""))
        return Response(RecoveryItemOut(item_get(request.user, pk), context={"request": request}).data)


class RecoveryResumeView(RecoveryResolveView):
    resolve = staticmethod(services.recovery_resume)

    @extend_schema(tags=TAG, operation_id="recovery_items_resume", summary="Resume the run",
                   description="Retries the failed or lost steps from the last checkpoint, with their same "
                               "idempotency keys.", request=ResolveIn, responses={200: RecoveryItemOut, **RESOLVE_PROBLEMS})
    def post(self, request, pk: int):
        return super().post(request, pk)


class RecoveryCompensateView(RecoveryResolveView):
    resolve = staticmethod(services.recovery_compensate)

    @extend_schema(tags=TAG, operation_id="recovery_items_compensate", summary="Compensate the run",
                   description="Unwinds newest-first, retrying failed compensations (a drift item overwrites the "
                               "target: a person looked and decided).", request=ResolveIn,
                   responses={200: RecoveryItemOut, **RESOLVE_PROBLEMS})
    def post(self, request, pk: int):
        return super().post(request, pk)


class RecoveryCloseView(RecoveryResolveView):
    resolve = staticmethod(services.recovery_close)

    @extend_schema(tags=TAG, operation_id="recovery_items_close", summary="Close the run as handled",
                   description="Marks what is left as handled by hand; pending steps are skipped.",
                   request=ResolveIn, responses={200: RecoveryItemOut, **RESOLVE_PROBLEMS})
    def post(self, request, pk: int):
        return super().post(request, pk)


# --- the correction trail ------------------------------------------------------------------------------------

STATEMENT_KINDS = ["changed", "restored", "corrected", "not_undone", "reviewed", "pending"]


class StatementOut(serializers.Serializer):
    kind = serializers.ChoiceField(STATEMENT_KINDS)
    text = serializers.CharField()


class TrailAuditOut(serializers.Serializer):
    events = serializers.IntegerField()
    verified = serializers.BooleanField(help_text="The run's audit events hash-verify.")
    reference = serializers.CharField()


class TrailOut(serializers.Serializer):
    run = serializers.IntegerField()
    status = serializers.ChoiceField(RunStatus.choices)
    headline = serializers.CharField()
    statements = StatementOut(many=True)
    reviewed_by = serializers.ListField(child=serializers.CharField())
    audit = TrailAuditOut()


class RunTrailView(ApiView):
    permission_classes = [IsAgentOrMember]

    @extend_schema(tags=["runs"], operation_id="runs_trail", summary="The run's correction trail",
                   description="What the agent changed for the end user and what became of it, in plain language, "
                               "derived from the ledger alone.",
                   responses={200: TrailOut, **problems(404)})
    def get(self, request, run_id: int):
        caller = caller_of(request)
        run = ledger_selectors.run_get(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
        return Response(TrailOut(correction_trail(run)).data)


# --- /metrics ------------------------------------------------------------------------------------------------

LATENCY_WINDOW = timedelta(hours=24)
QUANTILES = (0.5, 0.9, 0.99)


class PrometheusRenderer(renderers.BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, str):
            return data.encode(self.charset)
        return renderers.JSONRenderer().render(data)  # a refusal: the problem as JSON


def label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def gauge(name: str, help_text: str, rows: list[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    for labels, value in rows:
        inner = ",".join(f'{key}="{label(val)}"' for key, val in labels.items())
        lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")
    return lines


def prometheus_text(now=None) -> str:
    """Every metric in the Prometheus text format (version 0.0.4), a fixed handful of grouped queries."""
    now = now or timezone.now()
    slugs = dict(Tenant.objects.values_list("id", "slug"))
    actions = (Action.objects.order_by().values_list("tenant_id", "tool__name", "kind", "status")
               .annotate(n=Count("id")))
    runs = Run.objects.order_by().values_list("tenant_id", "status").annotate(n=Count("id"))
    items = (RecoveryItem.objects.filter(status=ItemStatus.OPEN).order_by().values_list("tenant_id", "reason")
             .annotate(n=Count("id")))
    approvals = (ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).order_by().values_list("tenant_id")
                 .annotate(n=Count("id")))
    latencies, stuck = unwind_latencies(tenant_ids=list(slugs), since=now - LATENCY_WINDOW)
    lines = [
        *gauge("unwind_actions", "Ledger actions by tenant, tool, kind and status.",
               [({"tenant": slugs.get(t), "tool": tool, "kind": kind, "status": status}, n)
                for t, tool, kind, status, n in actions]),
        *gauge("unwind_runs", "Runs by tenant and status.",
               [({"tenant": slugs.get(t), "status": status}, n) for t, status, n in runs]),
        *gauge("unwind_recovery_items_open", "Open recovery items by tenant and reason.",
               [({"tenant": slugs.get(t), "reason": reason}, n) for t, reason, n in items]),
        *gauge("unwind_approvals_pending", "Approval requests waiting for a decision, by tenant.",
               [({"tenant": slugs.get(t)}, n) for t, n in approvals]),
        *gauge("unwind_unwinds_stuck", "Unwinds of the last 24 hours that ended needing a person.", [({}, stuck)]),
        "# HELP unwind_unwind_seconds Seconds from the start of an unwind to its end, over the last 24 hours.",
        "# TYPE unwind_unwind_seconds summary",
        *[f'unwind_unwind_seconds{{quantile="{q}"}} {percentile(latencies, q * 100) if latencies else "NaN"}'
          for q in QUANTILES],
        f"unwind_unwind_seconds_sum {sum(latencies)}",
        f"unwind_unwind_seconds_count {len(latencies)}",
    ]
    return "\n".join(lines) + "\n"


class MetricsView(ApiView):
    authentication_classes = PERSON_FIRST
    permission_classes = [IsStaff]
    renderer_classes = [PrometheusRenderer, renderers.JSONRenderer]

    @extend_schema(tags=["health"], operation_id="metrics", summary="Prometheus metrics (staff only)",
                   description="Gauges of actions, runs, open recovery items and pending approvals, and a summary "
                               "of unwind latency. Covers every tenant, so it needs a staff user (HTTP Basic).",
                   responses={(200, "text/plain"): OpenApiResponse(OpenApiTypes.STR, description="Text format 0.0.4"),
                              **problems()})
    def get(self, request):
        return Response(prometheus_text(), content_type="text/plain; version=0.0.4; charset=utf-8")
