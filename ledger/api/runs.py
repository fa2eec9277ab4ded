"""Runs: open (with a declared plan checked against the ordering law), list, get, cancel, complete, and the
run's history for diagnosis: every attempt of its steps and its audit events.

An agent sees and acts on its own runs only (another agent's run answers 404, like a missing one);
people see every run of their tenants.
"""
from __future__ import annotations

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, PolymorphicProxySerializer, \
    extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from ledger.api import selectors
from ledger.archive import reader as archive_reader
from ledger.errors import NotFound, RunArchived
from ledger.api.auth import IsAgent, IsAgentOrMember, caller_of, require_role
from ledger.api.base import PAGE_PARAMETERS, ApiView, InMemory, NewestFirst, OldestFirst, StrictSerializer, absolute
from ledger.api.problems import ARCHIVE_UNAVAILABLE, problems
from ledger.api.serializers import ArchivedRunOut, AttemptOut, EventOut, RunDetailOut, RunOut, archived_out
from ledger.models import Agent, Role, RunStatus
from ledger.engine.runs import run_cancel, run_complete, run_open

TAG = ["runs"]


def run_response(request, run, *, status: int = 200) -> Response:
    run = selectors.run_get(tenant_ids=[run.tenant_id], agent_id=None, run_id=run.pk)  # fresh, with its agent
    context = {"request": request, "actions": selectors.run_actions(run), "checkpoints": selectors.run_checkpoints(run)}
    return Response(RunDetailOut(run, context=context).data, status=status)


def opened_response(request, run) -> Response:
    """201 for a run this request opened, from the run in hand as its opening committed it (as a proposal answers
    from the transaction that recorded it): no step or checkpoint yet, its agent the caller, and no erasure (that
    takes settled runs only). Reading it back cost three ORM queries, three quarters of an opening's CPU."""
    context = {"request": request, "actions": [], "checkpoints": []}
    return Response(RunDetailOut(run, context=context).data, status=201)


class RunOpenIn(StrictSerializer):
    goal = serializers.CharField(required=False, allow_blank=True, max_length=10000,
                                 help_text="What the run is for, in the end user's words.")
    on_behalf_of = serializers.CharField(required=False, allow_blank=True, max_length=200,
                                         help_text="The person the agent acts for (an email or username).")
    intent = serializers.DictField(required=False, help_text="Free metadata: model, trace id, ticket…")
    plan = serializers.ListField(child=serializers.CharField(max_length=120), required=False, max_length=500,
                                 help_text="Tool names in the order the agent means to call them; checked against "
                                           "the ordering law before anything runs.")
    idle_timeout = serializers.IntegerField(
        required=False, help_text="Seconds without agent activity after which the run is unwound (the agent went "
                                  "away): at least 60, at most the tenant's run_idle_timeout (its default).")


class RunFilterIn(serializers.Serializer):
    status = serializers.ChoiceField(RunStatus.choices, required=False)
    agent = serializers.CharField(required=False, max_length=100,
                                  help_text="The agent's name (people; an agent lists its own runs only).")
    since = serializers.DateTimeField(required=False, help_text="Runs opened at or after this time (ISO 8601).")
    archived = serializers.BooleanField(
        required=False, default=False,
        help_text="true: the archived runs instead (docs/archive.md), newest first, as the archive's index knows them "
                  "(id, agent, finished_at, archived); `status` and `since` do not apply to them. Default: the runs "
                  "still in the ledger's hot tables.")

    def validate(self, data):
        if data["archived"]:
            for name in ("status", "since"):
                if name in data:
                    raise serializers.ValidationError({name: [
                        f"does not apply with archived=true: the archive's index does not hold a run's {name}; read "
                        "each run (links.self) for it"]})
        return data


class ArchivedNewestFirst(NewestFirst):
    ordering = "-run_id"


RUN_LIST_ITEM = PolymorphicProxySerializer(
    component_name="RunListItem", serializers=[RunOut, ArchivedRunOut], resource_type_field_name=None, many=True)


