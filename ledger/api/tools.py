"""Tools and their policy: list, get, upsert by name, and a whole policy document at once.

Agents read the tool list (they need the schemas to propose) but never write it: the policy is their
guardrail. Writes take a person with the tenant's admin role or a deploy key; the deploy key is accepted
on these endpoints only.
"""
from __future__ import annotations

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response

from ledger.executors import mcp as mcp_upstream
from ledger.api import selectors
from ledger.api.auth import (
    GOVERNANCE_AUTHENTICATION, AgentsCannotGovern, CanReadTools, IsMemberOrDeployKey, caller_of, tenant_for,
)
from ledger.api.base import ApiView, absolute
from ledger.api.problems import problems
from ledger.errors import ValidationFailed
from ledger.models import ActionClass, ApprovalRule, Executor, OnRefusal, Risk, Role, SagaRole, Tool
from ledger.policy.checks import APPROVALS_REQUIRED, BACKOFF_SECONDS, MAX_ATTEMPTS, TIMEOUT_SECONDS
from ledger.policy.versions import tool_upsert, tools_load

TAG = ["tools"]
TENANT = OpenApiParameter("tenant", OpenApiTypes.STR, OpenApiParameter.QUERY, required=False,
                          description="People in several tenants: the tenant's slug. Keys act in their own.")
GOVERN_403 = ("agents_cannot_govern (an agent's key: a person with the admin role or a deploy key writes tools and "
              "policy), permission_denied (below the admin role)")


def compensation_as_written(plan: dict) -> dict:
    """A compensation with an inline twin shows the twin inline again (not the name and version it was
    registered under), so the policy can be sent back as is."""
    if "inline" not in plan:
        return plan
    shown = {key: value for key, value in plan.items() if key not in ("inline", "twin_version")}
    return {**shown, "tool": plan["inline"]}


def executor_as_written(tool: Tool) -> dict:
    """An mcp tool's executor is written {kind: mcp, server, tool} (policy never takes its endpoint as text)."""
    if tool.executor == Executor.MCP:
        server, name = mcp_upstream.split_endpoint(tool.endpoint)
        return {"executor": {"kind": Executor.MCP.value, "server": server, "tool": name}}
    return {"executor": tool.executor, "endpoint": tool.endpoint}


def policy_of(tool: Tool) -> dict:
    """A tool's policy in the shape PUT accepts, so what GET shows can be sent back as is."""
    return {
        "description": tool.description, "describe": tool.describe, "args_schema": tool.args_schema,
        "action_class": tool.action_class,
        "saga_role": tool.saga_role, "risk": tool.risk, "approval": tool.approval,
        "approvals_required": tool.approvals_required, **executor_as_written(tool),
        "target": {"type": tool.target_type, "from": tool.target_from},
        "idempotency": {"key_fields": tool.key_fields, "honours_key": tool.honours_idempotency_key},
        "snapshot": tool.snapshot, "verify": tool.verify, "lookup": tool.lookup,
        "compensation": compensation_as_written(tool.compensation),
        "timeout": tool.timeout_seconds,
        "retry": {"max_attempts": tool.max_attempts, "backoff": tool.backoff_seconds},
        "on_refusal": tool.on_refusal,
        "display": tool.display,
        "rules": tool.rules,
        "limits": tool.limits,
        "retention": tool.retention_seconds,
    }


# Built with type() because one of its fields is called "from", a Python keyword.
TargetPolicy = type("TargetPolicy", (serializers.Serializer,), {
    "__module__": __name__,
    "type": serializers.CharField(required=False, help_text="What the tool acts on, e.g. user, ticket."),
    "from": serializers.CharField(required=False, help_text="Where the target id comes from: args.<name> or result.<name>."),
})


class IdempotencyPolicy(serializers.Serializer):
    key_fields = serializers.ListField(child=serializers.CharField(), required=False,
                                       help_text="Args that identify the logical action (default: all).")
    honours_key = serializers.BooleanField(required=False, help_text="Whether the tool deduplicates on Idempotency-Key.")


class RetryPolicy(serializers.Serializer):
    max_attempts = serializers.IntegerField(required=False, min_value=MAX_ATTEMPTS[0], max_value=MAX_ATTEMPTS[1])
    backoff = serializers.FloatField(required=False, min_value=BACKOFF_SECONDS[0], max_value=BACKOFF_SECONDS[1],
                                     help_text="Seconds before the first retry (doubles, jittered), or a duration like 2s.")


class FunctionDefinition(serializers.Serializer):
    name = serializers.CharField(help_text="The tool's name (must match the name it is registered under).")
    description = serializers.CharField(required=False)
    parameters = serializers.JSONField(required=False, help_text="JSON Schema of the arguments.")
    strict = serializers.BooleanField(required=False, help_text="OpenAI's strict mode; Unwind validates either way.")


