"""Guarantee 4: compensatable steps, then at most one pivot, then retriable steps; forward-only after the pivot."""
import pytest

from ledger.errors import OrderingViolation
from ledger.models import Action
from ledger.engine.runs import run_open
from sandbox.selectors import world_state
from tests.helpers import acme, act, fault, open_run


@pytest.fixture
def no_gate(tools):
    tools.acme.approval_threshold = "critical"
    tools.acme.save()
    return tools


def test_a_compensatable_step_after_the_pivot_is_refused_with_the_rule(no_gate):
    run = open_run(no_gate)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    charge = act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    with pytest.raises(OrderingViolation) as refused:
        act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    assert refused.value.extra["conflicts_with"] == {"seq": charge.seq, "tool": "payments.charge"}
    assert refused.value.extra["rule"] == "compensatable_before_pivot"
    assert "travel.reserve_hotel" in refused.value.detail
    assert not Action.objects.filter(run=run, tool__name="travel.reserve_hotel").exists()
    assert world_state(tenant=acme())["hotels"] == []


def test_a_second_pivot_and_a_pivot_after_retriable_steps_are_refused(no_gate):
    run = open_run(no_gate)
    act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    with pytest.raises(OrderingViolation) as refused:
        act(run, "payments.charge", {"customer": "c", "amount_cents": 200})
    assert refused.value.extra["rule"] == "one_pivot"
    other = open_run(no_gate)
    act(other, "email.send", {"to": "a@x.io", "subject": "s", "body": "b"})
    with pytest.raises(OrderingViolation):
        act(other, "payments.charge", {"customer": "c", "amount_cents": 100})


def test_a_declared_plan_is_checked_before_anything_runs(no_gate):
    with pytest.raises(OrderingViolation):
        run_open(tenant=no_gate.acme, agent=no_gate.agent, actor="agent:booker",
                 plan=["travel.book_flight", "payments.charge", "travel.reserve_hotel", "email.send"])
    run_open(tenant=no_gate.acme, agent=no_gate.agent, actor="agent:booker",
             plan=["travel.book_flight", "travel.reserve_hotel", "payments.charge", "email.send"])


def test_hotel_failure_before_the_pivot_unwinds_the_flight_and_charges_nothing(no_gate):
    run = open_run(no_gate)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    fault("travel.reserve_hotel", "status", status=409)
    act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    run.refresh_from_db()
    assert run.status == "compensated" and not run.pivot_committed
    state = world_state(tenant=acme())
    assert [f["status"] for f in state["flights"]] == ["cancelled"] and state["charges"] == []


def test_a_retriable_step_after_the_pivot_is_retried_forward_never_unwound(no_gate):
    run = open_run(no_gate)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    fault("email.send", "status", status=503, times=2)
    mail = act(run, "email.send", {"to": "p@x.io", "subject": "Confirmed", "body": "ok"})
    run.refresh_from_db()
    assert mail.status == "succeeded" and mail.attempts == 3
    assert run.status == "running" and run.pivot_committed
    assert not Action.objects.filter(run=run, kind="compensation").exists()
    assert len(world_state(tenant=acme())["messages"]) == 1
