"""Reads for the approver pages: the inbox, one request as its approver sees it, and the words around a preview.

Every read is scoped by the user's memberships: a request of a tenant the user does not belong to does
not exist for them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from django.db.models import OuterRef, Prefetch, QuerySet, Subquery
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest, ApprovalStatus, Decision
from approvals import surfaces
from approvals.services import is_requester
from ledger.db import mapping
from ledger.policy.display import shown_value
from ledger.models import ROLE_ORDER, Action, ActionStatus, CompensationStrategy, Membership, Role, Tenant, Tool
from ledger.policy.law import approvals_needed

INBOX_PAGE_SIZE = 20
ANY_STATUS = "all"


# --- the inbox --------------------------------------------------------------------------------------

def memberships_of(user) -> list[Membership]:
    return list(Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug"))


def tool_names(*, tenant_ids: list[int]) -> list[str]:
    names = Tool.objects.filter(tenant_id__in=tenant_ids, is_current=True).order_by("name")
    return list(names.values_list("name", flat=True).distinct())


def inbox_requests(*, tenant_ids: list[int], tenant: str = "", risk: str = "", tool: str = "",
                   status: str = ApprovalStatus.PENDING) -> QuerySet[ApprovalRequest]:
    """Requests of the given tenants, newest first, with everything an inbox row shows in the same query."""
    requests = ApprovalRequest.objects.filter(tenant_id__in=tenant_ids)
    if tenant:
        requests = requests.filter(tenant__slug=tenant)
    if risk:
        requests = requests.filter(risk=risk)
    if tool:
        requests = requests.filter(action__tool__name=tool)
    if status != ANY_STATUS:
        requests = requests.filter(status=status or ApprovalStatus.PENDING)
    # The undone step and its tool: an undo's amount is that step's (approvals/surfaces.py, `amounts`).
    return (requests.select_related("tenant", "run__agent", "action__tool", "action__compensates__tool", "tool")
            .order_by("-created_at", "-pk"))


# --- one request ------------------------------------------------------------------------------------

def approval_for(user, pk: int) -> ApprovalRequest | None:
    """The request with the user's role in its tenant as `viewer_role`, or None when they are not a member."""
    role = Membership.objects.filter(user=user, tenant=OuterRef("tenant_id")).values("role")[:1]
    decisions = ApprovalDecision.objects.select_related("user").order_by("created_at", "pk")
    return (ApprovalRequest.objects.annotate(viewer_role=Subquery(role))
            .filter(pk=pk, viewer_role__isnull=False)
            .select_related("tenant", "run__agent", "action__tool", "action__compensates__tool", "tool")
            .prefetch_related(Prefetch("decisions", queryset=decisions))
            .first())


def may_stop_held(approval: ApprovalRequest, user) -> bool:
    """Whether this person may stop the request's step while it is held (ledger/engine/holds.py): they approved it, or
    they operate its tenant (recovery/stops.py decides again when they press Stop)."""
    role = Membership.objects.filter(user=user, tenant_id=approval.tenant_id).values_list("role", flat=True).first()
    if role in (Role.OPERATOR, Role.ADMIN):
        return True
    return ApprovalDecision.objects.filter(request__action_id=approval.action_id, user=user,
                                           decision="approve").exists()


def run_steps(run_id: int) -> list[Action]:
    return list(Action.objects.filter(run_id=run_id).select_related("tool").order_by("seq"))


@dataclass
class DecisionState:
    """What the decision panel offers this user, and why not when it offers nothing."""

    can_decide: bool
    refusal: str
    overdue: bool
    required: int = 1
    approvals: list[ApprovalDecision] = field(default_factory=list)
    rejections: list[ApprovalDecision] = field(default_factory=list)

    @property
    def missing(self) -> int:
        return max(0, self.required - len(self.approvals))


def decision_state(approval: ApprovalRequest, user) -> DecisionState:
    decisions = list(approval.decisions.all())
    approvals = [d for d in decisions if d.decision == Decision.APPROVE]
    rejections = [d for d in decisions if d.decision == Decision.REJECT]
    pending = approval.status == ApprovalStatus.PENDING
    overdue = pending and approval.expires_at <= timezone.now()
    state = DecisionState(can_decide=False, refusal="", overdue=overdue, approvals=approvals, rejections=rejections,
                          required=approval.required)
    if not pending or overdue:
        return state
    role = approval.viewer_role
    if ROLE_ORDER[role] < ROLE_ORDER[Role.APPROVER]:
        state.refusal = (f"You can read this request, but deciding needs the approver role in "
                         f"{approval.tenant.name}; you are a {role}.")
    elif is_requester(approval, user):
        state.refusal = ("You asked for this action, or it acts on your behalf, so someone else must decide "
                         "(separation of duties).")
    elif any(d.user_id == user.pk for d in decisions):
        state.refusal = (f"You approved this. It needs {state.missing} more approval(s) from other people "
                         "before it runs.")
    else:
        state.can_decide = True
    return state


