"""Holds (issue 29): a held step waits out its window, runs once when it ends, or is stopped before and never runs.

Built through the real services on the sandbox tools (in process); the sandbox records every call it gets, so
"never executed" is read from the tool's own record. Windows are 1-2 seconds.
"""
import random
import threading
import time
from datetime import datetime

import pytest
from django.db import close_old_connections, connection
from django.utils import timezone

from ledger.engine import holds
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import Action, AuditEvent, Run
from ledger.policy.tool_entry import parse_tool
from ledger.engine.runs import run_cancel, run_complete
from ledger.engine.sweep import next_due, sweep
from ledger.policy.versions import tool_upsert
from sandbox.selectors import call_list
from tests.conftest import in_process_policy, needs_postgres
from tests.helpers import acme, act, open_run


def hold(world, name, value, **overrides):
    spec = dict(in_process_policy()["tools"][name], hold=value, **overrides)
    tool_upsert(tenant=world.acme, name=name, spec=spec, actor="test")


def calls(tool):
    return call_list(tenant=acme(), tool=tool)["count"]


def sweep_after(action, capture, *, extra=0.1):
    """Sleep past the action's window (as it was held), then sweep as the worker's clock would (its queued work run
    at commit)."""
    until = AuditEvent.objects.get(action_ref=action.pk, kind="forward.held").data["executes_at"]
    time.sleep(max(0.0, (datetime.fromisoformat(until) - timezone.now()).total_seconds()) + extra)
    with capture(execute=True):
        return sweep()


def trip(world, *, hold_on="payments.charge", **hold_value):
    """Flight and hotel (compensatable), then a card charge (the pivot), one of them held for a second."""
    hold(world, "payments.charge", None, approval="auto")
    hold(world, hold_on, hold_value or "1s", **({"approval": "auto"} if hold_on == "payments.charge" else {}))
    run = open_run(world, goal="Trip to Lisbon")
    flight = act(run, "travel.book_flight", {"passenger": "Carol", "flight": "TP101", "date": "2026-12-01"})
    hotel = act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Lisboa Plaza", "nights": 2})
    return run, flight, hotel


# --- policy ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, stored", [
    (None, {}), ("30s", {"seconds": 30.0, "customer_can_stop": False}),
    (5, {"seconds": 5.0, "customer_can_stop": False}),
    ({"for": "2m", "customer_can_stop": True}, {"seconds": 120.0, "customer_can_stop": True}),
    ("1h", {"seconds": 3600.0, "customer_can_stop": False}),
])
def test_a_hold_is_parsed_into_seconds(value, stored):
    spec = {"executor": "client", **({} if value is None else {"hold": value})}
    assert parse_tool("x.y", spec, where="tools.x.y")["hold"] == stored


@pytest.mark.parametrize("value, field", [
    ("2h", "tools.x.y.hold"), ("0s", "tools.x.y.hold"), ("soon", "tools.x.y.hold"), (True, "tools.x.y.hold"),
    ({"customer_can_stop": True}, "tools.x.y.hold.for"), ({"for": "10s", "who": "me"}, "tools.x.y.hold.who"),
    ({"for": "10s", "customer_can_stop": "yes"}, "tools.x.y.hold.customer_can_stop"),
])
def test_a_hold_out_of_bounds_is_refused_at_load(value, field):
    with pytest.raises(ValidationFailed) as refused:
        parse_tool("x.y", {"executor": "client", "hold": value}, where="tools.x.y")
    assert refused.value.extra["field"] == field


# --- held, then run -------------------------------------------------------------------------------------------

def test_a_held_step_runs_once_when_its_window_ends(tools, django_capture_on_commit_callbacks):
    run, flight, hotel = trip(tools)
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    assert charge.status == "held" and charge.attempts == 0 and calls("payments.charge") == 0
    window = (charge.next_attempt_at - charge.created_at).total_seconds()
    assert 0.9 < window < 1.5
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["released"] == 0  # not yet
    assert calls("payments.charge") == 0
    assert next_due(timezone.now()) == charge.next_attempt_at  # the worker's clock wakes for it
    assert sweep_after(charge, django_capture_on_commit_callbacks)["released"] == 1
    charge.refresh_from_db()
    assert charge.status == "succeeded" and calls("payments.charge") == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["released"] == 0
    assert calls("payments.charge") == 1
    run.refresh_from_db()
    assert run.pivot_committed and run_complete(run=run, actor="agent:booker").status == "completed"
    kinds = list(AuditEvent.objects.filter(action_ref=charge.pk).values_list("kind", "actor"))
    assert ("forward.held", "agent:booker") in kinds and ("forward.running", "system:hold") in kinds


