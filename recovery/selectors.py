"""Reads for the operator console: the recovery queue, runs, and one run's timeline.

Every read is scoped to the tenants the person is a member of; an object of another tenant is simply
not found. List reads cost a constant number of queries per page, whatever the table size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Case, Count, IntegerField, OuterRef, Prefetch, Q, QuerySet, Subquery, Value, When
from django.db.models.functions import Coalesce
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest
from ledger.audit.chain import FINGERPRINT_KEYS
from ledger.audit.sealed import by_seq
from ledger.db.partitions import recent
from ledger.policy.display import shown_value
from ledger.models import (
    RISK_ORDER, ROLE_ORDER, Action, ActionKind, ActionStatus, Attempt, AuditEvent, Checkpoint, Membership, Role, Run,
)
from recovery.models import ItemStatus, RecoveryItem
from recovery.saga import mark_undoable, saga_strip

AGE_BUCKETS: dict[str, tuple[str, timedelta | None, timedelta | None]] = {
    "1h": ("under an hour", None, timedelta(hours=1)),
    "24h": ("1 to 24 hours", timedelta(hours=1), timedelta(hours=24)),
    "7d": ("1 to 7 days", timedelta(hours=24), timedelta(days=7)),
    "older": ("older than 7 days", timedelta(days=7), None),
}
TIMELINE_AUDIT_LIMIT = 1000


@dataclass(frozen=True)
class Access:
    """What one person may see and do: their role in each tenant they belong to."""

    roles: dict[int, str]
    tenants: dict[int, object]

    @property
    def tenant_ids(self) -> list[int]:
        return list(self.roles)

    def can_operate(self, tenant_id: int) -> bool:
        role = self.roles.get(tenant_id)
        return role is not None and ROLE_ORDER[role] >= ROLE_ORDER[Role.OPERATOR]

    @property
    def operates_anywhere(self) -> bool:
        return any(self.can_operate(tenant_id) for tenant_id in self.roles)


def access_for(user) -> Access:
    memberships = Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")
    return Access(roles={m.tenant_id: m.role for m in memberships}, tenants={m.tenant_id: m.tenant for m in memberships})


def pretty_json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def dress(action: Action) -> Action:
    """Attach the JSON renderings the pages show (templates cannot call functions with arguments)."""
    action.args_json = pretty_json(action.args)
    action.result_json = pretty_json(action.result) if action.result is not None else ""
    preview = (action.compensation_plan or {}).get("args_preview")
    action.preview_json = pretty_json(preview) if preview is not None else ""
    action.plan_args_json = pretty_json((action.compensation_plan or {}).get("args", {}))
    action.intent_reasoning = (action.intent or {}).get("reasoning", "")
    return action


# --- recovery queue ---------------------------------------------------------------------------------

RISK_RANK = Case(*[When(risk=risk, then=Value(rank)) for risk, rank in RISK_ORDER.items()],
                 default=Value(-1), output_field=IntegerField())
QUEUE_SORTS = {
    "newest": ("-created_at", "-id"),
    "oldest": ("created_at", "id"),
    "risk": ("-risk_rank", "-created_at", "-id"),
    "reason": ("reason", "-created_at", "-id"),
    "tool": ("tool_name", "-created_at", "-id"),
    "tenant": ("tenant__slug", "-created_at", "-id"),
}


def queue_filter(*, access: Access, q: str = "", tenant: int | None = None, reason: str = "", risk: str = "",
                 age: str = "", status: str = ItemStatus.OPEN, tool: str = "", now=None) -> QuerySet[RecoveryItem]:
    """The queue's items matching the filters, without the reason filter's effect on `queue_counts`."""
    items = RecoveryItem.objects.filter(tenant_id__in=access.tenant_ids)
    if tenant is not None:
        items = items.filter(tenant_id=tenant)
    if status in ItemStatus.values:
        items = items.filter(status=status)
    if risk:
        items = items.filter(risk=risk)
    if tool:
        items = items.filter(tool_name=tool)
    if age in AGE_BUCKETS:
        now = now or timezone.now()
        _, younger, older = AGE_BUCKETS[age]
        if younger is not None:
            items = items.filter(created_at__lte=now - younger)
        if older is not None:
            items = items.filter(created_at__gt=now - older)
    q = q.strip()
    if q:
        match = (Q(detail__icontains=q) | Q(tool_name__icontains=q) | Q(run__goal__icontains=q)
                 | Q(run__on_behalf_of__icontains=q) | Q(resolved_by__icontains=q))
        if q.isdigit():
            match |= Q(pk=int(q)) | Q(run_id=int(q))
        items = items.filter(match)
    return items


def queue_page_items(items: QuerySet[RecoveryItem], *, reason: str = "", sort: str = "newest") -> QuerySet[RecoveryItem]:
    if reason:
        items = items.filter(reason=reason)
    return (items.select_related("tenant", "run", "run__agent")
            .defer("run__intent", "run__plan", "run__attention_detail")
            .annotate(risk_rank=RISK_RANK)
            .order_by(*QUEUE_SORTS.get(sort, QUEUE_SORTS["newest"])))


def queue_counts(items: QuerySet[RecoveryItem]) -> list[dict]:
    """How many items each reason has, among the items the other filters select (one query)."""
    rows = items.order_by().values("reason").annotate(n=Count("id")).order_by("-n", "reason")
    labels = dict(RecoveryItem._meta.get_field("reason").choices)
    return [{"reason": row["reason"], "label": labels.get(row["reason"], row["reason"]), "n": row["n"]} for row in rows]


def queue_tool_names(access: Access) -> list[str]:
    return list(RecoveryItem.objects.filter(tenant_id__in=access.tenant_ids).exclude(tool_name="")
                .order_by("tool_name").values_list("tool_name", flat=True).distinct())


def item_get(*, access: Access, pk: int) -> RecoveryItem | None:
    return (RecoveryItem.objects.filter(tenant_id__in=access.tenant_ids, pk=pk)
            .select_related("tenant", "run", "run__agent", "action", "action__tool").first())


def items_for_bulk(*, access: Access, ids: list[int]) -> list[RecoveryItem]:
    return list(RecoveryItem.objects.filter(tenant_id__in=access.tenant_ids, pk__in=ids)
                .select_related("tenant", "run").order_by("-created_at", "-id"))


def item_failure(item: RecoveryItem) -> dict | None:
    """The attempt that failed, for "What failed and why": the compensation's when undoing the step failed.

    A recovery item points at the forward step; when that step stands but its compensation failed (drift, a
    refused or erroring undo), the forward call's attempts all succeeded and say nothing about the failure.
    """
    forward = item.action
    if forward is None:
        return None
    failing = forward
    if forward.status in (ActionStatus.COMPENSATION_FAILED, ActionStatus.COMPENSATING):
        failing = (Action.objects.filter(compensates=forward, kind=ActionKind.COMPENSATION)
                   .select_related("tool").order_by("-seq").first()) or forward
    return {"forward": forward, "action": failing, "is_compensation": failing.pk != forward.pk,
            "attempts": list(Attempt.objects.filter(action_id=failing.pk, started_at__gte=recent(failing.created_at))
                             .order_by("number"))}


def drift_comparison(failure: dict | None) -> dict | None:
    """For a compensation refused because of drift: each field before the step, as the agent left it, and now.

    "Now" is what the drift check read when it refused to overwrite (recorded on the compensation's failure
    event); nothing is read from the tool to draw this page.
    """
    if not failure or not failure["is_compensation"] or failure["action"].error_class != "drift":
        return None
    forward, compensation = failure["forward"], failure["action"]
    event = next(iter(by_seq(AuditEvent.objects.filter(tenant_id=compensation.tenant_id, action_ref=compensation.pk,
                                                       created_at__gte=recent(compensation.created_at),
                                                       kind="compensation.failed"), newest_first=True)), None)
    now = (event.data or {}).get("current") if event is not None else None
    before, after = forward.before, forward.after
    if not all(isinstance(v, dict) for v in (before, after, now)):
        return {"rows": [{"field": "state", "before": before, "after": after, "now": now,
                          "agent_changed": before != after, "drifted": after != now}],
                "read_at": event.created_at if event else None, "forward": forward, "compensation": compensation}
    fields = list(dict.fromkeys([*before, *after, *now]))
    rows = [{"field": f, "before": before.get(f), "after": after.get(f), "now": now.get(f),
             "agent_changed": before.get(f) != after.get(f), "drifted": after.get(f) != now.get(f)} for f in fields]
    return {"rows": rows, "read_at": event.created_at, "forward": forward, "compensation": compensation,
            "drifted_fields": [r["field"] for r in rows if r["drifted"]]}


def compensation_preview(run: Run) -> list[Action]:
    """The forward steps an unwind would still touch, newest first, each with its compensation plan."""
    return [dress(a) for a in run.actions.filter(kind=ActionKind.FORWARD, status__in=[
        ActionStatus.SUCCEEDED, ActionStatus.COMPENSATING, ActionStatus.COMPENSATION_FAILED, ActionStatus.LOST,
    ]).select_related("tool").order_by("-seq")]


def runs_filter(*, access: Access, q: str = "", tenant: int | None = None, status: str = "") -> QuerySet[Run]:
    runs = Run.objects.filter(tenant_id__in=access.tenant_ids)
    if tenant is not None:
        runs = runs.filter(tenant_id=tenant)
    if status:
        runs = runs.filter(status=status)
    q = q.strip()
    if q:
        match = Q(goal__icontains=q) | Q(on_behalf_of__icontains=q) | Q(agent__name__icontains=q)
        if q.isdigit():
            match |= Q(pk=int(q))
        runs = runs.filter(match)
    open_item = RecoveryItem.objects.filter(run=OuterRef("pk"), status=ItemStatus.OPEN).values("pk")[:1]
    # Per-run counts as correlated subqueries, not a join + GROUP BY: the database computes them for the
    # page's rows only, and the paginator's count skips them (a join over 1M actions took seconds).
    return (runs.select_related("tenant", "agent").defer("intent", "plan", "attention_detail")
            .annotate(forward_steps=actions_of_kind(ActionKind.FORWARD),
                      compensations=actions_of_kind(ActionKind.COMPENSATION),
                      open_item_id=Subquery(open_item))
            .order_by("-created_at", "-id"))


def actions_of_kind(kind: str):
    counted = (Action.objects.filter(run=OuterRef("pk"), kind=kind).order_by().values("run")
               .annotate(n=Count("pk")).values("n")[:1])
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def run_get(*, access: Access, pk: int) -> Run | None:
    return Run.objects.filter(tenant_id__in=access.tenant_ids, pk=pk).select_related("tenant", "agent").first()


def _shown_args(action: Action) -> list[dict]:
    """The action's arguments as its tool version's display hints show them (money as "€920.00")."""
    args = action.args if isinstance(action.args, dict) else {}
    return [{"name": name, **shown_value(value, name=name, display=action.tool.display, args=args)}
            for name, value in sorted(args.items())]


def snapshot_diff(before, after) -> list[dict]:
    """Field-by-field comparison of two snapshots, for the timeline's before/after view."""
    if not isinstance(before, dict) and not isinstance(after, dict):
        if before is None and after is None:
            return []
        return [{"field": "state", "before": before, "after": after, "changed": before != after}]
    before, after = before or {}, after or {}
    fields = list(dict.fromkeys([*before.keys(), *after.keys()]))
    return [{"field": f, "before": before.get(f), "after": after.get(f), "changed": before.get(f) != after.get(f)}
            for f in fields]


