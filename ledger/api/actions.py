"""Actions: propose (the fast path), get, wait for the outcome, report a client-executed outcome, and the
compensations of client-executed tools that wait for the agent."""
from __future__ import annotations

import time

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from ledger.api import selectors
from ledger.api import inline, waits
from ledger.api.auth import IsAgent, IsAgentOrMember, caller_of
from ledger.api.base import PAGE_PARAMETERS, ApiView, NewestFirst, StrictSerializer
from ledger.api.problems import ARCHIVE_UNAVAILABLE, problem, problems
from ledger.api.runs import refuse_if_archived
from ledger.api.serializers import ActionOut, action_context, archived_out
from ledger.archive import reader as archive_reader
from ledger.errors import NotFound, RunArchived
from ledger.models import ACTIVE_ACTION_STATUSES, Action, ActionStatus, RunStatus
from ledger.engine.proposal import action_propose
from ledger.engine.actions import action_report
from ledger.engine.attempts import REFUSED

MAX_WAIT = 30.0
TAG = ["actions"]


def action_response(request, action: Action, *, status: int = 200, shape=ActionOut, **context) -> Response:
    data = shape(action, context={**action_context(request, [action]), **context}).data
    return Response(data, status=status)


def fresh(request, action_id: int) -> Action:
    """The action, if the caller may see it: an agent only in its own runs, a person in their tenants."""
    caller = caller_of(request)
    return selectors.action_get(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, action_id=action_id)


def archived_action_response(request, action_id: int) -> Response:
    """A step of an archived run, read from its segment for whoever may read that run, marked `archived`; or the
    404 of a step that never was."""
    caller = caller_of(request)
    view, action = archive_reader.archived_action(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id,
                                                  action_id=action_id)
    response = action_response(request, action)
    response.data["archived"] = archived_out(view)
    return response


def fresh_to_write(request, action_id: int) -> Action:
    """The action a write names (a report), or 409 run_archived when its run was archived, or 404."""
    try:
        return fresh(request, action_id)
    except NotFound:
        caller = caller_of(request)
        entry = archive_reader.archived_action_entry(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id,
                                                     action_id=action_id)
        if entry is not None:
            raise RunArchived(f"action {action_id} is a step of run {entry.run_id}, archived on "
                              f"{entry.archived_at:%Y-%m-%d} (docs/archive.md): it is settled and takes no more "
                              f"writes; read it with GET /api/v1/actions/{action_id}", run_id=entry.run_id,
                              action_id=action_id, archived=archived_out(entry)) from None
        raise


# --- propose -------------------------------------------------------------------------------------------------

def refused(action: Action) -> bool:
    """The tool turned the step down and the agent is answered (its run left open): see `Tool.on_refusal`."""
    return action.status == ActionStatus.FAILED and action.error_class == REFUSED


def refusal_response(request, action: Action, *, replayed: bool) -> Response:
    """422 tool_refused: the tool's reason, the action and the run's status, so the model can propose otherwise."""
    run_status = action.run.status
    body = problem(
        status=422, code="tool_refused", title="The tool refused the call", instance=request.path,
        detail=f"{action.tool.name} refused the call, so nothing was done ({action.error_message}). The run is "
               f"{run_status.replace('_', ' ')}: propose again with other arguments, or cancel it.",
        reason=action.error_message, tool=action.tool.name, action_id=action.pk, run_id=action.run_id,
        run_status=run_status, replayed=replayed,
        action=ProposalOut(action, context={**action_context(request, [action]), "replayed": replayed}).data)
    response = Response(body, status=422)
    response.exception = True  # served as application/problem+json, like every refusal
    return response


class IntentIn(StrictSerializer):
    goal = serializers.CharField(required=False, allow_blank=True, max_length=10000)
    reasoning = serializers.CharField(required=False, allow_blank=True, max_length=20000)
    confidence = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    model = serializers.CharField(required=False, allow_blank=True, max_length=200)