# --- the preview in words ---------------------------------------------------------------------------

def pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@dataclass
class PreviewView:
    """The stored preview of a request, arranged for reading."""

    args: list[dict]
    target: str
    diff: list[dict]
    no_diff_reason: str
    compensation: str
    undoes: str
    intent: dict
    heading: str
    why: list = field(default_factory=list)  # why the tool's rules ask a person (approvals/surfaces.py, `why`)
    amounts: str = ""  # what the request is about, in money (approvals/surfaces.py, `amounts`)
    undo: dict | None = None  # for an undo, Unwind's words about it (approvals/surfaces.py, `undo`)


# What the "what the action does" panel is called as the step moves on: a request is read before the
# step runs and long after it (a decided request is a record), so its heading follows the step's state.
HEADINGS = {
    ActionStatus.SUCCEEDED: "What happened", ActionStatus.FAILED: "What was tried",
    ActionStatus.LOST: "What was tried", ActionStatus.RUNNING: "What is happening",
    ActionStatus.RETRY_SCHEDULED: "What is being tried", ActionStatus.COMPENSATING: "What is being undone",
    ActionStatus.COMPENSATED: "What was undone", ActionStatus.COMPENSATION_FAILED: "What happened (undoing it failed)",
    ActionStatus.REJECTED: "What was asked (not done)", ActionStatus.EXPIRED: "What was asked (not done)",
    ActionStatus.SKIPPED: "What was asked (not done)",
}


def heading_for(action) -> str:
    return HEADINGS.get(action.status, "What will happen")


def preview_view(approval: ApprovalRequest) -> PreviewView:
    preview = approval.preview or {}
    args = preview.get("args") or {}
    display = approval.action.tool.display or {}
    # An undo's before-state is the undone step's target as that step left it: its values read as that step's tool
    # reads them (a charge's amount_cents as money), with that step's arguments (the currency).
    forward = approval.action.compensates if approval.is_compensation else None
    before_display, before_args = (forward.tool.display or {}, forward.args) if forward else (display, args)
    return PreviewView(
        args=[{"name": name, **shown_value(value, name=name, display=display, args=args)}
              for name, value in sorted(args.items())],
        target=describe_target(preview, approval.action.tool),
        diff=diff_rows(preview.get("before"), preview.get("proposed") or {}, display=before_display,
                       args=before_args),
        no_diff_reason=no_diff_reason(preview, approval),
        compensation="" if approval.is_compensation else compensation_words(
            preview, plan=approval.action.compensation_plan or {}, tenant=approval.tenant, risk=approval.risk),
        undoes=undoes_words(preview.get("undoes"), display=before_display),
        intent=intent_of({} if approval.is_compensation else preview.get("intent") or {}),
        heading=heading_for(approval.action),
        why=surfaces.why(approval),
        amounts=", ".join(surfaces.amounts(approval.action)),
        undo=surfaces.undo(approval),
    )


def describe_target(preview: dict, tool: Tool) -> str:
    target = preview.get("target") or {}
    kind = target.get("type") or "target"
    if target.get("id"):
        return f"{kind} {target['id']}"
    if tool.target_from.startswith("result."):
        return f"a new {kind}: its id ({tool.target_from.split('.', 1)[1]}) is known once the call returns"
    return "no single target (the tool does not name one)"


def diff_rows(before, proposed: dict, *, display: dict | None = None, args: dict | None = None) -> list[dict]:
    """The before-snapshot against the proposed args on the same keys."""
    if not isinstance(before, dict):
        return []
    rows = []
    for name in sorted(before):
        old = shown_value(before[name], name=name, display=display or {}, args=args or {})
        if name in proposed:
            new = shown_value(proposed[name], name=name, display=display or {}, args=args or {})
            rows.append({"field": name, "before": old, "after": new, "changed": before[name] != proposed[name]})
        else:
            rows.append({"field": name, "before": old, "after": None, "changed": False})
    return rows


