"""Operator console pages: the recovery queue, one item, runs and their timelines, correction trails, metrics.

Views read through `recovery.selectors` and decide through `recovery.services`; who may do what is the
services' rule (they check the role), the pages only hide what a person cannot use.
"""
from __future__ import annotations

import json

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST, require_safe

from ledger.engine import holds, moves
from ledger.api import selectors as ledger_selectors
from ledger.archive import reader as archive_reader
from ledger.db.partitions import recent
from ledger.errors import ArchiveUnavailable, NotFound, PermissionDenied, StateConflict, UnwindError, ValidationFailed
from ledger.models import ActionStatus, Role, Run, RunStatus, Tool
from ledger.engine.runs import resume_refusal
from ledger.engine.undo_plans import undo_draft
from ledger.engine.unknowns import unknown_steps
from recovery import requests as customer_requests, selectors, services, stops
from recovery.forms import (
    OPERATIONS, BulkForm, MetricsForm, operations_for, QueueFilterForm, ResolveForm, RunFilterForm, UndoPlanForm,
)
from recovery.metrics import console_metrics, metrics_charts, seconds
from recovery.models import ItemStatus, RecoveryItem
from recovery.trail import (
    correction_trail, share_max_age, trail_links_active,
)

QUEUE_PAGE_SIZE = 25
HELD_SHOWN = 50  # held steps listed above the queue, soonest first (a hold lasts an hour at most)
RUNS_PAGE_SIZE = 30
RESOLVERS = {
    "resume": services.recovery_resume,
    "compensate": services.recovery_compensate,
    "close": services.recovery_close,
}


def forbidden(request, detail: str):
    return render(request, "recovery/refused.html", {"title": "Not allowed", "detail": detail}, status=403)


def _role_refusal(access: selectors.Access, tenant_id: int) -> str:
    tenant = access.tenants.get(tenant_id)
    role = access.roles.get(tenant_id)
    return (f"Resolving recovery items needs the operator role in {tenant.slug if tenant else 'this tenant'}; "
            f"you are {'a ' + role if role else 'not a member'}, so you can read this page but not act on it.")


# --- where a person lands ----------------------------------------------------------------------------

@login_required
def home(request):
    """Where "/" and a login without `next` lead: approvers to their inbox, everyone else to the recovery queue.

    An approver's work is the inbox; the queue is an operator's (an approver can read it but act on nothing
    there). Someone who operates in any tenant lands on the queue, whatever else they are elsewhere.
    """
    access = selectors.access_for(request.user)
    if not access.roles:  # a superuser, say: an empty queue would read as "nothing is waiting"
        return render(request, "recovery/no_role.html")
    approves = any(role == Role.APPROVER for role in access.roles.values())
    if approves and not access.operates_anywhere:
        return redirect("approvals:inbox")
    return redirect("recovery:queue")


# --- recovery queue ---------------------------------------------------------------------------------

@login_required
def queue(request):
    access = selectors.access_for(request.user)
    form = QueueFilterForm(request.GET, access=access, tool_names=selectors.queue_tool_names(access))
    filters = form.filters()
    base = selectors.queue_filter(access=access, q=filters["q"], tenant=filters["tenant"], risk=filters["risk"],
                                  age=filters["age"], status=filters["status"], tool=filters["tool"])
    counts = selectors.queue_counts(base)
    items = selectors.queue_page_items(base, reason=filters["reason"], sort=filters["sort"])
    page = Paginator(items, QUEUE_PAGE_SIZE).get_page(request.GET.get("page"))
    context = {
        "form": form, "filters": filters, "page": page, "counts": counts, "access": access,
        "held": stops.with_stop_moves(list(holds.held_steps(
            tenant_ids=[t for t in access.roles if access.can_operate(t)])[:HELD_SHOWN])),
        "total": sum(c["n"] for c in counts), "can_bulk": access.operates_anywhere,
        "operable": {tenant_id for tenant_id in access.roles if access.can_operate(tenant_id)},
        "now": timezone.now(),
    }
    template = "recovery/_queue_results.html" if request.htmx else "recovery/queue.html"
    return render(request, template, context)


