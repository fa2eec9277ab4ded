"""The four demo scenarios end to end, with every tool reached over real HTTP (the product's policy file)."""
import requests

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.models import Action
from ledger.engine.runs import run_cancel, run_complete
from recovery.models import RecoveryItem
from sandbox.selectors import call_list, record_get, world_state
from tests.helpers import acme, act, open_run, signed_post


def fault(world, **rule):
    """Inject a fault as acme's operator does, over HTTP."""
    requests.post(f"{world.live_server.url}/sandbox/faults", json=rule, auth=("oscar", "pw-oscar"),
                  timeout=5).raise_for_status()


def test_onboarding_welcome_email_504_unwinds_license_and_user(http_tools):
    fault(http_tools, tool="email.send", mode="status", status=504, times=0)
    run = open_run(http_tools, goal="Onboard Ashu")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    mail = act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    run.refresh_from_db()
    assert mail.status == "failed" and mail.error_class == "http_504" and mail.attempts == 4
    assert run.status == "compensated"
    state = world_state(tenant=acme())
    assert state["users"] == [] and [lic["status"] for lic in state["licenses"]] == ["revoked"]
    assert state["messages"] == []
    # The sandbox saw Unwind's tenant-namespaced key, never a raw agent key.
    assert {c["idempotency_key"] for c in call_list(tenant=acme(), tool="hr.create_user")["results"]} == {user.tool_key}


def test_travel_hotel_failure_ordering_and_forward_retries(http_tools, django_capture_on_commit_callbacks):
    fault(http_tools, tool="travel.reserve_hotel", mode="status", status=409)
    run = open_run(http_tools)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "TP1", "date": "2026-12-04"})
    act(run, "travel.reserve_hotel", {"guest": "P", "hotel": "H", "nights": 3})
    run.refresh_from_db()
    assert run.status == "compensated" and world_state(tenant=acme())["charges"] == []

    run = open_run(http_tools)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "IB1", "date": "2026-12-18"})
    act(run, "travel.reserve_hotel", {"guest": "P", "hotel": "H", "nights": 2})
    charge = act(run, "payments.charge", {"customer": "cus", "amount_cents": 61000, "currency": "EUR"})
    assert charge.status == "awaiting_approval"
    approval_decide(request=ApprovalRequest.objects.get(action=charge), user=http_tools.alice, approve=True)
    charge.refresh_from_db()
    assert charge.status == "succeeded" and charge.after == {"status": "captured", "amount_cents": 61000}
    fault(http_tools, tool="email.send", mode="status", status=503, times=2)
    mail = act(run, "email.send", {"to": "p@x.io", "subject": "Trip", "body": "Booked"})
    assert mail.status == "succeeded" and mail.attempts == 3
    run_complete(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "completed" and len(world_state(tenant=acme())["messages"]) == 1


def test_crm_restore_and_drift(http_tools):
    run = open_run(http_tools)
    act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "compensated" and record_get("tickets", "T-204", tenant=acme())["priority"] == "normal"

    run = open_run(http_tools)
    act(run, "crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    signed_post(f"{http_tools.live_server.url}/sandbox/crm/tickets/update",
                {"ticket_id": "T-182", "status": "pending", "updated_by": "dana"}).raise_for_status()
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "needs_attention" and RecoveryItem.objects.get(run=run).reason == "drift"
    assert record_get("tickets", "T-182", tenant=acme())["status"] == "pending"


def test_email_compensated_by_a_correction(http_tools):
    run = open_run(http_tools)
    act(run, "crm.update_ticket", {"ticket_id": "T-311", "priority": "urgent"})
    act(run, "email.send", {"to": "c@example.com", "subject": "Escalated", "body": "b"})
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "compensated"
    subjects = sorted(m["subject"] for m in world_state(tenant=acme())["messages"])
    assert subjects == ["Correction: Escalated", "Escalated"]
    correction = Action.objects.get(run=run, kind="compensation", tool__name="email.send")
    assert correction.args["to"] == "c@example.com"