def test_a_run_cannot_complete_while_a_step_is_held(tools):
    run, *_ = trip(tools)
    act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    with pytest.raises(StateConflict, match="held"):
        run_complete(run=run, actor="agent:booker")


def test_the_same_call_again_while_held_is_in_flight_not_a_second_step(tools):
    run, *_ = trip(tools)
    first = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    from ledger.errors import StillInFlight
    with pytest.raises(StillInFlight, match="held"):
        act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    assert Action.objects.filter(run=run, tool__name="payments.charge").count() == 1 and first.status == "held"


def test_a_held_step_holds_its_share_of_a_limit_and_gives_it_back_when_stopped(tools):
    """A held step will act when its window ends: a limit counts it (issue 28), or an agent could queue past it."""
    from ledger.engine.decision import PolicyDenied

    hold(tools, "travel.reserve_hotel", "30s", limits=[{"per": "agent", "count": 1}])
    first = act(open_run(tools, goal="one"), "travel.reserve_hotel", {"guest": "Carol", "hotel": "A", "nights": 1})
    assert first.status == "held"
    second_run = open_run(tools, goal="two")
    with pytest.raises(PolicyDenied, match="at most 1 call of travel.reserve_hotel per agent, and 1 already"):
        act(second_run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "B", "nights": 1})
    holds.action_stop(action_id=first.pk, actor="agent:booker", by="agent")
    assert act(second_run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "C", "nights": 1}).status == "held"


# --- stopped before the window ends ----------------------------------------------------------------------------

def test_an_operator_stops_a_held_pivot_and_earlier_steps_are_undone_newest_first(tools,
                                                                                 django_capture_on_commit_callbacks):
    run, flight, hotel = trip(tools)
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    with django_capture_on_commit_callbacks(execute=True):
        stopped = holds.action_stop(action_id=charge.pk, actor="user:oscar", by="operator", reason="wrong card")
    assert stopped.status == "skipped" and stopped.stopped_by == "operator"
    assert "stopped by user:oscar" in stopped.decision_reason
    run.refresh_from_db()
    assert run.status == "compensated"
    undo = list(Action.objects.filter(run=run, kind="compensation").order_by("seq")
                .values_list("compensates_id", "status"))
    assert undo == [(hotel.pk, "succeeded"), (flight.pk, "succeeded")]  # newest first
    # The window passes: nothing is released, the card is never charged.
    assert sweep_after(charge, django_capture_on_commit_callbacks)["released"] == 0
    assert calls("payments.charge") == 0
    event = AuditEvent.objects.get(action_ref=charge.pk, kind="forward.skipped")
    assert event.actor == "user:oscar" and event.data["stopped_by"] == "operator"
    assert event.data["reason"] == "wrong card"
    with pytest.raises(StateConflict, match="not held"):
        holds.action_stop(action_id=charge.pk, actor="user:oscar", by="operator")


def test_a_held_step_after_the_pivot_stopped_ends_the_run_without_it(tools, django_capture_on_commit_callbacks):
    hold(tools, "payments.charge", None, approval="auto")
    hold(tools, "email.send", {"for": "1s", "customer_can_stop": True})
    run = open_run(tools, goal="Buy and confirm")
    act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    email = act(run, "email.send", {"to": "carol@example.com", "subject": "Your trip", "body": "Booked."})
    assert email.status == "held"
    stopped = holds.action_stop(action_id=email.pk, actor="customer:carol@example.com", by="customer")
    run.refresh_from_db()
    assert stopped.status == "skipped" and run.status == "completed"
    assert sweep_after(email, django_capture_on_commit_callbacks)["released"] == 0
    assert calls("email.send") == 0 and calls("payments.charge") == 1
    assert not Action.objects.filter(run=run, kind="compensation").exists()  # after the pivot nothing is undone
    from recovery.trail import correction_trail
    trail = correction_trail(run)
    assert trail["headline"].startswith("The task ended without the steps that were stopped")
    assert any(s["text"].startswith("You stopped this step while it was waiting") for s in trail["statements"])


def test_the_agent_cancelling_its_run_stops_a_held_step(tools, django_capture_on_commit_callbacks):
    run, flight, hotel = trip(tools)
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    with django_capture_on_commit_callbacks(execute=True):
        run_cancel(run=run, actor="agent:booker", reason="the customer changed their mind")
    charge.refresh_from_db()
    run.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "agent" and run.status == "compensated"
    assert sweep_after(charge, django_capture_on_commit_callbacks)["released"] == 0
    assert calls("payments.charge") == 0