def audit_summary(event: AuditEvent) -> dict:
    """An event's data without the row fingerprints, which only `verify_audit` reads."""
    return {k: v for k, v in (event.data or {}).items() if k not in FINGERPRINT_KEYS}


def run_timeline(run: Run) -> dict:
    """Everything that happened to a run, as one list sorted by time, plus its actions in order."""
    approvals = Prefetch("approval_requests", queryset=ApprovalRequest.objects.order_by("created_at").prefetch_related(
        Prefetch("decisions", queryset=ApprovalDecision.objects.select_related("user").order_by("created_at"))))
    actions = list(run.actions.select_related("tool").prefetch_related(
        Prefetch("attempt_set", queryset=Attempt.objects.filter(started_at__gte=recent(run.created_at)).order_by("number")), approvals).order_by("seq"))
    by_id = {a.pk: a for a in actions}
    for action in actions:
        dress(action)
        action.attempt_list = list(action.attempt_set.all())
        action.approval_list = list(action.approval_requests.all())
        action.diff = snapshot_diff(action.before, action.after)
        action.shown_args = _shown_args(action)
        action.undone_by = []
        action.undoes = None
    mark_undoable(actions)
    for action in actions:
        if action.compensates_id is not None and action.compensates_id in by_id:
            action.undoes = by_id[action.compensates_id]
            by_id[action.compensates_id].undone_by.append(action)
    since = recent(run.created_at)  # every row below was written after the run was: older partitions are skipped
    checkpoints = list(Checkpoint.objects.filter(run=run, created_at__gte=since).order_by("id"))
    events = list(AuditEvent.objects.filter(run_ref=run.pk, tenant_id=run.tenant_id, created_at__gte=since)
                  .order_by("seq")[:TIMELINE_AUDIT_LIMIT + 1])
    truncated = len(events) > TIMELINE_AUDIT_LIMIT
    events = events[:TIMELINE_AUDIT_LIMIT]
    items = list(RecoveryItem.objects.filter(run=run).order_by("created_at", "id"))

    entries = []
    for action in actions:
        entries.append({"at": action.created_at, "order": 1, "kind": "action", "action": action})
        for request in action.approval_list:
            entries.append({"at": request.created_at, "order": 3, "kind": "approval", "request": request,
                            "action": action, "decisions": list(request.decisions.all())})
    for checkpoint in checkpoints:
        entries.append({"at": checkpoint.created_at, "order": 4, "kind": "checkpoint", "checkpoint": checkpoint})
    for item in items:
        entries.append({"at": item.created_at, "order": 5, "kind": "recovery_opened", "item": item})
        if item.resolved_at:
            entries.append({"at": item.resolved_at, "order": 5, "kind": "recovery_resolved", "item": item})
    for event in events:
        entries.append({"at": event.created_at, "order": 2, "kind": "audit", "event": event,
                        "data": audit_summary(event)})
    entries.sort(key=lambda e: (e["at"], e["order"]))
    open_item = next((i for i in items if i.status == ItemStatus.OPEN), None)
    return {
        "actions": actions,
        "strip": saga_strip(run, actions, stop_action_id=open_item.action_id if open_item else None),
        "entries": [e for e in entries if e["kind"] != "audit"],
        "audit": [e for e in entries if e["kind"] == "audit"],
        "items": items,
        "open_item": open_item,
        "audit_truncated": truncated,
    }


