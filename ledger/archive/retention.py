"""Which runs may leave the hot tables: the one place that decides it (docs/archive.md).

A run is archived when it is settled — its status is final (completed, compensated, closed), none of its steps is
still pending or undoing or may still count toward a tool's limit per agent or per tenant (within the limit's
window; for all time without one), and nothing another app keeps open for it (an open recovery item, a pending approval or
notice, an unanswered customer request: each app says so through `register_keeps_hot`) — when neither it nor its
tenant is under a legal hold, and when it finished longer ago than its retention: its tenant's (`audit.retention`),
or, when one of the tools it called keeps runs longer (a tool's `retention`), the longest of those. A tenant whose
retention is 0 ("forever") archives nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable, Iterable

from django.db import connection
from django.db.models import Max, Min, Q
from django.db.models.expressions import RawSQL

from ledger.models import (
    ACTIVE_ACTION_STATUSES, RUN_FINAL, Action, ActionKind, ActionStatus, AuditEvent, Run, Tenant, Tool,
)

# Steps in these statuses are not done with: their run stays hot whatever its status says.
UNSETTLED_STEPS = (*ACTIVE_ACTION_STATUSES, ActionStatus.COMPENSATING)

_keeps_hot: list[Callable[[list[int]], set[int]]] = []


def register_keeps_hot(check: Callable[[object], set[int]]) -> None:
    """Called at AppConfig.ready() by an app that keeps something open for a run (the ledger imports none of them):
    `check(run_ids)` returns the ids it keeps hot; `run_ids` is the right side of an `__in` (`id_set`)."""
    if check not in _keeps_hot:
        _keeps_hot.append(check)


def id_set(ids: list[int]):
    """The right side of an `__in` on ids: on PostgreSQL one array parameter (thousands of parameters cost more to
    send and parse than the query to run), elsewhere the list."""
    if connection.vendor == "postgresql":
        return RawSQL("SELECT unnest(%s::bigint[])", (id_array(ids),))
    return list(ids)


def id_array(ids) -> str:
    """Ids as one PostgreSQL array literal, '{1,2,3}', for a `%s::bigint[]` parameter: psycopg would dump a list
    element by element (0.4 s of a 9,000-step pass went there)."""
    return "{%s}" % ",".join(map(str, map(int, ids)))


@dataclass(frozen=True)
class Candidate:
    run_id: int
    agent_id: int | None
    finished_at: datetime
    first_seq: int
    last_seq: int


def why_kept(tenant: Tenant) -> str:
    """Why none of the tenant's runs is archived, or "" when some may be."""
    if tenant.legal_hold:
        return "under a legal hold"
    if not tenant.retention_seconds:
        return "its retention is forever (no audit.retention in its policy)"
    return ""


def due_runs(tenant: Tenant, *, now: datetime, limit: int | None = None) -> list[Candidate]:
    """The tenant's runs that may be archived now, ordered by their last audit event (so that segments, each a slice
    of the chain up to its runs' last event, follow each other)."""
    if why_kept(tenant):
        return []
    cutoff = now - timedelta(seconds=tenant.retention_seconds)
    # finished_at >= created_at: the created_at bound lets (tenant, -created_at) serve the scan.
    rows = list(Run.objects.filter(tenant_id=tenant.pk, status__in=list(RUN_FINAL), legal_hold=False,
                                   created_at__lt=cutoff, finished_at__lt=cutoff)
                .order_by("created_at").values_list("pk", "agent_id", "finished_at")[:limit])
    due = settled([pk for pk, _, _ in rows], tenant=tenant, now=now)
    if not due:
        return []
    spans = {run: (first, last) for run, first, last in _event_spans(tenant.pk, due)}
    found = [Candidate(pk, agent, finished, *spans[pk]) for pk, agent, finished in rows if pk in due and pk in spans]
    return sorted(found, key=lambda c: c.last_seq)


def settled(run_ids: Iterable[int], *, tenant: Tenant, now: datetime) -> set[int]:
    """Of these final, unheld runs of the tenant, those with nothing pending and past every tool's retention."""
    ids = list(run_ids)
    if not ids:
        return set()
    some = id_set(ids)
    busy = set(Action.objects.filter(run_id__in=some, status__in=UNSETTLED_STEPS).values_list("run_id", flat=True))
    busy |= _still_counted(some, tenant=tenant, now=now)
    longest = dict(Action.objects.filter(run_id__in=some).values("run_id").annotate(
        keep=Max("tool__retention_seconds")).values_list("run_id", "keep"))
    finished = dict(Run.objects.filter(pk__in=some).values_list("pk", "finished_at"))
    kept = set()
    for check in _keeps_hot:
        kept |= check(some)
    due = set()
    for pk in ids:
        keep = max(tenant.retention_seconds, longest.get(pk) or 0)
        if pk in busy or pk in kept or finished[pk] is None or finished[pk] >= now - timedelta(seconds=keep):
            continue
        due.add(pk)
    return due


def kept_for_limits(limits: list[dict]) -> float | None:
    """How long a step of a tool with these limits still counts toward one that outlives its run (per agent or per
    tenant): the longest window, in seconds; None when one counts for all time. A limit per run ends with its run."""
    windows = [limit.get("window") for limit in limits if limit["per"] != "run"]
    if any(window is None for window in windows):
        return None
    return max(windows, default=0)


def _still_counted(some, *, tenant: Tenant, now: datetime) -> set[int]:
    """The runs with a step that the current limits of its tool (by name, as the limits count) may still count: a
    limit per agent or per tenant for all time keeps such a run hot for good, one with a window until the step is
    older than it. Archived steps give back their share of the running totals (PostgreSQL: migration 0029), which
    then say what the hot steps add up to, as verify_audit checks."""
    kept = {name: kept_for_limits(limits) for name, limits in Tool.objects.filter(
        tenant_id=tenant.pk, is_current=True).values_list("name", "limits") if limits}
    kept = {name: seconds for name, seconds in kept.items() if seconds != 0}
    if not kept:
        return set()
    forever = [name for name, seconds in kept.items() if seconds is None]
    counted = Q(tool__name__in=forever)
    for name, seconds in kept.items():
        if seconds is not None:
            counted |= Q(tool__name=name, created_at__gte=now - timedelta(seconds=seconds))
    return set(Action.objects.filter(counted, run_id__in=some, kind=ActionKind.FORWARD)
               .values_list("run_id", flat=True))


def _event_spans(tenant_id: int, run_ids: set[int]):
    return (AuditEvent.objects.filter(tenant_id=tenant_id, run_ref__in=id_set(list(run_ids))).values("run_ref")
            .annotate(first=Min("seq"), last=Max("seq")).values_list("run_ref", "first", "last"))
