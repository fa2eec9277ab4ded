"""Scenario builders for the console tests: runs and recovery items made through the real services.

No tests here; the console, trail and browser test modules import these.
"""
from django.contrib.auth import get_user_model

from ledger.models import Run
from ledger.engine.runs import run_cancel
from ledger.policy.versions import tool_upsert
from recovery.models import ItemStatus, RecoveryItem
from sandbox import services as world_services
from sandbox.faults import faults_clear
from tests.conftest import in_process_policy
from tests.helpers import acme, act, fault, open_run

_tickets = iter(range(5000, 100000))


def new_ticket() -> str:
    """A fresh CRM ticket in the sandbox world (its seed has only three)."""
    ticket_id = f"T-{next(_tickets)}"
    world_services.crm_create_ticket(tenant=acme(), ticket_id=ticket_id, subject="Seeded for a console test",
                                     priority="normal",
                                     updated_by="seed")
    return ticket_id


def open_item(run: Run) -> RecoveryItem:
    return RecoveryItem.objects.get(run=run, status=ItemStatus.OPEN)


def onboarding_compensated(world) -> Run:
    """Create a user, provision a license, then the welcome email fails for good: both are undone."""
    run = open_run(world, goal="Onboard Ashu")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=504, times=0)
    act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    faults_clear(tenant=acme())
    run.refresh_from_db()
    assert run.status == "compensated", run.attention_detail
    return run


def drift_run(world, ticket: str | None = None) -> Run:
    """The agent raises a ticket's priority, a person changes it again, the run is cancelled: drift."""
    ticket = ticket or new_ticket()
    run = open_run(world, goal=f"Escalate {ticket}")
    act(run, "crm.update_ticket", {"ticket_id": ticket, "priority": "high"})
    world_services.crm_update_ticket(tenant=acme(), ticket_id=ticket, priority="urgent", status=None, note=None,
                                     updated_by="dana")
    run = run_cancel(run=run, actor="agent:booker", reason="wrong ticket")
    assert run.status == "needs_attention" and run.attention_reason == "drift", run.attention_detail
    return run


def compensation_failed_run(world) -> Run:
    """A user is created, the run is cancelled, and deleting the user is refused once: compensation failed."""
    run = open_run(world, goal="Onboard someone")
    act(run, "hr.create_user", {"email": "temp@company.com", "name": "Temp Worker"})
    fault("hr.delete_user", "status", status=400, times=1)
    run = run_cancel(run=run, actor="agent:booker", reason="not needed")
    assert run.status == "needs_attention" and run.attention_reason == "compensation_failed", run.attention_detail
    return run


def email_correction_run(world) -> Run:
    """An email goes out, the next email is refused: the first one cannot be unsent, a correction is sent."""
    run = open_run(world, goal="Tell the customer about the refund")
    act(run, "email.send", {"to": "customer@example.com", "subject": "Your refund", "body": "It is on its way."})
    fault("email.send", "status", status=400, times=1)
    act(run, "email.send", {"to": "finance@example.com", "subject": "Refund issued", "body": "Please book it."})
    run.refresh_from_db()
    assert run.status == "compensated", run.attention_detail
    return run


def auto_approve_charges(world) -> None:
    """Let charges run without an approver, so a run can pass its pivot inside a test."""
    spec = dict(in_process_policy()["tools"]["payments.charge"], approval="auto")
    tool_upsert(tenant=world.acme, name="payments.charge", spec=spec, actor="test")


def step_failed_run(world) -> Run:
    """The charge (the pivot) commits, then the receipt email is refused: the run can only move forward."""
    auto_approve_charges(world)
    run = open_run(world, goal="Buy a plan")
    charge = act(run, "payments.charge", {"customer": "cus_42", "amount_cents": 4900, "currency": "EUR"})
    assert charge.status == "succeeded", charge.error_message
    fault("email.send", "status", status=400, times=1)
    act(run, "email.send", {"to": "cus42@example.com", "subject": "Receipt", "body": "Thanks"})
    run.refresh_from_db()
    assert run.status == "needs_attention" and run.attention_reason == "step_failed", run.attention_detail
    return run


def user(username: str):
    return get_user_model().objects.get(username=username)