class RunListView(ApiView):
    pagination_class = NewestFirst

    def get_permissions(self):
        return [IsAgent()] if self.request.method == "POST" else [IsAgentOrMember()]

    @extend_schema(tags=TAG, operation_id="runs_list", summary="List runs, newest first",
                   description="The runs in the ledger (RunOut); with archived=true the archived ones "
                               "(ArchivedRunOut), read from the archive's index only. An agent lists its own runs; "
                               "people (viewer and up) their tenants'.",
                   parameters=[RunFilterIn, *PAGE_PARAMETERS], responses={200: RUN_LIST_ITEM, **problems(400)})
    def get(self, request):
        query = RunFilterIn(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        caller = caller_of(request)
        filters = dict(query.validated_data)
        if filters.pop("archived"):
            return self.archived(request, caller, agent=filters.get("agent"))
        runs = selectors.run_list(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, **filters)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(runs, request, view=self)
        return paginator.get_paginated_response(RunOut(page, many=True, context={"request": request}).data)

    def archived(self, request, caller, *, agent: str | None):
        entries = archive_reader.archived_runs(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id)
        if agent:
            named = Agent.objects.filter(tenant_id__in=caller.tenant_ids, name=agent).values_list("pk", flat=True)
            entries = entries.filter(agent_id__in=list(named))
        paginator = ArchivedNewestFirst()
        page = paginator.paginate_queryset(entries, request, view=self)
        agents = dict(Agent.objects.filter(pk__in={entry.agent_id for entry in page}).values_list("pk", "name"))
        return paginator.get_paginated_response(ArchivedRunOut(page, many=True, context={
            "request": request, "agents": agents}).data)

    @extend_schema(
        tags=TAG, operation_id="runs_open", summary="Open a run", request=RunOpenIn,
        parameters=[OpenApiParameter(
            "Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER, required=False,
            description="Opening again with the same key (a retry after a lost answer) returns the same run (200).")],
        responses={201: RunDetailOut, 200: OpenApiResponse(RunDetailOut, description="The run this key opened before."),
                   **problems(409, 422, body=True, codes={
                       400: "validation_error (e.g. plan[2] is not a registered tool, idle_timeout above the "
                            "tenant's), parse_error",
                       409: "ordering_violation (rule, conflicts_with)",
                       422: "idempotency_mismatch (the key opened a run with another goal or plan)"})},
        examples=[OpenApiExample("onboarding", request_only=True, value={
            "goal": "Onboard Ashu Kumar", "on_behalf_of": "carol@company.com",
            "plan": ["hr.create_user", "licenses.provision", "email.send"]})],
    )
    def post(self, request):
        caller = caller_of(request)
        body = RunOpenIn(data=request.data)
        body.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key")
        run = run_open(tenant=caller.agent.tenant, agent=caller.agent, actor=caller.actor, idempotency_key=key,
                       **body.validated_data)
        if run.replayed:
            return run_response(request, run, status=200)
        response = opened_response(request, run)
        response["Location"] = absolute(request, reverse("api:run-detail", args=[run.pk]))
        return response


class RunDetailView(ApiView):
    permission_classes = [IsAgentOrMember]

    @extend_schema(tags=TAG, operation_id="runs_get", summary="Get a run with its actions and checkpoints",
                   description="An archived run (docs/archive.md) is read from its segment and carries `archived` "
                               "(when, and the segment's SHA-256).",
                   responses={200: RunDetailOut, **problems(404, 503, codes=ARCHIVE_UNAVAILABLE)})
    def get(self, request, run_id: int):
        caller = caller_of(request)
        try:
            run = selectors.run_get(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
        except NotFound:
            # An archived run answers from its segment, to whoever may read it as a hot run (docs/archive.md).
            return archived_run_response(request, archive_reader.archived_run(
                tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id))
        return run_response(request, run)


def archived_run_response(request, view) -> Response:
    data = RunDetailOut(view.run, context={"request": request, "actions": view.actions,
                                           "checkpoints": view.checkpoints}).data
    data["archived"] = archived_out(view)
    return Response(data)


def refuse_if_archived(caller, run_id: int) -> None:
    """A write to a run that was archived: 409 run_archived, saying so, to those who may read it (anyone else gets
    the 404 of a run that never was, from the caller's own look-up). Only the index is read: nothing is written."""
    entry = archive_reader.archived_entry(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
    if entry is not None:
        raise RunArchived(f"run {run_id} was archived on {entry.archived_at:%Y-%m-%d} (docs/archive.md): it is "
                          f"settled and takes no more writes; read it with GET /api/v1/runs/{run_id}",
                          run_id=run_id, archived=archived_out(entry))


def run_to_write(caller, run_id: int):
    """The run a write names (cancel, complete), or 409 run_archived for an archived one, or 404."""
    try:
        return selectors.run_get(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
    except NotFound:
        refuse_if_archived(caller, run_id)
        raise


class RunCancelIn(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=1000)


class RunCancelView(ApiView):
    permission_classes = [IsAgentOrMember]

    @extend_schema(
        tags=TAG, operation_id="runs_cancel", summary="Cancel a run",
        description="Starts nothing new; unwinds what was done before the pivot (newest first); after the pivot, "
                    "the run goes to the recovery queue. Cancelling twice is harmless. An agent cancels its own runs; "
                    "people need the operator role.",
        request=RunCancelIn,
        responses={200: RunDetailOut, **problems(404, 409, body=True, codes={
            409: "state_conflict (already finished), run_archived (run_id, archived)"})},
    )
    def post(self, request, run_id: int):
        caller = caller_of(request)
        run = run_to_write(caller, run_id)
        require_role(caller, run.tenant_id, Role.OPERATOR)
        body = RunCancelIn(data=request.data)
        body.is_valid(raise_exception=True)
        run = run_cancel(run=run, actor=caller.actor, reason=body.validated_data.get("reason", ""))
        return run_response(request, run)


class RunCompleteView(ApiView):
    permission_classes = [IsAgent]

    @extend_schema(
        tags=TAG, operation_id="runs_complete", summary="Complete a run",
        description="The agent is done: every step succeeded. Completing twice is harmless.", request=None,
        responses={200: RunDetailOut, **problems(404, 409, codes={
            409: "state_conflict (a step is still pending, or the run is not running), run_archived (run_id, "
                 "archived)"})},
    )
    def post(self, request, run_id: int):
        caller = caller_of(request)
        run = run_to_write(caller, run_id)
        return run_response(request, run_complete(run=run, actor=caller.actor))


class HistoryPages(OldestFirst):
    """A run's history, oldest first; a page of an archived run's also carries `archived` (`history_page`)."""

    def get_paginated_response_schema(self, schema):
        answer = super().get_paginated_response_schema(schema)
        answer["properties"]["archived"] = {
            "type": "object", "description": "Only when the run was read from the archive (docs/archive.md).",
            "required": ["at", "segment"],
            "properties": {"at": {"type": "string", "format": "date-time", "description": "When it was archived."},
                           "segment": {"type": "string", "description": "The SHA-256 of the segment holding it."}}}
        return answer


class EventsInChainOrder(HistoryPages):
    ordering = "seq"


def history_page(view: ApiView, request, run_id: int, rows_of, archived_rows_of, serializer) -> Response:
    """One page of a run's history, scoped like the run itself: an agent reads its own runs' only. An archived run's
    is read from its segment (`archived_rows_of` its ArchivedRunView), paged alike, and marked `archived`."""
    caller = caller_of(request)
    archived = None
    try:
        rows = rows_of(selectors.run_get(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id))
    except NotFound:
        archived = archive_reader.archived_run(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
        rows = InMemory(archived_rows_of(archived))
    paginator = view.pagination_class()
    page = paginator.paginate_queryset(rows, request, view=view)
    response = paginator.get_paginated_response(serializer(page, many=True).data)
    if archived is not None:
        response.data["archived"] = archived_out(archived)
    return response


HISTORY_OF_ARCHIVED = ("An archived run's (docs/archive.md) is read from its segment, to the same callers, and the "
                       "page carries `archived` (when, and the segment's SHA-256); 503 archive_unavailable when the "
                       "segment cannot be read or no longer hashes to its name.")


class RunAttemptsView(ApiView):
    permission_classes = [IsAgentOrMember]
    pagination_class = HistoryPages

    @extend_schema(tags=TAG, operation_id="runs_attempts", summary="Every attempt of a run's steps, oldest first",
                   description="Each try of each step (forward steps and compensations): how it ended, the error "
                               "class and message, and its latency. An agent reads its own runs' attempts; people "
                               "(viewer and up) their tenants'. " + HISTORY_OF_ARCHIVED,
                   parameters=PAGE_PARAMETERS,
                   responses={200: AttemptOut(many=True), **problems(400, 404, 503, codes=ARCHIVE_UNAVAILABLE)})
    def get(self, request, run_id: int):
        return history_page(self, request, run_id, selectors.run_attempts, lambda view: view.attempts, AttemptOut)


class RunEventsView(ApiView):
    permission_classes = [IsAgentOrMember]
    pagination_class = EventsInChainOrder

    @extend_schema(tags=TAG, operation_id="runs_events", summary="A run's audit events, in chain order",
                   description="The events the tenant's audit chain ties to the run: its transitions and its actions'. "
                               "The chain's hashes and row fingerprints are not shown (verify_audit checks them). "
                               "An agent reads its own runs' events; people (viewer and up) their tenants'. "
                               + HISTORY_OF_ARCHIVED,
                   parameters=PAGE_PARAMETERS,
                   responses={200: EventOut(many=True), **problems(400, 404, 503, codes=ARCHIVE_UNAVAILABLE)})
    def get(self, request, run_id: int):
        return history_page(self, request, run_id, selectors.run_events, lambda view: view.events, EventOut)