def _undo_plan(access, item: RecoveryItem, form: UndoPlanForm | None = None) -> dict | None:
    """A step found done whose record its undo cannot be put together from: what reading it back found, and the
    undo to complete (a form prefilled with what could be resolved, for an operator while the item is open)."""
    step = item.action
    if item.reason != "read_back_incomplete" or step is None or "read_back" not in (step.verification or {}):
        return None
    draft = undo_draft(step) if step.status == ActionStatus.SUCCEEDED else None
    completable = draft is not None and draft.tool is not None and item.status == ItemStatus.OPEN \
        and access.can_operate(item.tenant_id)
    if completable and form is None:
        form = UndoPlanForm(initial={"args": json.dumps(draft.prefilled, indent=2, ensure_ascii=False),
                                     "then": "compensate"})
    return {
        "step": step, "draft": draft, "form": form if completable else None,
        "evidence": json.dumps(step.verification["read_back"].get("evidence"), indent=2, ensure_ascii=False),
        "by": step.verification["read_back"].get("by"),
        "template": json.dumps(step.compensation_plan.get("args", {}), indent=2, ensure_ascii=False),
        "completed": json.dumps(step.compensation_plan["completed_args"], indent=2, ensure_ascii=False)
        if "completed_args" in step.compensation_plan else "",
        "completed_by": step.compensation_plan.get("completed_by", ""),
        "schema": json.dumps(draft.tool.args_schema, indent=2) if draft is not None and draft.tool else "",
    }


def _item_context(access, item: RecoveryItem, *, undo_form: UndoPlanForm | None = None) -> dict:
    run = item.run
    cannot_resume = resume_refusal(run) if item.status == ItemStatus.OPEN else ""
    return {
        "customer_requests": customer_requests.requests_for(run), "can_reply": access.can_operate(item.tenant_id),
        "undo_plan": _undo_plan(access, item, undo_form),
        "item": item, "run": run,
        "failure": (failure := selectors.item_failure(item)),
        "drift": selectors.drift_comparison(failure),
        "plans": selectors.compensation_preview(run),
        "timeline": selectors.run_timeline(run),
        "can_operate": access.can_operate(item.tenant_id) and item.status == ItemStatus.OPEN,
        "role": access.roles.get(item.tenant_id),
        "operations": operations_for(item) if item.status == ItemStatus.OPEN else {},
        "cannot_resume": cannot_resume,
        "reopened": (RecoveryItem.objects.filter(run=run, status=ItemStatus.OPEN).exclude(pk=item.pk).first()
                     if item.status == ItemStatus.RESOLVED else None),
    }


@login_required
def item_detail(request, pk: int):
    access = selectors.access_for(request.user)
    item = selectors.item_get(access=access, pk=pk)
    if item is None:
        raise Http404("No such recovery item")
    return render(request, "recovery/item.html", _item_context(access, item))


def _resolve_form(item: RecoveryItem, operation: str, data=None) -> ResolveForm:
    unknown = len(unknown_steps(item.run)) if operation == "compensate" else 0
    return ResolveForm(data, operation=operation, unknown_steps=unknown)


def _confirm_context(item: RecoveryItem, operation: str, form: ResolveForm) -> dict:
    move = operations_for(item).get(operation)
    return {
        "unknown_steps": list(unknown_steps(item.run)) if operation == "compensate" else [],
        "item": item, "run": item.run, "operation": operation, "move": move,
        "label": move.label if move else OPERATIONS[operation], "form": form,
        "plans": [selectors.dress(a) for a in move.undoes] if move and operation == "compensate" else [],
        "retries": move.touching(moves.RETRY, moves.RESEND) if move and operation == "resume" else [],
        "checkpoint": item.run.checkpoints.filter(created_at__gte=recent(item.run.created_at)).order_by("-id").first(),
    }