# --- outbox -----------------------------------------------------------------------------------------

def erasure_tenant_ids(access: Access) -> list[int]:
    """The tenants in which a person may erase someone's data at their request: those they administer."""
    return [tenant_id for tenant_id, role in access.roles.items() if role == Role.ADMIN]


def outbox_tenant_ids(access: Access) -> list[int]:
    """The tenants whose outgoing email a person may read: those they operate (operator or admin).

    The messages carry what only operators may hand out (share links to correction trails) and what approvers
    act on, so a viewer or an approver of the tenant does not read them here, and nobody reads another tenant's.
    """
    return [tenant_id for tenant_id in access.roles if access.can_operate(tenant_id)]


def _emails(access: Access) -> QuerySet:
    """The outbox rows that are (or will be) an email to a person, of the tenants the person operates. A digest's
    entries are not: each is a line the digest email gathers when it is sent (approvals/services.py), and the digest
    itself is listed."""
    from approvals.models import Notification
    from approvals.services import DIGEST_ENTRY

    return Notification.objects.filter(tenant_id__in=outbox_tenant_ids(access)).exclude(kind=DIGEST_ENTRY)


def outbox_messages(access: Access) -> QuerySet:
    """The emails of the tenants the person operates, newest first (the `outbox_due` index is for the sender)."""
    return _emails(access).select_related("tenant").defer("body_html").order_by("-created_at", "-id")


def outbox_message(access: Access, pk: int):
    """One email, or None when there is none with that id among the tenants the person operates."""
    return _emails(access).filter(pk=pk).select_related("tenant").first()
