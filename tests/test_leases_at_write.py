"""Leases start on the database's clock once the claim holds its locks (issue 32), on every path that claims a step:
the sweep's takeover of an expired claim, a retry that fell due, a step queued after its approval, an operator's
resume (the operator's "send it again"), and an undo (the unwinder's first claim, on the one-call path and on the Python path).

Each test holds, from a second connection, the lock the claim must wait for, for a second longer than the lease it
is about to take. A lease computed before the wait would be recorded already expired (the sweep would take the step
from the worker about to send it); it must still have most of its length once the claim commits.
"""
import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from ledger.models import Action, Run
from ledger.engine import attempts, execution, unwind_plans
from ledger.engine.actions import action_approve, action_claim_due, action_reclaim
from ledger.engine.proposal import action_propose
from ledger.engine.dispatch import new_owner
from ledger.engine.runs import run_resume
from ledger.policy.versions import tool_upsert
from tests.conftest import in_process_policy, needs_postgres
from tests.helpers import act, fault, open_run
from tests.test_g05_crash_safety import wait_for_lease

pytestmark = [needs_postgres, pytest.mark.django_db(transaction=True)]

LEASE = 1.5  # seconds: every lease these claims take (a tool's timeout of 0.5 plus UNWIND_LEASE_SECONDS of 1)
HELD = LEASE + 1.0  # how long the second connection keeps the lock


@pytest.fixture
def short(tools, settings):
    settings.UNWIND_LEASE_SECONDS = 1.0
    settings.UNWIND_FAST_PATH = True
    for name, changes in (("hr.create_user", {"timeout": 0.5}), ("hr.delete_user", {"timeout": LEASE})):
        spec = dict(in_process_policy()["tools"][name], **changes)
        tool_upsert(tenant=tools.acme, name=name, spec=spec, actor="test")
    return tools


@pytest.fixture
def queue_kept(monkeypatch):
    """The tasks a claim queues are kept, not run (a worker would run them later), so the claim is seen as it was
    recorded. (A transactional test runs on-commit work at the commit itself.)"""
    import contextlib

    queued = []
    monkeypatch.setattr("ledger.engine.dispatch.async_task", lambda *args, **kwargs: queued.append(args))

    @contextlib.contextmanager
    def kept():
        yield queued
        assert queued, "the claim queued its step for a worker"

    return kept


def holding(model, pk):
    """Lock the row from a second connection, for HELD seconds from now; returns the thread to join."""
    locked = threading.Event()

    def hold():
        try:
            with transaction.atomic():
                model.objects.select_for_update(no_key=True).get(pk=pk)
                locked.set()
                time.sleep(HELD)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    return holder


def assert_whole_lease(lease, *, waited_from: float, committed: float, length: float = LEASE):
    assert committed - waited_from >= HELD - 0.3, "the claim did not wait for the lock"
    left = lease.timestamp() - committed
    assert left > length - 0.5, f"the lease had {left:.2f} s left when its claim committed (it is {length} s long)"


def claimed_under_lock(model, pk, claim):
    holder = holding(model, pk)
    started = time.time()
    result = claim()
    committed = time.time()
    holder.join()
    return result, started, committed


def test_the_sweeps_takeover_of_an_expired_claim(short):
    run = open_run(short)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "r@x.io", "name": "R"},
                              actor="agent:booker")
    wait_for_lease(proposal.action)
    owner, started, committed = claimed_under_lock(Action, proposal.action.pk, lambda: action_reclaim(proposal.action.pk))
    assert owner
    taken = Action.objects.get(pk=proposal.action.pk)
    assert taken.lease_owner == owner and taken.attempts == 2
    assert_whole_lease(taken.lease_expires_at, waited_from=started, committed=committed)