@login_required
def item_resolve(request, pk: int, operation: str):
    """GET: the confirmation (a panel for htmx, a page without JS). POST: the decision, through the service."""
    if operation not in OPERATIONS:
        raise Http404("No such operation")
    access = selectors.access_for(request.user)
    item = selectors.item_get(access=access, pk=pk)
    if item is None:
        raise Http404("No such recovery item")
    if request.method == "GET":
        if not access.can_operate(item.tenant_id):
            return forbidden(request, _role_refusal(access, item.tenant_id))
        if item.status != ItemStatus.OPEN:
            moved_on = (f"Refused: this item was already {item.resolution or item.status} "
                        f"by {item.resolved_by or 'someone'}.")
            if request.htmx:
                return render(request, "recovery/_refusal_panel.html", {"refusal": moved_on, "item": item}, status=409)
            context = _item_context(access, item) | {"refusal": moved_on}
            return render(request, "recovery/item.html", context, status=409)
        if operation not in operations_for(item):
            refused = f"Refused: {moves.run_moves(item.run).get(moves.OPERATOR, operation).refusal}."
            if request.htmx:
                return render(request, "recovery/_refusal_panel.html", {"refusal": refused, "item": item}, status=409)
            return render(request, "recovery/item.html", _item_context(access, item) | {"refusal": refused}, status=409)
        template = "recovery/_confirm_panel.html" if request.htmx else "recovery/confirm.html"
        return render(request, template, _confirm_context(item, operation, _resolve_form(item, operation)))
    if request.method != "POST":
        return render(request, "recovery/refused.html", {"title": "Method not allowed",
                                                         "detail": "Use the buttons on the item page."}, status=405)
    form = _resolve_form(item, operation, request.POST)
    if not form.is_valid():
        if not access.can_operate(item.tenant_id):
            return forbidden(request, _role_refusal(access, item.tenant_id))
        return render(request, "recovery/confirm.html", _confirm_context(item, operation, form), status=400)
    try:
        extra = {"unknown": form.cleaned_data["unknown"]} if "unknown" in form.cleaned_data else {}
        item = RESOLVERS[operation](item=item, user=request.user, reason=form.cleaned_data["reason"], **extra)
    except PermissionDenied:
        return forbidden(request, _role_refusal(access, item.tenant_id))
    except StateConflict as refusal:
        item.refresh_from_db()
        context = _item_context(access, item) | {"refusal": f"Refused: {refusal.detail}."}
        return render(request, "recovery/item.html", context, status=409)
    except ValidationFailed as refusal:
        form.add_error("reason", refusal.detail)
        return render(request, "recovery/confirm.html", _confirm_context(item, operation, form), status=400)
    messages.success(request, _outcome(item, operation))
    return redirect("recovery:item", pk=item.pk)


@login_required
def item_undo_plan(request, pk: int):
    """POST: the undo an operator completed for a `read_back_incomplete` item's step, then compensate or resume."""
    access = selectors.access_for(request.user)
    item = selectors.item_get(access=access, pk=pk)
    if item is None:
        raise Http404("No such recovery item")
    if request.method != "POST":
        return render(request, "recovery/refused.html", {"title": "Method not allowed",
                                                         "detail": "Complete the undo on the item page."}, status=405)
    if not access.can_operate(item.tenant_id):
        return forbidden(request, _role_refusal(access, item.tenant_id))
    form = UndoPlanForm(request.POST)
    if not form.is_valid():
        return render(request, "recovery/item.html", _item_context(access, item, undo_form=form), status=400)
    then = form.cleaned_data["then"]
    try:
        item = services.recovery_complete_undo(item=item, user=request.user, args=form.cleaned_data["args"], then=then,
                                               reason=form.cleaned_data["reason"])
    except PermissionDenied:
        return forbidden(request, _role_refusal(access, item.tenant_id))
    except StateConflict as refusal:
        item.refresh_from_db()
        context = _item_context(access, item) | {"refusal": f"Refused: {refusal.detail}."}
        return render(request, "recovery/item.html", context, status=409)
    except ValidationFailed as refusal:
        form.add_error("args", f"{refusal.detail}.")
        return render(request, "recovery/item.html", _item_context(access, item, undo_form=form), status=400)
    messages.success(request, "Undo completed and recorded as yours. " + _outcome(item, then))
    return redirect("recovery:item", pk=item.pk)


def _outcome(item: RecoveryItem, operation: str) -> str:
    run = item.run
    run.refresh_from_db()
    status = run.get_status_display()
    if run.status == RunStatus.NEEDS_ATTENTION:
        again = RecoveryItem.objects.filter(run=run, status=ItemStatus.OPEN).values_list("pk", flat=True).first()
        return (f"{OPERATIONS[operation]} recorded, but run {run.pk} needs attention again"
                f"{f' (item {again})' if again else ''}: {run.attention_detail}")
    if operation == "compensate":
        if run.status == RunStatus.COMPENSATED:
            return f"Compensated: every step of run {run.pk} that could be undone was undone; the run is {status}."
        return f"Compensation started: run {run.pk} is {status} (a step may wait for an approval or a retry)."
    if operation == "resume":
        return f"Resumed: run {run.pk} is {status}; its failed steps are retried with their same idempotency keys."
    return f"Closed: run {run.pk} is marked as handled ({status})."


