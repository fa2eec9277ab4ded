"""Output shapes shared by the agent API's views: an action and a run as an agent sees them."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from ledger.engine import holds
from ledger.api import selectors
from ledger.api import links
from ledger.api.base import OutSerializer, absolute, path_to
from ledger.models import ActionKind, ActionStatus, Executor, Risk, RunStatus, SagaRole


class TargetOut(serializers.Serializer):
    type = serializers.CharField()
    id = serializers.CharField()


class ErrorOut(serializers.Serializer):
    error_class = serializers.CharField(help_text="e.g. http_504, transient, not_sent, permanent, drift, lease_lost, "
                                                  "settle_failed")
    message = serializers.CharField()


class ErasedOut(serializers.Serializer):
    on = serializers.DateField(help_text="The day the person's data was erased.")
    why = serializers.CharField(help_text="Always \"at the person's request\".")
    sentence = serializers.CharField(help_text="What now stands where their text was.")


class ArchivedOut(serializers.Serializer):
    at = serializers.DateTimeField(help_text="When the run was archived.")
    segment = serializers.CharField(help_text="The SHA-256 of the segment holding it (its name in the archive).")


@extend_schema_field(ArchivedOut)
class ArchivedMark(serializers.DictField):
    """`archived` on a run or a step read back from its segment (docs/archive.md); a hot one has no such key. The view
    that read the segment sets it (`archived_out`); declared here so the schema, and the clients generated from it,
    know the key. A dict of text, not a nested serializer, so the answer keeps its plan (`OutSerializer`)."""

    def __init__(self, **kwargs):
        # Not read-only: the schema lists every read-only field as required.
        super().__init__(child=serializers.CharField(), required=False, **kwargs)


ARCHIVED_HELP = ("Only on a {} read from the archive (docs/archive.md): when it was archived and the SHA-256 of its "
                 "segment. Absent on a hot one.")


def erased_out(erased_at) -> dict | None:
    if erased_at is None:
        return None
    return {"on": erased_at.date(), "why": "at the person's request",
            "sentence": f"erased on {erased_at:%Y-%m-%d} at the person's request"}


class ApprovalLinkOut(serializers.Serializer):
    id = serializers.IntegerField()
    status = serializers.CharField()
    expires_at = serializers.DateTimeField()
    url = serializers.URLField(help_text="The page where a person approves or rejects it.")
    api_url = serializers.URLField(help_text="The same request in the approvals API (people only).")


class ActionLinksOut(serializers.Serializer):
    self = serializers.URLField()
    wait = serializers.URLField(help_text="Long-poll until the outcome is known.")
    run = serializers.URLField()
    report = serializers.URLField(required=False, help_text="Where the agent reports a client-executed outcome.")
    cancel = serializers.URLField(required=False, help_text="For a held step: cancel the run (POST) to stop it.")


class HoldOut(serializers.Serializer):
    executes_at = serializers.DateTimeField(help_text="When the step runs unless someone stops it first.")
    customer_can_stop = serializers.BooleanField(help_text="Whether the person the run acts for may stop it too.")
    how_to_stop = serializers.CharField()


class ActionOut(OutSerializer):
    id = serializers.IntegerField()
    run = serializers.IntegerField(source="run_id")
    run_status = serializers.ChoiceField(RunStatus.choices, source="run.status",
                                         help_text="The run's status now: unwinding, compensated or needs_attention "
                                                   "after a failed step.")
    seq = serializers.IntegerField(help_text="Position in the run (compensations get their own).")
    kind = serializers.ChoiceField(ActionKind.choices)
    compensates = serializers.IntegerField(source="compensates_id", allow_null=True,
                                           help_text="For a compensation: the action it undoes.")
    tool = serializers.CharField(source="tool.name")
    executor = serializers.ChoiceField(Executor.choices, source="tool.executor")
    saga_role = serializers.ChoiceField(SagaRole.choices)
    risk = serializers.ChoiceField(Risk.choices)
    status = serializers.ChoiceField(ActionStatus.choices)
    awaiting_report = serializers.SerializerMethodField(
        help_text="True when the agent must run this client-executed tool itself and report the outcome.")
    args = serializers.JSONField()
    target = serializers.SerializerMethodField()
    idempotency_key = serializers.CharField()
    key_source = serializers.CharField(help_text="header (the agent's Idempotency-Key), derived (from the content) "
                                                 "or compensation.")
    repeat_of = serializers.IntegerField(source="repeat_of_id", allow_null=True,
                                         help_text="The earlier action with the same content this one repeats on "
                                                   "purpose (the proposal's repeat_of).")
    attempts = serializers.IntegerField()
    max_attempts = serializers.IntegerField()
    result = serializers.JSONField(allow_null=True)
    error = serializers.SerializerMethodField()
    verification = serializers.JSONField(allow_null=True)
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)
    intent = serializers.JSONField()
    compensation_plan = serializers.JSONField()
    decision_reason = serializers.CharField(help_text="Why a person rejected it (or why it expired), or who stopped "
                                                      "it while it was held.")
    stopped_by = serializers.CharField(help_text="Who stopped it while it was held: agent, operator, approver or "
                                                 "customer; empty otherwise.")
    hold = serializers.SerializerMethodField(help_text="For a held step (status held): when it runs and how to stop "
                                                       "it; null otherwise.")
    policy_decision = serializers.JSONField(
        allow_null=True, help_text="What the tool's rules and limits decided (null for a tool without them): "
                                   "tool_version, risk, required, fired [{rule, when, effect, reason, read}], limits "
                                   "[{per, count | sum and max, window, used, asks}], denied.")
    approval = serializers.SerializerMethodField()
    erased = serializers.SerializerMethodField(help_text=(
        "Null, or when the data of the person its run acted for was erased at their request: every text of the "
        "step (arguments, result, snapshots, intent, target, error) then reads as `erased.sentence`."))
    archived = ArchivedMark(help_text=ARCHIVED_HELP.format("step of a run"))
    links = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)

    @extend_schema_field(ErasedOut(allow_null=True))
    def get_erased(self, action):
        return erased_out(selectors.erased_on(action.run, self.context.setdefault("erased", {})))

    def get_awaiting_report(self, action) -> bool:
        return selectors.awaiting_report(action.status, action.tool.executor)

    @extend_schema_field(TargetOut)
    def get_target(self, action):
        return {"type": action.target_type, "id": action.target_id}

    @extend_schema_field(ErrorOut(allow_null=True))
    def get_error(self, action):
        if not (action.error_class or action.error_message):
            return None
        return {"error_class": action.error_class, "message": action.error_message}

    @extend_schema_field(HoldOut(allow_null=True))
    def get_hold(self, action):
        if action.status != ActionStatus.HELD:
            return None
        return {"executes_at": action.next_attempt_at, "customer_can_stop": holds.customer_can_stop(action.tool),
                "how_to_stop": "POST links.cancel before executes_at to cancel the run: the step is then never "
                               "executed (and the run's earlier steps are undone unless its pivot has committed)."}

    @extend_schema_field(ApprovalLinkOut(allow_null=True))
    def get_approval(self, action):
        found = self.context.get("approvals", {}).get(action.pk)
        if found is None:
            return None
        request = self.context.get("request")
        return {"id": found["id"], "status": found["status"], "expires_at": found["expires_at"],
                "url": absolute(request, found["page"]), "api_url": absolute(request, found["api"])}

    @extend_schema_field(ActionLinksOut)
    def get_links(self, action):
        request = self.context.get("request")
        found = {
            "self": absolute(request, path_to("api:action-detail", action.pk)),
            "wait": absolute(request, path_to("api:action-wait", action.pk)),
            "run": absolute(request, path_to("api:run-detail", action.run_id)),
        }
        if action.tool.executor == Executor.CLIENT:
            found["report"] = absolute(request, path_to("api:action-report", action.pk))
        if action.status == ActionStatus.HELD:
            found["cancel"] = absolute(request, path_to("api:run-cancel", action.run_id))
        return found


def action_context(request, actions) -> dict:
    """Serializer context for actions: the request (for absolute links) and their approval requests."""
    return {"request": request, "approvals": links.approvals_for(actions)}


class AttentionOut(serializers.Serializer):
    reason = serializers.CharField()
    detail = serializers.CharField()


class RunLinksOut(serializers.Serializer):
    self = serializers.URLField()
    actions = serializers.URLField(help_text="Propose an action here (POST).")
    cancel = serializers.URLField()
    complete = serializers.URLField()


class RunOut(OutSerializer):
    id = serializers.IntegerField()
    status = serializers.ChoiceField(RunStatus.choices)
    goal = serializers.CharField()
    on_behalf_of = serializers.CharField()
    agent = serializers.CharField(source="agent.name", allow_null=True, default=None)
    intent = serializers.JSONField()
    plan = serializers.ListField(child=serializers.CharField())
    pivot_committed = serializers.BooleanField()
    cancel_requested_at = serializers.DateTimeField(allow_null=True)
    idle_timeout = serializers.IntegerField(source="idle_timeout_seconds",
                                            help_text="Seconds without agent activity before the run is unwound.")
    attention = serializers.SerializerMethodField()
    erased = serializers.SerializerMethodField(help_text=(
        "Null, or when the data of the person it acted for was erased at their request: its goal, on_behalf_of, "
        "intent and every text of its steps then read as `erased.sentence`."))
    archived = ArchivedMark(help_text=ARCHIVED_HELP.format("run"))
    links = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)

    @extend_schema_field(ErasedOut(allow_null=True))
    def get_erased(self, run):
        return erased_out(selectors.erased_on(run, self.context.setdefault("erased", {})))

    @extend_schema_field(AttentionOut(allow_null=True))
    def get_attention(self, run):
        if run.status != RunStatus.NEEDS_ATTENTION:
            return None
        return {"reason": run.attention_reason, "detail": run.attention_detail}

    @extend_schema_field(RunLinksOut)
    def get_links(self, run):
        request = self.context.get("request")
        return {name: absolute(request, path_to(f"api:run-{route}", run.pk))
                for name, route in (("self", "detail"), ("actions", "actions"), ("cancel", "cancel"),
                                    ("complete", "complete"))}


def archived_out(entry) -> dict:
    """The `archived` marker of a run read from the archive: an index entry (ArchivedRun) or a run read back."""
    at = entry.archived_at
    segment = entry.segment if isinstance(entry.segment, str) else entry.segment.sha256
    return {"at": at.isoformat(), "segment": segment}


class ArchivedRunLinksOut(serializers.Serializer):
    self = serializers.URLField(help_text="The run, read from its segment.")


class ArchivedRunOut(serializers.Serializer):
    """An archived run as the archive's index knows it (no segment is read to list it); its page, `links.self`,
    reads the rest from its segment."""

    id = serializers.IntegerField(source="run_id")
    agent = serializers.SerializerMethodField()
    finished_at = serializers.DateTimeField(allow_null=True)
    archived = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()

    def get_agent(self, entry) -> str | None:
        return self.context.get("agents", {}).get(entry.agent_id)

    @extend_schema_field(ArchivedOut)
    def get_archived(self, entry):
        return archived_out(entry)

    @extend_schema_field(ArchivedRunLinksOut)
    def get_links(self, entry):
        return {"self": absolute(self.context.get("request"), path_to("api:run-detail", entry.run_id))}


class CheckpointOut(serializers.Serializer):
    id = serializers.IntegerField()
    label = serializers.CharField()
    state = serializers.JSONField()
    created_at = serializers.DateTimeField()


class AgentMoveOut(serializers.Serializer):
    name = serializers.ChoiceField(["cancel", "complete"])
    allowed = serializers.BooleanField()
    does = serializers.CharField(source="staff_words", help_text="What the move will do, step by step.")
    refusal = serializers.CharField(help_text="Why it is not offered now (409 with this sentence if tried).")


class RunDetailOut(RunOut):
    actions = serializers.SerializerMethodField()
    checkpoints = serializers.SerializerMethodField()
    moves = serializers.SerializerMethodField(help_text=(
        "What the run's agent may do next, from the one model of legal moves the engine obeys "
        "(ledger/engine/moves.py), with what each does."))

    @extend_schema_field(AgentMoveOut(many=True))
    def get_moves(self, run):
        from ledger.engine import moves

        offered = moves.run_moves(run, self.context["actions"])
        return AgentMoveOut([offered.get(moves.AGENT, name) for name in ("cancel", "complete")], many=True).data

    @extend_schema_field(ActionOut(many=True))
    def get_actions(self, run):
        actions = self.context["actions"]
        for action in actions:
            action.run = run  # the run is already loaded: no query per action for run_status
        context = {**self.context, **action_context(self.context.get("request"), actions)}
        return ActionOut(actions, many=True, context=context).data

    @extend_schema_field(CheckpointOut(many=True))
    def get_checkpoints(self, run):
        return CheckpointOut(self.context["checkpoints"], many=True).data


class AttemptOut(serializers.Serializer):
    """One try of a step, for diagnosis: which step, how it ended, why, and how long it took."""

    id = serializers.IntegerField()
    action = serializers.IntegerField(source="action_id")
    seq = serializers.IntegerField(source="action.seq", help_text="The step's position in the run.")
    kind = serializers.ChoiceField(ActionKind.choices, source="action.kind")
    tool = serializers.CharField(source="action.tool.name")
    number = serializers.IntegerField(help_text="1 for the first try of the step, 2 for its first retry, …")
    outcome = serializers.CharField(help_text="running, succeeded, failed_transient, failed_permanent, "
                                              "unanswered_last_try, lost, settle_failed, deferred, drift")
    error_class = serializers.CharField(help_text="e.g. http_504, transient, not_sent, permanent; empty when it "
                                                  "succeeded.")
    error_message = serializers.CharField()
    latency_ms = serializers.FloatField(allow_null=True)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


# What an event's data keeps to itself: the row fingerprints the chain is verified with, not diagnosis.
EVENT_INTEGRITY_KEYS = frozenset({"action_state", "run_state", "rows"})


class EventOut(serializers.Serializer):
    """One audit event of the run. The chain's hashes and the row fingerprints stay out: they are for
    `verify_audit`, and the agent has no use for them."""

    seq = serializers.IntegerField(help_text="Position in the tenant's audit chain.")
    kind = serializers.CharField(help_text="e.g. run.opened, forward.proposed, forward.succeeded, compensation.proposed")
    actor = serializers.CharField(help_text="Who caused it: agent:<name>, user:<name>, system:<part>.")
    action = serializers.IntegerField(source="action_ref", allow_null=True)
    data = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()

    def get_data(self, event) -> dict:
        return {key: value for key, value in event.data.items() if key not in EVENT_INTEGRITY_KEYS}