class ActionIdField(serializers.IntegerField):
    """An action id as a JSON integer: "7", 7.0 or true name no action (a lenient cast could make them one)."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class ProposeIn(StrictSerializer):
    tool = serializers.CharField(max_length=120, help_text="A registered tool's name, e.g. hr.create_user.")
    args = serializers.DictField(help_text="The tool's arguments, checked against its JSON Schema.")
    target = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=200,
                                   help_text="The target's id, only for a tool whose policy says the agent names it "
                                             "(target.from: agent; the tool's own read must find it). Where the "
                                             "policy derives the target, leave it out: a different one is refused "
                                             "(422 target_mismatch).")
    intent = IntentIn(required=False, help_text="Why the agent proposes it: kept in the ledger and shown to approvers.")
    repeat_of = ActionIdField(
        required=False, allow_null=True, min_value=1, max_value=2**63 - 1,
        help_text="To do a call again on purpose: the id of the earlier action of this run with the same content "
                  "(succeeded or in flight). Without it, such a call answers as that action (see matched_by).")


class ProposalOut(ActionOut):
    replayed = serializers.SerializerMethodField(
        help_text="True when this answers a repeated Idempotency-Key or the content of a succeeded step: the stored "
                  "outcome, the tool not called again.")

    matched_by = serializers.SerializerMethodField(
        help_text="For a replay: key (the Idempotency-Key, sent or derived, was seen before) or content (an earlier "
                  "step of the run has the same tool, target and arguments); null for a new action.")

    def get_replayed(self, action) -> bool:
        return bool(self.context.get("replayed"))

    def get_matched_by(self, action) -> str | None:
        return self.context.get("matched_by") or None


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER, required=False,
    description="Same key + same arguments: the recorded outcome is returned and the tool is not called again. "
                "Without it, a key is derived from the action's content (tool, target, arguments, run). Whatever "
                "the key, a call with the content of a step of the run that succeeded (or is in flight) is "
                "answered as that step; send repeat_of to do it again.")


class ActionProposeView(ApiView):
    permission_classes = [IsAgent]

    @extend_schema(
        tags=TAG, operation_id="actions_propose", summary="Propose a tool call", request=ProposeIn,
        parameters=[IDEMPOTENCY_KEY],
        description="Records the call, checks it against policy and the ordering law, and executes it inside the "
                    "request when it needs no approval (bounded wait); when the tenant already holds its share of the "
                    "inline pool, the worker runs it (202). A failed step starts the unwind: the answer "
                    "shows the action failed and the run's status (unwinding, compensated or needs_attention). "
                    "A step the tool refused (a 4xx but 408/425/429) answers 422 tool_refused with the tool's reason "
                    "and leaves the run open, unless the tool's policy says on_refusal: unwind.",
        responses={
            201: OpenApiResponse(ProposalOut, description="Recorded and executed: the outcome is in status/result."),
            200: OpenApiResponse(ProposalOut, description="A replay of an Idempotency-Key, or of a succeeded step "
                                                          "with the same content: the stored outcome (headers "
                                                          "Idempotent-Replayed: true, Unwind-Matched-By: key or "
                                                          "content)."),
            202: OpenApiResponse(ProposalOut, description="Not settled yet: awaiting approval (see approval.url), "
                                                          "awaiting the agent's report (client-executed tool), "
                                                          "still running after the inline wait, or handed to the "
                                                          "worker (the tenant's share of the inline pool is busy): "
                                                          "poll links.wait."),
            **problems(404, 409, 422, 429, 503, body=True, codes={
                400: "validation_error (field, errors), parse_error",
                404: "not_found (the run), unknown_tool",
                409: "in_flight (action_id; matched_by: content when an earlier step with the same content is in "
                     "flight), repeat_of_mismatch (repeat_of), ordering_violation (rule, conflicts_with), "
                     "run_cancelled, run_not_active, run_archived (run_id, archived), state_conflict",
                403: "policy_denied (action_id, reason, decision): a rule or limit of the tool's policy refused the "
                     "call; the refused step is recorded, nothing was done, and the run stays open",
                422: "idempotency_mismatch (action_id), target_mismatch (sent, derived, target_from: a target the "
                     "policy does not let the agent choose), target_not_found (an agent-named target the tool's read "
                     "does not find), tool_refused (reason, tool, action_id, run_id, run_status, "
                     "replayed, action): nothing was done and the run stays open",
                429: "too_many_open_approvals (scope, limit: the agent or run already has that many approval "
                     "requests waiting; nothing was recorded), throttled",
                503: "target_unreadable (retry_after): the target's before-snapshot could not be read for a passing "
                     "reason; nothing was recorded, send the same request again"}),
        },
        examples=[OpenApiExample("create a user", request_only=True, value={
            "tool": "hr.create_user", "args": {"email": "ashu@company.com", "name": "Ashu Kumar"},
            "intent": {"goal": "Onboard Ashu", "reasoning": "HR ticket 42 asks for an account", "confidence": 0.92,
                       "model": "scripted"}})],
    )
    def post(self, request, run_id: int):
        caller = caller_of(request)
        try:
            run = selectors.run_for_write(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id, run_id=run_id)
        except NotFound:
            refuse_if_archived(caller, run_id)
            raise
        body = ProposeIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        # A tenant holding its share of the inline pool has the step claimed for the worker instead (fair share).
        succeeded = None
        with inline.tenant_slot(run.tenant_id) as slot:
            proposal = action_propose(
                run=run, tool_name=data["tool"], args=data["args"], actor=caller.actor, target=data.get("target"),
                intent=data.get("intent"), idempotency_key=request.headers.get("Idempotency-Key"),
                inline=slot is not None, queued=slot is None, repeat_of=data.get("repeat_of"))
            if proposal.claimed and slot is not None:
                succeeded = inline.execute_within(proposal.action, owner=proposal.owner,
                                                  wait=settings.UNWIND_INLINE_WAIT, slot=slot)
            elif proposal.claimed:
                inline.hand_to_worker(proposal.action, owner=proposal.owner)
        # Executed here and succeeded: the action and its run's status as the success was recorded. Otherwise
        # another thread may have moved it: read it again.
        action = succeeded or selectors.action_reload(proposal.action)
        if refused(action):
            response = refusal_response(request, action, replayed=proposal.replayed)
            response["Idempotency-Key"] = action.idempotency_key
            if proposal.replayed:
                response["Idempotent-Replayed"] = "true"
            return response
        pending = action.status in ACTIVE_ACTION_STATUSES
        status = 202 if pending else 200 if proposal.replayed else 201
        response = action_response(request, action, status=status, shape=ProposalOut, replayed=proposal.replayed,
                                   matched_by=proposal.matched_by)
        response["Location"] = response.data["links"]["self"]  # the action's URL, built once for the answer
        response["Idempotency-Key"] = action.idempotency_key
        if proposal.replayed:
            response["Idempotent-Replayed"] = "true"
            response["Unwind-Matched-By"] = proposal.matched_by
        return response


# --- read and wait -----------------------------------------------------------------------------------------

class ActionDetailView(ApiView):
    permission_classes = [IsAgentOrMember]

    @extend_schema(tags=TAG, operation_id="actions_get", summary="Get an action",
                   description="A step of an archived run (docs/archive.md) is read from its segment, to the same "
                               "callers, and carries `archived` (when, and the segment's SHA-256); 503 "
                               "archive_unavailable when the segment cannot be read or no longer hashes to its name.",
                   responses={200: ActionOut, **problems(404, 503, codes=ARCHIVE_UNAVAILABLE)})
    def get(self, request, action_id: int):
        try:
            action = fresh(request, action_id)
        except NotFound:
            return archived_action_response(request, action_id)
        return action_response(request, action)


class WaitIn(serializers.Serializer):
    timeout = serializers.FloatField(required=False, default=10.0, min_value=0, max_value=MAX_WAIT,
                                     help_text=f"Seconds to wait, at most {MAX_WAIT:g}.")


class ActionWaitView(ApiView):
    """A long-poll that holds no web worker under the production command (ledger/api/waits.py)."""

    permission_classes = [IsAgentOrMember]

    @extend_schema(
        tags=TAG, operation_id="actions_wait", summary="Wait for an action's outcome (long-poll)",
        parameters=[WaitIn],
        description="Answers as soon as the outcome is known (succeeded, failed, rejected, expired, skipped, "
                    "compensated…) or the agent must report a client-executed tool; otherwise after `timeout` "
                    "seconds with 202 and the action as it stands. Each agent key (or person) may have "
                    "UNWIND_MAX_WAITS_PER_AGENT waits open at once; one more answers 429 too_many_waits with "
                    "Retry-After, without waiting. A step of an archived run answers at once (200) from its segment, "
                    "marked `archived`.",
        responses={200: OpenApiResponse(ActionOut, description="Settled."),
                   202: OpenApiResponse(ActionOut, description="Not settled within the timeout: ask again."),
                   **problems(400, 404, 429, 503, codes={
                       429: "too_many_waits (limit, retry_after): this caller already has that many waits open; "
                            "nothing was done, throttled", **ARCHIVE_UNAVAILABLE})},
    )
    def get(self, request, action_id: int):
        try:
            action = fresh(request, action_id)
        except NotFound:
            return archived_action_response(request, action_id)  # archived: settled, nothing to wait for
        query = WaitIn(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        timeout = query.validated_data["timeout"]
        settled = selectors.action_settled(action.pk)
        if settled or timeout == 0:
            return action_response(request, fresh(request, action.pk), status=200 if settled else 202)
        slot = waits.wait_slot_take(holder=waits.holder_of(caller_of(request)), seconds=timeout)
        deadline = time.monotonic() + timeout
        if waits.served_async(request):
            return waits.pending(action_id=action.pk, deadline=deadline, slot=slot,
                                 answer=lambda settled: self.answered(request, action.pk, settled))
        try:
            settled = waits.poll_until_settled(action.pk, deadline)
        finally:
            waits.wait_slot_release(slot)
        return action_response(request, fresh(request, action.pk), status=200 if settled else 202)

    def answered(self, request, action_id: int, settled: bool):
        """The answer once the event loop's wait ended, finalized as DRF finalizes a handler's (a refusal as a
        problem)."""
        try:
            response = action_response(request, fresh(request, action_id), status=200 if settled else 202)
        except Exception as exc:  # noqa: BLE001 - DRF's own handling: a problem, or raised again
            response = self.handle_exception(exc)
        return self.finalize_response(request, response)


# --- client-executed tools ---------------------------------------------------------------------------------

class ReportIn(StrictSerializer):
    ok = serializers.BooleanField(help_text="Whether the tool call succeeded.")
    result = serializers.JSONField(required=False, allow_null=True, help_text="The tool's result, when ok.")
    error = serializers.CharField(required=False, allow_blank=True, max_length=4000,
                                  help_text="What went wrong, when not ok.")
    refused = serializers.BooleanField(
        required=False, default=False,
        help_text="With ok: false, the tool turned the call down and did nothing: like an HTTP tool's 4xx, the run "
                  "stays open (unless the tool's policy says on_refusal: unwind).")

    def validate(self, data):
        if data["ok"] and data.get("error"):
            raise serializers.ValidationError({"error": ["only a failed call (ok: false) has an error"]})
        if data["ok"] and data.get("refused"):
            raise serializers.ValidationError({"refused": ["only a failed call (ok: false) can be refused"]})
        if not data["ok"] and data.get("result") is not None:
            raise serializers.ValidationError({"result": ["only a successful call (ok: true) has a result"]})
        return data


class ActionReportView(ApiView):
    permission_classes = [IsAgent]

    @extend_schema(
        tags=TAG, operation_id="actions_report", summary="Report a client-executed outcome",
        description="For tools the agent runs itself (executor: client), forward steps and compensations alike. "
                    "Reporting the same success again is harmless. A failure starts the unwind like any failed step; "
                    "a failure reported with refused: true follows the tool's on_refusal (default: the run stays "
                    "open, the action failed with error_class refused).",
        request=ReportIn,
        responses={200: ActionOut, **problems(404, 409, body=True, codes={
            409: "state_conflict (not a client-executed tool, or not waiting for a report), run_archived (run_id, "
                 "action_id, archived)"})},
    )
    def post(self, request, action_id: int):
        caller = caller_of(request)
        action = fresh_to_write(request, action_id)
        body = ReportIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        action = action_report(action=action, ok=data["ok"], result=data.get("result"), error=data.get("error", ""),
                               actor=caller.actor, refused=data["refused"])
        action = fresh(request, action.pk)
        if action.run.status == RunStatus.UNWINDING:
            inline.unwind_within(action.run_id, tenant_id=action.tenant_id, wait=settings.UNWIND_INLINE_WAIT)
            action = fresh(request, action.pk)
        return action_response(request, action)


class UndoesOut(serializers.Serializer):
    id = serializers.IntegerField()
    seq = serializers.IntegerField()
    tool = serializers.CharField(source="tool.name")
    args = serializers.JSONField()
    result = serializers.JSONField(allow_null=True)
    target = serializers.CharField(source="target_id")


class PendingCompensationOut(ActionOut):
    undoes = UndoesOut(source="compensates", help_text="The forward step this compensation takes back.")


class PendingFilterIn(serializers.Serializer):
    run = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)


class PendingCompensationsView(ApiView):
    permission_classes = [IsAgent]
    pagination_class = NewestFirst

    @extend_schema(
        tags=TAG, operation_id="compensations_pending", summary="Compensations waiting for this agent",
        description="Compensations of client-executed tools in this agent's runs: run each (its args are resolved) "
                    "and report the outcome to links.report.",
        parameters=[PendingFilterIn, *PAGE_PARAMETERS], responses={200: PendingCompensationOut(many=True), **problems(400)},
    )
    def get(self, request):
        caller = caller_of(request)
        query = PendingFilterIn(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        pending = selectors.compensations_pending_report(tenant_ids=caller.tenant_ids, agent_id=caller.agent_id,
                                                        run_id=query.validated_data.get("run"))
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(pending, request, view=self)
        data = PendingCompensationOut(page, many=True, context=action_context(request, page)).data
        return paginator.get_paginated_response(data)