@login_required
@require_POST
def bulk(request):
    """Close or compensate many items of one reason, each through the same service as one at a time."""
    access = selectors.access_for(request.user)
    form = BulkForm(request.POST)
    if not form.is_valid() and set(form.errors) - {"reason"}:
        return render(request, "recovery/bulk.html", {"form": form, "items": []}, status=400)
    ids = form.cleaned_data["items"]
    items = selectors.items_for_bulk(access=access, ids=ids)
    if len(items) != len(ids):
        raise Http404("Some of the selected recovery items do not exist")
    if not any(access.can_operate(item.tenant_id) for item in items):
        return forbidden(request, _role_refusal(access, items[0].tenant_id))
    reasons = sorted({item.get_reason_display() for item in items})
    operation = form.cleaned_data["operation"]
    context = {"form": form, "items": items, "operation": operation, "label": OPERATIONS[operation],
               "reason_label": reasons[0]}
    if len(reasons) > 1:
        context["refusal"] = ("Bulk actions apply to items of one reason at a time, so that one decision fits all "
                              f"of them; the selection has {len(reasons)}: {', '.join(reasons)}.")
        return render(request, "recovery/bulk.html", context, status=400)
    if form.errors:
        return render(request, "recovery/bulk.html", context, status=400)
    if not form.cleaned_data["confirmed"]:
        return render(request, "recovery/bulk.html", context)
    results = []
    for item in items:
        try:
            reason = form.cleaned_data.get("reason", "").strip()
            resolved = RESOLVERS[operation](item=item, user=request.user, reason=reason)
        except UnwindError as refusal:
            results.append({"item": item, "ok": False, "text": f"refused: {refusal.detail}"})
            continue
        results.append({"item": resolved, "ok": True, "text": _outcome(resolved, operation)})
    context["results"] = results
    context["done"] = sum(r["ok"] for r in results)
    return render(request, "recovery/bulk.html", context)


# --- runs -------------------------------------------------------------------------------------------

@login_required
def runs(request):
    access = selectors.access_for(request.user)
    form = RunFilterForm(request.GET, access=access)
    filters = form.filters()
    page = Paginator(selectors.runs_filter(access=access, **filters), RUNS_PAGE_SIZE).get_page(request.GET.get("page"))
    template = "recovery/_runs_results.html" if request.htmx else "recovery/runs.html"
    return render(request, template, {"form": form, "filters": filters, "page": page})


def run_or_404(request, pk: int):
    """The person's access and the run they may see, or a 404 (another tenant's run is not there for them)."""
    access = selectors.access_for(request.user)
    run = selectors.run_get(access=access, pk=pk)
    if run is None:
        raise Http404("No such run")
    return access, run


@login_required
def run_detail(request, pk: int):
    access = selectors.access_for(request.user)
    run = selectors.run_get(access=access, pk=pk)
    if run is None:
        return archived_run_page(request, access, pk)
    return run_page(request, access, run)


def archived_run_page(request, access: selectors.Access, pk: int):
    """A run moved to the archive (docs/archive.md), read from its segment: what it did, its trail and its history.
    Nothing can be done to it any more, so no move is offered."""
    try:
        view = archive_reader.archived_run(tenant_ids=access.tenant_ids, agent_id=None, run_id=pk)
    except NotFound:
        raise Http404("No such run") from None
    except ArchiveUnavailable as unavailable:
        return render(request, "recovery/refused.html", {"title": "Archived run unavailable",
                                                         "detail": unavailable.detail}, status=503)
    tools = {tool.pk: tool for tool in Tool.objects.filter(pk__in={a.tool_id for a in view.actions})}
    for action in view.actions:
        action.tool = tools[action.tool_id]
        action.args_json = selectors.pretty_json(action.args)
        action.result_json = selectors.pretty_json(action.result) if action.result is not None else ""
    return render(request, "recovery/archived_run.html", {
        "run": view.run, "view": view, "actions": view.actions, "attempts": view.attempts,
        "events": [{"seq": e.seq, "kind": e.kind, "actor": e.actor, "at": e.created_at, "action": e.action_ref}
                   for e in view.events],
        "trail": correction_trail(view.run, actions=view.actions, events=view.events)})


