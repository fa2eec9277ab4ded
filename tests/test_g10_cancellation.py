"""Guarantee 10: a cancelled run starts nothing new; what finishes after the cancel is compensated."""
import pytest

from ledger.errors import RunCancelled
from ledger.models import Action
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_cancel
from recovery.models import RecoveryItem
from sandbox.selectors import world_state
from tests.helpers import acme, act, fault, open_run


def test_a_cancelled_run_starts_no_new_action(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    run_cancel(run=run, actor="agent:booker", reason="user changed their mind")
    run.refresh_from_db()
    assert run.status == "compensated" and world_state(tenant=acme())["users"] == []
    with pytest.raises(RunCancelled):
        act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    assert world_state(tenant=acme())["hotels"] == []


def test_an_action_that_finishes_after_the_cancel_is_compensated(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    in_flight = action_propose(run=run, tool_name="travel.book_flight", actor="agent:booker",
                               args={"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "unwinding"  # it waits for the step in flight
    execution.execute(in_flight.action.pk, owner=in_flight.owner)
    execution.unwind(run.pk)
    run.refresh_from_db()
    assert run.status == "compensated"
    assert Action.objects.get(pk=in_flight.action.pk).status == "compensated"
    state = world_state(tenant=acme())
    assert [f["status"] for f in state["flights"]] == ["cancelled"] and state["users"] == []


def test_a_scheduled_retry_is_skipped_by_the_cancel(tools, settings):
    settings.UNWIND_MAX_BACKOFF = 60
    run = open_run(tools)
    fault("travel.book_flight", "status", status=503, times=0)
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    tool_upsert(tenant=tools.acme, name="travel.book_flight", actor="test",
                spec=dict(in_process_policy()["tools"]["travel.book_flight"], retry={"max_attempts": 5, "backoff": 30}))
    flight = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    assert flight.status == "retry_scheduled"
    run_cancel(run=run, actor="agent:booker")
    flight.refresh_from_db()
    run.refresh_from_db()
    assert flight.status == "skipped" and run.status == "compensated"


def test_a_cancel_after_the_pivot_asks_a_person(tools):
    tools.acme.approval_threshold = "critical"
    tools.acme.save()
    run = open_run(tools)
    act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "needs_attention"
    assert RecoveryItem.objects.get(run=run).reason == "cancelled_after_pivot"


def test_a_step_that_may_have_acted_is_read_back_not_skipped_by_a_cancel(tools, django_capture_on_commit_callbacks):
    """A worker was lost after the email went out; while its read-back waits, the run is cancelled. The step is
    not skipped as if nothing happened: it is read back (never sent again), found, and corrected."""
    import time

    from ledger.engine.attempts import mark_sent
    from ledger.engine.sweep import sweep
    from sandbox import callables
    from tests.test_g05_crash_safety import short_lease, sweep_until_settled, wait_for_lease

    # The lease runs out at its timeout + UNWIND_LEASE_SECONDS after the send; the lost call is surely over at twice
    # the timeout + 1 s: the sweep must take the step over between the two. A first sweep in a process imports what
    # it sweeps (the MCP SDK's models, over a second on a loaded machine), which once ate that margin: it is done
    # here first, and the margin is 4 s.
    sweep()
    short_lease(tools, "email.send", timeout=4)
    run = open_run(tools)
    args = {"to": "a@x.io", "subject": "Offer", "body": "b"}
    sent = action_propose(run=run, tool_name="email.send", args=args, actor="agent:booker")
    assert mark_sent(sent.action, sent.owner)  # the lost worker's call did go out
    callables.email_send(args, idempotency_key=sent.action.tool_key, tenant="acme")
    wait_for_lease(sent.action)
    with django_capture_on_commit_callbacks(execute=True):
        sweep()
    sent.action.refresh_from_db()
    assert sent.action.status == "retry_scheduled"  # waiting until the lost call must be over
    run_cancel(run=run, actor="agent:booker")
    sent.action.refresh_from_db()
    assert sent.action.status == "retry_scheduled"  # not skipped: it may have acted
    time.sleep(0.2)
    sweep_until_settled(sent.action, django_capture_on_commit_callbacks)
    for _ in range(50):
        run.refresh_from_db()
        if run.status != "unwinding":
            break
        with django_capture_on_commit_callbacks(execute=True):
            sweep()
        time.sleep(0.1)
    assert run.status == "compensated"
    assert Action.objects.get(pk=sent.action.pk).status == "compensated"
    assert sorted(m["subject"] for m in world_state(tenant=acme())["messages"]) == ["Correction: Offer", "Offer"]
