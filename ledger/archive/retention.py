"""Which runs may leave the hot tables: the one place that decides it (docs/archive.md).

A run is archived when it is settled — its status is final (completed, compensated, closed), none of its steps is
still pending or undoing, none counts toward a tool's limits, and nothing another app keeps open for it (an open recovery item, a pending approval or
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
    ACTIVE_ACTION_STATUSES, RUN_FINAL, Action, ActionStatus, AuditEvent, Run, Tenant, Tool,
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
        return RawSQL("SELECT unnest(%s::bigint[])", (list(ids),))
    return list(ids)


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
    # Steps that count toward a tool's limits stay hot: the limits (and their running totals on PostgreSQL, which
    # verify_audit checks against the steps) are read from them.
    limited = [pk for pk, limits in Tool.objects.filter(tenant_id=tenant.pk).values_list("pk", "limits") if limits]
    busy |= set(Action.objects.filter(Q(totalled=True) | Q(tool_id__in=limited), run_id__in=some)
                .values_list("run_id", flat=True))
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


def _event_spans(tenant_id: int, run_ids: set[int]):
    return (AuditEvent.objects.filter(tenant_id=tenant_id, run_ref__in=id_set(list(run_ids))).values("run_ref")
            .annotate(first=Min("seq"), last=Max("seq")).values_list("run_ref", "first", "last"))