def run_page(request, access: selectors.Access, run: Run, *, new_link_url: str = ""):
    can_share = access.can_operate(run.tenant_id)
    timeline = selectors.run_timeline(run)
    for action in timeline["actions"]:
        if action.status == "held":
            action.stop_move = moves.stop_move(run, timeline["actions"], action, moves.OPERATOR)
    return render(request, "recovery/run.html", {
        "can_stop": can_share, "stoppable": [a.pk for a in timeline["actions"] if a.status == "held"
                                             and stops.stopper_role(request.user, a)],
        "run": run, "timeline": timeline, "trail": correction_trail(run),
        "share_days": share_max_age() / 86400, "share_links": trail_links_active(run), "can_share": can_share,
        "new_link_url": new_link_url, "can_send": can_share and "@" in run.on_behalf_of,
    })


# --- outbox -----------------------------------------------------------------------------------------

OUTBOX_PAGE_SIZE = 30


def _outbox_refusal(request, access: selectors.Access):
    if not access.roles:
        return forbidden(request, "You have no role in any tenant, so there is no outgoing email to show you.")
    return forbidden(request, "The outbox shows the email a tenant sends (approval requests, correction trails with "
                               "their share links) to its operators and admins; you are "
                               f"{', '.join(sorted(set(access.roles.values())))}.")


@login_required
@require_safe
def outbox(request):
    """The email Unwind has sent or will send for the tenants the person operates: subject, recipients, time."""
    access = selectors.access_for(request.user)
    if not selectors.outbox_tenant_ids(access):
        return _outbox_refusal(request, access)
    page = Paginator(selectors.outbox_messages(access), OUTBOX_PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "recovery/outbox.html", {"page": page, "several": len(access.roles) > 1})


@login_required
@require_safe
def outbox_message(request, pk: int):
    """One message as it was written to the outbox: its text body, and how sending it went."""
    access = selectors.access_for(request.user)
    if not selectors.outbox_tenant_ids(access):
        return _outbox_refusal(request, access)
    message = selectors.outbox_message(access, pk)
    if message is None:
        raise Http404("No such message")
    return render(request, "recovery/outbox_message.html", {"message": message})


# --- metrics ----------------------------------------------------------------------------------------

@login_required
def metrics(request):
    access = selectors.access_for(request.user)
    form = MetricsForm(request.GET, access=access)
    filters = form.filters()
    tenant = filters["tenant"]
    tenant_ids = access.tenant_ids if tenant is None else [tenant] if tenant in access.roles else []
    data = console_metrics(tenant_ids=tenant_ids, window=filters["window"])
    return render(request, "recovery/metrics.html", {
        "form": form, "data": data, "charts": metrics_charts(data),
        "unwind_p50": seconds(data["unwind_latency"]["p50"]), "unwind_p95": seconds(data["unwind_latency"]["p95"]),
        "approval_p50": seconds(data["approval_latency"]["p50"]),
        "approval_p95": seconds(data["approval_latency"]["p95"]),
    })


# --- policy versions --------------------------------------------------------------------------------

POLICY_PAGE_SIZE = 30


@login_required
def policy(request):
    """A tenant's policy history: every version of its defaults and of each tool, with what each one changed.

    Anyone with a role in the tenant may read it; policy is written through the API, `load_tools` or the admin.
    """
    access = selectors.access_for(request.user)
    if not access.roles:
        return forbidden(request, "You have no role in any tenant, so there is no policy to show you.")
    by_slug = {tenant.slug: tenant for tenant in access.tenants.values()}
    slug = request.GET.get("tenant") or next(iter(by_slug))
    tenant = by_slug.get(slug)
    if tenant is None:
        raise Http404("No such tenant")
    tool_name = request.GET.get("tool", "")[:120]
    page = Paginator(ledger_selectors.tool_versions(tenant_id=tenant.pk, name=tool_name),
                     POLICY_PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "recovery/policy.html", {
        "tenant": tenant, "tenants": sorted(by_slug), "tool_name": tool_name, "page": page,
        "tool_versions": ledger_selectors.tool_version_diffs(list(page.object_list)),
        "tool_names": ledger_selectors.tool_list(tenant_id=tenant.pk).values_list("name", flat=True),
        "defaults_versions": ledger_selectors.tenant_policy_versions(tenant_id=tenant.pk),
        "role": access.roles[tenant.pk],
    })
