"""Console metrics over a time window, and the geometry of the server-rendered SVG bar charts that show them."""
from __future__ import annotations

import math
from datetime import timedelta

from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus
from ledger.engine.holds import STOPPERS
from ledger.models import Action, ActionKind, ActionStatus as A, AuditEvent, Checkpoint, Run, RunStatus
from recovery.models import CustomerRequest, ItemStatus, RecoveryItem
from recovery.selectors import AGE_BUCKETS

WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}
DEFAULT_WINDOW = "24h"
UNWIND_START = {"unwind_started", "operator_compensate"}
UNWIND_END = "compensated"
UNWIND_STUCK_PREFIX = "needs_attention"
LATENCY_SAMPLE_LIMIT = 50_000

OUTCOME_CLASSES = {
    A.SUCCEEDED: "ok", A.COMPENSATED: "undone", A.FAILED: "bad", A.COMPENSATION_FAILED: "bad", A.LOST: "bad",
    A.REJECTED: "warn", A.EXPIRED: "warn", A.SKIPPED: "muted", A.COMPENSATING: "busy", A.RUNNING: "busy",
    A.RETRY_SCHEDULED: "busy", A.AWAITING_APPROVAL: "warn", A.APPROVED: "busy", A.PLANNED: "muted", A.HELD: "warn",
}
RUN_CLASSES = {
    RunStatus.COMPLETED: "ok", RunStatus.COMPENSATED: "undone", RunStatus.NEEDS_ATTENTION: "bad",
    RunStatus.CLOSED: "muted", RunStatus.RUNNING: "busy", RunStatus.AWAITING_APPROVAL: "warn", RunStatus.UNWINDING: "busy",
}


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def unwind_latencies(*, tenant_ids: list[int], since) -> tuple[list[float], int]:
    """Seconds from each unwind's start checkpoint to the run's compensated or needs-attention checkpoint.

    Returns the latencies of finished unwinds and how many of them ended needing a person.
    """
    rows = (Checkpoint.objects.filter(tenant_id__in=tenant_ids, created_at__gte=since)
            .filter(Q(label__in=[*UNWIND_START, UNWIND_END]) | Q(label__startswith=UNWIND_STUCK_PREFIX))
            .order_by("run_id", "id").values_list("run_id", "label", "created_at")[:LATENCY_SAMPLE_LIMIT])
    latencies, stuck = [], 0
    started: dict[int, object] = {}
    for run_id, label, at in rows:
        if label in UNWIND_START:
            started[run_id] = at
        elif run_id in started:
            latencies.append((at - started.pop(run_id)).total_seconds())
            stuck += label.startswith(UNWIND_STUCK_PREFIX)
    return latencies, stuck


def approval_latencies(*, tenant_ids: list[int], since) -> list[float]:
    rows = (ApprovalRequest.objects.filter(tenant_id__in=tenant_ids, decided_at__gte=since,
                                           status__in=[ApprovalStatus.APPROVED, ApprovalStatus.REJECTED])
            .values_list("created_at", "decided_at")[:LATENCY_SAMPLE_LIMIT])
    return [(decided - created).total_seconds() for created, decided in rows]