def no_diff_reason(preview: dict, approval: ApprovalRequest) -> str:
    if isinstance(preview.get("before"), dict):
        return ""
    if not (preview.get("target") or {}).get("id"):
        return "The target does not exist before this call, so there is no earlier state to compare with."
    if not approval.action.tool.snapshot.get("read"):
        return f"{approval.action.tool.name} has no reader for its target, so Unwind cannot show the state before it."
    return "Unwind could not read the target's state before the call."


def describe_value(template, context: dict) -> str:
    """A compensation argument in words: resolved where the preview already knows it, named where it does not."""
    if isinstance(template, str) and template.startswith("$") and not template.startswith("$$"):
        try:
            return pretty(mapping.resolve(template, context))
        except mapping.MappingError:
            root, _, path = template[1:].partition(".")
            name = path or root
            return {
                "result": f"the {name} this call returns",
                "after": f"the {name} as it is after this call",
                "before": f"the {name} as it was before this call",
                "target": "the target's id",
                "key": "this action's idempotency key",
            }.get(root, template)
    if isinstance(template, dict) and set(template) == {"$concat"}:
        return " + ".join(describe_value(part, context) for part in template["$concat"])
    if isinstance(template, dict) and set(template) == {"$default"}:
        path, fallback = template["$default"]
        return f"{describe_value(path, context)} (or {describe_value(fallback, context)} when that is missing)"
    if isinstance(template, dict):
        return "{" + ", ".join(f"{k}: {describe_value(v, context)}" for k, v in template.items()) + "}"
    if isinstance(template, str) and template.startswith("$$"):
        return pretty(template[1:])
    return pretty(template)


def compensation_words(preview: dict, *, plan: dict, tenant: Tenant, risk: str) -> str:
    """The compensation plan as a sentence: "If this is undone later, Unwind will call … with …"."""
    compensation = preview.get("compensation") or {}
    strategy = compensation.get("strategy")
    tool = compensation.get("tool")
    if strategy in (None, "", CompensationStrategy.NONE) or not tool:
        return ("This action has no compensation: if the run is undone later, its effect stays, and the run goes "
                "to the recovery queue with a note saying so.")
    target = (preview.get("target") or {}).get("id") or None
    context = {"args": preview.get("args") or {}, "target": target}
    if isinstance(preview.get("before"), dict):
        context["before"] = preview["before"]
    arguments = sorted((compensation.get("args") or {}).items())
    described = [f"{name} = {describe_value(value, context)}" for name, value in arguments]
    with_args = f"with {', '.join(described)}" if described else "with no arguments"
    sentence = {
        CompensationStrategy.SNAPSHOT: f"If this is undone later, Unwind will restore the state from before it by "
                                       f"calling {tool} {with_args}. If someone else has changed the target by "
                                       f"then, it will not overwrite their change; it asks a person instead.",
        CompensationStrategy.CORRECTION: f"This cannot be taken back. If the run is undone later, Unwind will send a "
                                         f"correction by calling {tool} {with_args}.",
    }.get(strategy, f"If this is undone later, Unwind will call {tool} {with_args}.")
    comp_risk = plan.get("risk", risk)
    needed = approvals_needed(rule=plan.get("approval", "threshold"), risk=comp_risk,
                              required=plan.get("approvals_required", 1), threshold=tenant.approval_threshold)
    if needed:
        sentence += f" That call is {comp_risk} risk and will itself wait for {needed} approval(s)."
    return sentence


def undoes_words(undoes: dict | None, *, display: dict) -> str:
    """"This undoes step 3, payments.charge called with amount_cents = €610.00 (61000 as sent), …": the undone
    step's arguments as its tool's display hint reads them."""
    if not undoes:
        return ""
    sent = undoes.get("args") or {}
    args = ", ".join(f"{name} = {surfaces.value_text(value, name=name, display=display, args=sent)}"
                     for name, value in sorted(sent.items()))
    return f"This undoes step {undoes.get('seq')}, {undoes.get('tool')} called with {args or 'no arguments'}."


def intent_of(intent: dict) -> dict:
    confidence = intent.get("confidence")
    if isinstance(confidence, (int, float)) and not isinstance(confidence, bool) and 0 <= confidence <= 1:
        confidence = f"{confidence:.0%}"
    return {"goal": intent.get("goal") or "", "reasoning": intent.get("reasoning") or "",
            "confidence": "" if confidence is None else str(confidence), "model": intent.get("model") or ""}
