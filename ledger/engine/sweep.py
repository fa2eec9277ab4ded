"""The periodic sweep: crash recovery, due retries, stalled unwinds, idle runs, and other apps' timed work.

Every claim is a conditional update, so any number of sweepers on any number of machines can run at
once; at most one of them wins each piece of work.
"""
from __future__ import annotations

import logging

from django.db import OperationalError
from django.db.models import Min, Q

from ledger import events, tracing
from ledger.db import partitions
from ledger.engine import holds, leases
from ledger.models import Action, ActionStatus as A, Run, RunStatus as R
from ledger.engine.actions import action_claim_due, action_reclaim
from ledger.engine.dispatch import enqueue
from ledger.engine.runs import run_expire_idle

log = logging.getLogger("unwind.sweep")
BATCH = 200


@tracing.task(tracing.SWEEP)
def sweep() -> dict:
    # What is due is judged on the database's clock, which wrote the leases and deadlines and which every machine
    # shares: a sweeper whose own clock runs ahead must not take over a lease that is still running.
    now = leases.db_now()
    counts = {"reclaimed": 0, "retried": 0, "released": 0, "unwinds": 0, "idle": 0}
    expired = Action.objects.filter(status=A.RUNNING, lease_expires_at__lt=now).values_list("pk", flat=True)[:BATCH]
    for action_id in list(expired):
        owner = action_reclaim(action_id)
        if owner:
            counts["reclaimed"] += 1
            enqueue("ledger.tasks.execute_action", action_id, owner)
    due = Action.objects.filter(status=A.RETRY_SCHEDULED, next_attempt_at__lte=now).values_list("pk", flat=True)[:BATCH]
    for action_id in list(due):
        owner = action_claim_due(action_id)
        if owner:
            counts["retried"] += 1
            enqueue("ledger.tasks.execute_action", action_id, owner)
    counts["released"] = holds.release_due(now)
    stalled = Run.objects.filter(status=R.UNWINDING).filter(
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)).values_list("pk", flat=True)[:BATCH]
    waiting = (A.RUNNING, A.RETRY_SCHEDULED, A.AWAITING_APPROVAL, A.APPROVED)
    for run_id in list(stalled):
        # An unwind that waits for a step in flight, a retry or a person is not stalled.
        if not Action.objects.filter(run_id=run_id, status__in=waiting).exists():
            counts["unwinds"] += 1
            enqueue("ledger.tasks.unwind_run", run_id)
    # Runs whose idle deadline passed (one indexed range scan); each is measured again from its last activity.
    idle = Run.objects.filter(status=R.RUNNING, idle_deadline__lt=now).values_list("pk", flat=True)[:BATCH]
    for run_id in list(idle):
        if run_expire_idle(run_id=run_id):
            counts["idle"] += 1
    try:
        # The coming months' partitions (PostgreSQL), checked once an hour: a month without one would land in the
        # DEFAULT partition, which every read scans.
        created = partitions.ensure_now_and_then()
        if created:
            log.info("sweep: created partitions %s", ", ".join(created))
    except OperationalError as exc:  # a lock it waited for too long: the next hour tries again
        log.warning("sweep: partitions not checked this time: %s", exc)
    events.emit("sweep", now=now)
    if any(counts.values()):
        log.info("sweep: %s", counts)
    return counts


def next_due(after):
    """When the sweep next has something to do that a sweep started at `after` could not have seen: the earliest
    lease that runs out, retry that falls due, or hold that ends, later than that (None when there is none). The
    sweep clock wakes then, not a whole interval later, so a lost step is picked up just after its lease ends. (Idle
    deadlines, a minute or more away, are met by the interval.)"""
    lease = Action.objects.filter(status=A.RUNNING, lease_expires_at__gt=after).aggregate(
        at=Min("lease_expires_at"))["at"]
    retry = Action.objects.filter(status=A.RETRY_SCHEDULED, next_attempt_at__gt=after).aggregate(
        at=Min("next_attempt_at"))["at"]
    return min((at for at in (lease, retry, holds.next_release(after)) if at is not None), default=None)