class ToolPolicy(serializers.Serializer):
    """A tool's policy (README, Policy files). Validated by the engine, which names the field at fault."""

    description = serializers.CharField(required=False)
    describe = serializers.JSONField(
        required=False, help_text='Sentences for the correction trail: {"done": "We booked {args.hotel}", "undone": …, '
                                  '"failed": …}; placeholders {args.<name>}, {result.<name>}, {target} only.')
    args_schema = serializers.JSONField(required=False, help_text="JSON Schema (2020-12) of the arguments.")
    action_class = serializers.ChoiceField(ActionClass.choices, required=False)
    saga_role = serializers.ChoiceField(SagaRole.choices, required=False)
    risk = serializers.ChoiceField(Risk.choices, required=False)
    approval = serializers.ChoiceField(ApprovalRule.choices, required=False)
    approvals_required = serializers.IntegerField(required=False, min_value=APPROVALS_REQUIRED[0],
                                                  max_value=APPROVALS_REQUIRED[1])
    executor = serializers.ChoiceField(Executor.choices, required=False,
                                       help_text="Also accepted as an object: {kind, url|path}, and for a tool of an "
                                                 "upstream MCP server only so: {kind: mcp, server, tool}.")
    endpoint = serializers.CharField(
        required=False, help_text="http: a path (resolved against UNWIND_TOOL_BASE_URL) or a URL at an allowed origin "
                                  "(UNWIND_TOOL_ORIGINS); python: a key a deployer registered in code (ledger.policy.registry).")
    target = TargetPolicy(required=False)
    idempotency = IdempotencyPolicy(required=False)
    snapshot = serializers.JSONField(required=False, help_text='{"read": URL, path or registered reader key, "fields": [...]}')
    verify = serializers.JSONField(required=False, help_text='{"expect": {"field": "$args.x"}}')
    lookup = serializers.JSONField(required=False, help_text='{"read": URL with {key}, or a registered reader key}')
    compensation = serializers.JSONField(required=False,
                                         help_text="{strategy: twin|snapshot|correction|none, tool, args, risk, approval}; "
                                                   "tool is a tool's name, or an inline tool registered as <name>.undo")
    timeout = serializers.FloatField(required=False, min_value=TIMEOUT_SECONDS[0], max_value=TIMEOUT_SECONDS[1],
                                     help_text="Seconds (or a duration like 30s, 2m).")
    retry = RetryPolicy(required=False)
    type = serializers.ChoiceField(["function"], required=False,
                                   help_text="\"function\": the tool is written as an OpenAI function definition, "
                                             "with the policy keys above beside it (docs/api.md).")
    function = FunctionDefinition(required=False, help_text="Chat Completions style: name, description and "
                                                            "parameters (the args schema) come from here.")
    name = serializers.CharField(required=False, help_text="Responses style (flat): the function's name.")
    parameters = serializers.JSONField(required=False, help_text="Responses style (flat): the args schema.")
    strict = serializers.BooleanField(required=False, help_text="Responses style (flat): OpenAI's strict mode.")
    on_refusal = serializers.ChoiceField(
        OnRefusal.choices, required=False,
        help_text="A refusal (a 4xx but 408/425/429): answer the agent and keep the run open (default), or unwind.")
    display = serializers.JSONField(required=False, help_text='How pages show argument values, e.g. '
                                    '{"amount_cents": {"money": {"currency": "EUR", "minor_units": 2}}} (docs/api.md).')
    rules = serializers.JSONField(required=False, help_text='CEL conditions on the arguments: [{"when": "args.amount '
                                  '> 500", "risk": "high" | "deny": "…" | "approvals_required": 2, "reason": "…"}] '
                                  '(docs/policy.md).')
    limits = serializers.JSONField(required=False, help_text='Budgets and rates: [{"per": "run", "sum": "args.amount", '
                                   '"max": 1000}, {"per": "agent", "count": 20, "window": "1h"}] (docs/policy.md).')
    retention = serializers.JSONField(required=False, help_text='How long a settled run that called it stays in the hot '
                                      'tables: a duration like 365d, or seconds; 0 or "forever": as its tenant says '
                                      '(docs/archive.md).')


class ToolOut(serializers.Serializer):
    name = serializers.CharField()
    version = serializers.IntegerField(help_text="The current version of the tool's policy; each change makes a new one.")
    policy = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()

    @extend_schema_field(ToolPolicy)
    def get_policy(self, tool):
        return policy_of(tool)

    def get_url(self, tool) -> str:
        return absolute(self.context.get("request"), reverse("api:tool-detail", args=[tool.name]))


def tool_data(request, tools) -> list | dict:
    many = not isinstance(tools, Tool)
    return ToolOut(tools, many=many, context={"request": request}).data