def test_a_retry_that_fell_due(short):
    fault("hr.create_user", "status", status=503, times=1)
    run = open_run(short)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "d@x.io", "name": "D"},
                              actor="agent:booker", inline=True)
    execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, budget=0)  # no time: scheduled
    waiting = Action.objects.get(pk=proposal.action.pk)
    assert waiting.status == "retry_scheduled"
    time.sleep(max(0.0, waiting.next_attempt_at.timestamp() - time.time()) + 0.05)
    owner, started, committed = claimed_under_lock(Action, waiting.pk, lambda: action_claim_due(waiting.pk))
    assert owner
    assert_whole_lease(Action.objects.get(pk=waiting.pk).lease_expires_at, waited_from=started, committed=committed)


def test_a_step_queued_after_its_approval(short, queue_kept):
    spec = dict(in_process_policy()["tools"]["hr.create_user"], timeout=0.5, approval="manual")
    tool_upsert(tenant=short.acme, name="hr.create_user", spec=spec, actor="test")
    run = open_run(short)
    gated = action_propose(run=run, tool_name="hr.create_user", args={"email": "a@x.io", "name": "A"},
                           actor="agent:booker").action
    assert gated.status == "awaiting_approval"
    with queue_kept():
        _, started, committed = claimed_under_lock(Action, gated.pk, lambda: action_approve(
            action=gated, args_hash=gated.args_hash, actor="user:alice"))
    released = Action.objects.get(pk=gated.pk)
    assert released.status == "running"
    assert_whole_lease(released.lease_expires_at, waited_from=started, committed=committed)


def test_a_step_an_operator_sends_again(short, queue_kept, django_capture_on_commit_callbacks):
    """A sent email whose worker was lost, with nothing to read it back: the operator's "send it again"."""
    from tests.test_g05_crash_safety import sweep_until_settled

    spec = dict(in_process_policy()["tools"]["email.send"], timeout=0.5)
    spec.pop("lookup")
    tool_upsert(tenant=short.acme, name="email.send", spec=spec, actor="test")
    run = open_run(short)
    sent = action_propose(run=run, tool_name="email.send", args={"to": "a@x.io", "subject": "S", "body": "b"},
                          actor="agent:booker")
    assert attempts.mark_sent(sent.action, sent.owner)
    wait_for_lease(sent.action)
    assert sweep_until_settled(sent.action, django_capture_on_commit_callbacks).status == "lost"
    run.refresh_from_db()
    with queue_kept():
        _, started, committed = claimed_under_lock(Action, sent.action.pk, lambda: run_resume(
            run=run, actor="user:oscar", reason="the outbox shows nothing"))
    resumed = Action.objects.get(pk=sent.action.pk)
    assert resumed.status == "running"
    assert_whole_lease(resumed.lease_expires_at, waited_from=started, committed=committed)


@pytest.mark.parametrize("fast", [True, False], ids=["function", "python"])
def test_an_undo_claimed_by_the_unwinder(short, settings, fast):
    """The run's unwind lease and its first undo's claim: in one call on PostgreSQL's one-call path, or on the Python
    path. The second connection holds the run's row, which both lock before they write."""
    settings.UNWIND_FAST_PATH = fast
    run = open_run(short)
    step = act(run, "hr.create_user", {"email": "u@x.io", "name": "U"})
    assert step.status == "succeeded"
    Run.objects.filter(pk=run.pk).update(status="unwinding")
    with CaptureQueriesContext(connection) as queries:
        (claimed, undo), started, committed = claimed_under_lock(Run, run.pk, lambda: unwind_plans.claim_unwind(
            run.pk, tenant_id=run.tenant_id, owner=new_owner(held=True)))
    assert claimed and undo is not None
    called = any("public.unwind_compensated" in q["sql"] for q in queries.captured_queries)
    assert called is fast  # each path is the one it names
    recorded = Action.objects.get(pk=undo.pk)
    assert recorded.status == "running" and recorded.lease_expires_at == undo.lease_expires_at
    assert_whole_lease(recorded.lease_expires_at, waited_from=started, committed=committed)
    run_row = Run.objects.get(pk=run.pk)
    assert_whole_lease(run_row.lease_expires_at, waited_from=started, committed=committed, length=1.0)