def test_a_held_step_in_a_run_that_stopped_otherwise_is_skipped_not_run(tools, django_capture_on_commit_callbacks):
    """A run put before a person while a step is held: the window's end skips it rather than run it unwatched."""
    run, *_ = trip(tools)
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    Run.objects.filter(pk=run.pk).update(status="needs_attention")
    sweep_after(charge, django_capture_on_commit_callbacks)
    charge.refresh_from_db()
    assert charge.status == "skipped" and calls("payments.charge") == 0


# --- racing ------------------------------------------------------------------------------------------------------

@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_a_stop_and_the_release_racing_have_exactly_one_winner(django_db_setup, settings):
    """Many rounds: the release (window just ended) and a stop start together in two threads; exactly one wins,
    and the step then ran once (released) or never (stopped)."""
    from tests.conftest import World, seed_sandboxes
    from ledger.policy.versions import tools_load

    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    hold(world, "crm.update_ticket", "1s")
    outcomes = {"released": 0, "stopped": 0}
    steps = [act(open_run(world, goal=f"round {round_}"), "crm.update_ticket",
                 {"ticket_id": "T-1", "priority": "high", "note": f"round {round_}"}) for round_ in range(25)]
    # Every window has ended (its time is the one its hold recorded: a time edited in the row is refused at release).
    time.sleep(max(0.0, (steps[-1].next_attempt_at - timezone.now()).total_seconds()) + 0.05)
    for step in steps:
        barrier = threading.Barrier(2)
        results = {}

        def releaser():
            barrier.wait()
            time.sleep(random.uniform(0, 0.004))  # each of the two orders, and the overlaps between
            try:
                results["release"] = holds.release(step.pk)
            finally:
                close_old_connections()

        def stopper():
            barrier.wait()
            time.sleep(random.uniform(0, 0.004))
            try:
                results["stop"] = holds.action_stop(action_id=step.pk, actor="user:oscar", by="operator").status
            except StateConflict:
                results["stop"] = None
            finally:
                close_old_connections()

        threads = [threading.Thread(target=releaser), threading.Thread(target=stopper)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        step.refresh_from_db()
        released, stopped = bool(results["release"]), results["stop"] == "skipped"
        assert released != stopped, results
        assert step.status == ("running" if released else "skipped")
        outcomes["released" if released else "stopped"] += 1
    assert sum(outcomes.values()) == 25


# --- a worker killed during the window ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(connection.vendor == "sqlite" and ":memory:" in str(connection.settings_dict.get("NAME")),
                    reason="worker processes need a database file or server")
def test_a_worker_killed_during_the_window_runs_the_step_once_after_restart(http_tools):
    """A real `manage.py worker` (cluster and sweep clock) is SIGKILLed while a step is held; the next worker, started
    after the window ended, finds it overdue and runs it, once."""
    import signal
    import subprocess
    import sys

    from tests.conftest import POLICY
    from tests.test_g05_crash_safety import ROOT, process_env, wait_until

    tool_upsert(tenant=http_tools.acme, name="email.send", spec=dict(POLICY["tools"]["email.send"], hold="2s"),
                actor="test")
    run = open_run(http_tools)
    email = act(run, "email.send", {"to": "carol@example.com", "subject": "Your trip", "body": "Booked."})
    assert email.status == "held"

    def start():
        return subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=ROOT,
                                env=process_env(http_tools.live_server), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)

    first = start()
    time.sleep(0.8)  # the worker is up, sweeping, and the step still held
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    time.sleep(2.0)  # the window ends with no worker running
    email.refresh_from_db()
    assert email.status == "held" and calls("email.send") == 0
    second = start()
    try:
        ran = wait_until(lambda: Action.objects.get(pk=email.pk).status == "succeeded", timeout=60)
    finally:
        second.send_signal(signal.SIGTERM)
        _, stderr = second.communicate(timeout=60)
    assert ran, stderr.decode()[-2000:]
    assert len([c for c in call_list(tenant=acme(), tool="email.send")["results"] if c["effect_applied"]]) == 1
    assert list(Action.objects.get(pk=email.pk).attempt_set.values_list("outcome", flat=True)) == ["succeeded"]


def test_metrics_count_holds_and_stops_by_whom(tools, django_capture_on_commit_callbacks):
    from recovery.metrics import console_metrics, metrics_charts

    run, *_ = trip(tools)
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    with django_capture_on_commit_callbacks(execute=True):
        holds.action_stop(action_id=charge.pk, actor="user:oscar", by="operator")
    data = console_metrics(tenant_ids=[tools.acme.pk])
    assert data["holds"] == {"held": 1, "stopped": {"agent": 0, "operator": 1, "approver": 0, "customer": 0},
                             "customer_requests": 0}
    chart = next(c for c in metrics_charts(data) if c["title"].startswith("Held steps"))
    assert [bar["value"] for bar in chart["bars"]] == ["1", "0", "1", "0", "0", "0"]