def console_metrics(*, tenant_ids: list[int], window: str = DEFAULT_WINDOW, now=None) -> dict:
    now = now or timezone.now()
    window = window if window in WINDOWS else DEFAULT_WINDOW
    since = now - WINDOWS[window]

    runs = Run.objects.filter(tenant_id__in=tenant_ids, created_at__gte=since)
    compensated_any = Exists(Action.objects.filter(run=OuterRef("pk"), kind=ActionKind.COMPENSATION))
    total_runs = runs.count()
    unwound_runs = runs.filter(compensated_any).count()
    runs_by_status = dict(runs.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n"))

    compensations = dict(
        Action.objects.filter(tenant_id__in=tenant_ids, kind=ActionKind.COMPENSATION, created_at__gte=since)
        .order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    comp_ok = compensations.get(A.SUCCEEDED, 0)
    comp_failed = sum(compensations.get(s, 0) for s in (A.FAILED, A.REJECTED, A.EXPIRED))
    comp_pending = sum(compensations.values()) - comp_ok - comp_failed

    unwinds, stuck = unwind_latencies(tenant_ids=tenant_ids, since=since)
    approvals = approval_latencies(tenant_ids=tenant_ids, since=since)

    age = RecoveryItem.objects.filter(tenant_id__in=tenant_ids, status=ItemStatus.OPEN).aggregate(**{
        key: Count("id", filter=_age_q(now, younger, older)) for key, (_, younger, older) in AGE_BUCKETS.items()})

    per_tool: dict[str, dict[str, int]] = {}
    for name, status, n in (Action.objects.filter(tenant_id__in=tenant_ids, created_at__gte=since)
                            .order_by().values_list("tool__name", "status").annotate(n=Count("id"))
                            .values_list("tool__name", "status", "n")):
        per_tool.setdefault(name, {})[status] = n

    return {
        "window": window,
        "since": since,
        "holds": hold_counts(tenant_ids=tenant_ids, since=since),
        "runs": total_runs,
        "unwound_runs": unwound_runs,
        "compensation_frequency": unwound_runs / total_runs if total_runs else None,
        "compensations": {"succeeded": comp_ok, "failed": comp_failed, "pending": comp_pending},
        "compensation_success_rate": comp_ok / (comp_ok + comp_failed) if comp_ok + comp_failed else None,
        "unwind_latency": _latency_summary(unwinds) | {"stuck": stuck},
        "approval_latency": _latency_summary(approvals),
        "open_items_by_age": [{"bucket": key, "label": AGE_BUCKETS[key][0], "n": age[key]} for key in AGE_BUCKETS],
        "runs_by_status": runs_by_status,
        "actions_per_tool": per_tool,
    }


def hold_counts(*, tenant_ids: list[int], since) -> dict:
    """Steps held in the window (ledger/engine/holds.py), those stopped before they ran by who stopped them, and the
    corrections customers asked for from their trails (recovery/requests.py)."""
    held = AuditEvent.objects.filter(tenant_id__in=tenant_ids, kind="forward.held", created_at__gte=since).count()
    stopped = dict(Action.objects.filter(tenant_id__in=tenant_ids, created_at__gte=since).exclude(stopped_by="")
                   .order_by().values_list("stopped_by").annotate(n=Count("id")).values_list("stopped_by", "n"))
    return {"held": held, "stopped": {by: stopped.get(by, 0) for by in STOPPERS},
            "customer_requests": CustomerRequest.objects.filter(tenant_id__in=tenant_ids,
                                                                created_at__gte=since).count()}


def _age_q(now, younger, older) -> Q:
    q = Q()
    if younger is not None:
        q &= Q(created_at__lte=now - younger)
    if older is not None:
        q &= Q(created_at__gt=now - older)
    return q


def _latency_summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "max": max(values) if values else None}


# --- charts -----------------------------------------------------------------------------------------

CHART_WIDTH = 640
LABEL_WIDTH = 170
VALUE_WIDTH = 70
BAR_HEIGHT = 18
BAR_GAP = 8
TOP = 6


def bar_chart(title: str, rows: list[tuple[str, list[tuple[str, float, str]]]], *, unit: str = "",
              fmt=None) -> dict:
    """Horizontal (stacked) bars: rows of (label, [(segment name, value, css class), ...]).

    Returns the geometry a template draws as inline SVG; no JavaScript and no chart library.
    """
    fmt = fmt or _plain_number
    totals = [sum(v for _, v, _ in segments) for _, segments in rows]
    top = max(totals, default=0) or 1
    span = CHART_WIDTH - LABEL_WIDTH - VALUE_WIDTH
    bars = []
    legend: dict[str, str] = {}
    for index, ((label, segments), total) in enumerate(zip(rows, totals)):
        y = TOP + index * (BAR_HEIGHT + BAR_GAP)
        x = LABEL_WIDTH
        pieces = []
        for name, value, css in segments:
            width = span * value / top
            if value > 0:
                pieces.append({"x": round(x, 2), "width": round(max(width, 1), 2), "css": css,
                               "title": f"{label}: {name} {fmt(value)}{unit}"})
                legend.setdefault(name, css)
            x += width
        bars.append({"label": label, "y": y, "text_y": y + BAR_HEIGHT - 4, "segments": pieces,
                     "value": f"{fmt(total)}{unit}", "value_x": round(x + 6, 2)})
    height = TOP * 2 + max(len(rows), 1) * (BAR_HEIGHT + BAR_GAP)
    stacked = any(len(segments) > 1 for _, segments in rows)
    return {"title": title, "width": CHART_WIDTH, "height": height, "bars": bars, "bar_height": BAR_HEIGHT,
            "label_x": LABEL_WIDTH - 8, "legend": [{"name": n, "css": c} for n, c in legend.items()] if stacked else [],
            "empty": not rows or not any(totals)}


def _plain_number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def metrics_charts(data: dict) -> list[dict]:
    unwind, approval = data["unwind_latency"], data["approval_latency"]
    runs = [(status.replace("_", " "), [(status.replace("_", " "), n, RUN_CLASSES.get(status, "muted"))])
            for status, n in sorted(data["runs_by_status"].items(), key=lambda kv: -kv[1])]
    comp = data["compensations"]
    tools = []
    for name, outcomes in sorted(data["actions_per_tool"].items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        segments = [(status.replace("_", " "), n, OUTCOME_CLASSES.get(status, "muted"))
                    for status, n in sorted(outcomes.items(), key=lambda kv: -kv[1])]
        tools.append((name, segments))
    return [
        bar_chart("Runs by outcome", runs),
        bar_chart("Compensations", [("succeeded", [("succeeded", comp["succeeded"], "ok")]),
                                    ("failed / refused", [("failed", comp["failed"], "bad")]),
                                    ("still pending", [("pending", comp["pending"], "busy")])]),
        bar_chart("Unwind latency", _latency_rows(unwind), fmt=seconds),
        bar_chart("Approval latency", _latency_rows(approval), fmt=seconds),
        bar_chart("Open recovery items by age", [
            (b["label"], [(b["label"], b["n"], "bad" if b["bucket"] == "older" else "warn")])
            for b in data["open_items_by_age"]]),
        bar_chart("Actions per tool and outcome", tools),
        bar_chart("Held steps, who stopped them, customer requests",
                  [("held", [("held", data["holds"]["held"], "warn")])] + [
                      (f"stopped by {by}", [(f"stopped by {by}", n, "muted")])
                      for by, n in data["holds"]["stopped"].items()]
                  + [("customer requests", [("customer requests", data["holds"]["customer_requests"], "bad")])]),
    ]


def _latency_rows(summary: dict) -> list:
    return [(name, [(name, summary[name] or 0, css)]) for name, css in (("p50", "ok"), ("p95", "warn"), ("max", "bad"))]
