"""Deadlines are judged on the clock that wrote them (issue 32's follow-up).

On PostgreSQL every lease, retry deadline and sent mark is written on the database's clock, which every machine
shares. A machine whose own clock runs ahead or late must still see them as they are: a sweeper an hour ahead must
not take over a lease still running (the step would be sent twice), a worker an hour late must not find a lease it
lost still its own (it would send after the takeover), and a retry scheduled by a late worker must fall due when
the database's clock says, not an hour early. Each process clock is moved here by patching `timezone.now`.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from ledger.engine import attempts, execution, leases
from ledger.engine.proposal import action_propose
from ledger.engine.sweep import sweep
from ledger.models import Action, Attempt
from tests.conftest import needs_postgres
from tests.helpers import fault, open_run

pytestmark = needs_postgres

HOUR = timedelta(hours=1)


@pytest.fixture
def clock(monkeypatch):
    """Move this process's clock by a timedelta; the database's stays where it is."""
    real = timezone.now

    def move(by: timedelta) -> None:
        monkeypatch.setattr(timezone, "now", lambda: real() + by)

    return move


def _claimed(world):
    """A step claimed for a worker (queued): running, its lease on the database's clock, nothing sent yet."""
    run = open_run(world)
    return action_propose(run=run, tool_name="hr.create_user", args={"email": "s@x.io", "name": "S"},
                          actor="agent:booker", queued=True)


def test_a_sweeper_whose_clock_runs_ahead_takes_over_no_running_lease(tools, clock):
    proposal = _claimed(tools)
    before = Action.objects.get(pk=proposal.action.pk)
    assert before.status == "running" and before.lease_expires_at > leases.db_now()
    clock(HOUR)  # this machine thinks the lease ran out long ago
    counts = sweep()
    after = Action.objects.get(pk=proposal.action.pk)
    assert counts["reclaimed"] == 0
    assert (after.status, after.lease_owner, after.lease_expires_at, after.attempts) == (
        before.status, before.lease_owner, before.lease_expires_at, before.attempts)
    assert not Attempt.objects.filter(action=after, outcome="lost").exists()


def test_a_worker_whose_clock_runs_late_cannot_mark_a_lost_lease_sent(tools, clock):
    proposal = _claimed(tools)
    from django.db import connection

    with connection.cursor() as cursor:  # the lease ran out, by the database's clock
        cursor.execute("UPDATE ledger_action SET lease_expires_at = clock_timestamp() - interval '1 second'"
                       " WHERE id = %s", [proposal.action.pk])
    clock(-HOUR)  # this machine thinks it still has an hour of it
    assert attempts.mark_sent(proposal.action, proposal.owner) is False
    assert Attempt.objects.get(action_id=proposal.action.pk).sent_at is None


def test_a_sent_mark_is_the_databases_time(tools, clock):
    proposal = _claimed(tools)
    clock(-HOUR)
    assert attempts.mark_sent(proposal.action, proposal.owner) is True
    sent = Attempt.objects.get(action_id=proposal.action.pk).sent_at
    assert abs((sent - leases.db_now()).total_seconds()) < 5


def test_a_retry_scheduled_by_a_late_worker_falls_due_by_the_databases_clock(tools, clock):
    fault("hr.create_user", "status", status=503, times=1)
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "r@x.io", "name": "R"},
                              actor="agent:booker", inline=True)
    clock(-HOUR)
    execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, budget=0)  # no time: scheduled
    waiting = Action.objects.get(pk=proposal.action.pk)
    assert waiting.status == "retry_scheduled"
    ahead = (waiting.next_attempt_at - leases.db_now()).total_seconds()
    assert 0 < ahead < 5, ahead  # the backoff from the database's now, not from an hour before it