class ToolListView(ApiView):
    authentication_classes = GOVERNANCE_AUTHENTICATION
    permission_classes = [CanReadTools]

    @extend_schema(tags=TAG, operation_id="tools_list", summary="List the tenant's tools",
                   description="Agents, deploy keys and members (viewer and up) read it; agents read only, since "
                               "they need the schemas to propose.",
                   parameters=[TENANT], responses={200: ToolOut(many=True), **problems(400, 404)})
    def get(self, request):
        tenant = tenant_for(request, role=Role.VIEWER)
        return Response(tool_data(request, selectors.tool_list(tenant_id=tenant.pk)))


class ToolDetailView(ApiView):
    authentication_classes = GOVERNANCE_AUTHENTICATION

    def get_permissions(self):
        if self.request.method in ("GET", "HEAD", "OPTIONS"):
            return [CanReadTools()]
        return [AgentsCannotGovern(), IsMemberOrDeployKey()]

    @extend_schema(tags=TAG, operation_id="tools_get", summary="Get a tool and its policy",
                   parameters=[TENANT], responses={200: ToolOut, **problems(400, 404)})
    def get(self, request, name: str):
        tenant = tenant_for(request, role=Role.VIEWER)
        return Response(tool_data(request, selectors.tool_get(tenant_id=tenant.pk, name=name)))

    @extend_schema(
        tags=TAG, operation_id="tools_put", summary="Register or update a tool",
        description="For a person with the tenant's admin role, or a deploy key. An agent's key is refused (403 "
                    "agents_cannot_govern): the policy is the agent's guardrail.",
        parameters=[TENANT], request=ToolPolicy,
        responses={200: OpenApiResponse(ToolOut, description="Updated."),
                   201: OpenApiResponse(ToolOut, description="Registered."),
                   **problems(404, body=True, codes={403: GOVERN_403, 404: "not_found (the ?tenant)"})},
        examples=[OpenApiExample("a client-executed tool", request_only=True, value={
            "description": "Post a message to a chat channel.", "executor": "client", "saga_role": "compensatable",
            "args_schema": {"type": "object", "required": ["channel", "text"]},
            "compensation": {"strategy": "twin", "tool": "chat.delete", "args": {"message_id": "$result.id"}}})],
    )
    def put(self, request, name: str):
        tenant = tenant_for(request, role=Role.ADMIN)
        tool, created = tool_upsert(tenant=tenant, name=name, spec=request.data, actor=caller_of(request).actor)
        return Response(tool_data(request, tool), status=201 if created else 200)


TOOL_POLICY_REF = {"$ref": "#/components/schemas/ToolPolicy"}


@extend_schema_field({"oneOf": [{"type": "object", "additionalProperties": TOOL_POLICY_REF},
                                {"type": "array", "items": TOOL_POLICY_REF}]})
class ToolSection(serializers.JSONField):
    """A document's tools: an object of name → policy, or a list of OpenAI function definitions."""


class PolicyLoadIn(serializers.Serializer):
    tenant = serializers.CharField(required=False, help_text="If given, must be the caller's tenant.")
    defaults = serializers.JSONField(required=False, help_text="{approval_threshold, approval_ttl}")
    tools = ToolSection(required=False, help_text="Tool name → policy, or a list of OpenAI function definitions "
                                                  "with the policy keys beside each.")


class PolicyLoadOut(serializers.Serializer):
    loaded = serializers.ListField(child=serializers.CharField())
    tools = ToolOut(many=True)


class PolicyLoadView(ApiView):
    authentication_classes = GOVERNANCE_AUTHENTICATION
    permission_classes = [AgentsCannotGovern, IsMemberOrDeployKey]

    @extend_schema(
        tags=TAG, operation_id="policy_load", summary="Load a whole policy document",
        description="The JSON form of a policy file (flat, or seed 004's agentSafety shape), loaded atomically: "
                    "every tool, or none with the first error. Same as `manage.py load_tools`. For a person with the "
                    "tenant's admin role, or a deploy key (a pipeline pushing a reviewed policy file); an agent's key "
                    "is refused (403 agents_cannot_govern).",
        parameters=[TENANT], request=PolicyLoadIn,
        responses={200: PolicyLoadOut, **problems(404, body=True, codes={403: GOVERN_403,
                                                                         404: "not_found (the ?tenant)"})},
    )
    def post(self, request):
        tenant = tenant_for(request, role=Role.ADMIN)
        document = request.data
        named = document.get("tenant") if isinstance(document, dict) else None
        if named not in (None, "", tenant.slug):
            raise ValidationFailed(f"this document is for tenant {named!r}, and you are acting in {tenant.slug!r}",
                                   field="tenant")
        tools = tools_load(tenant=tenant, document=document, actor=caller_of(request).actor)
        return Response({"loaded": [tool.name for tool in tools], "tools": tool_data(request, tools)})
