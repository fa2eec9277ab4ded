"""Guarantee 7: a snapshot restore never overwrites a change someone else made since."""
from ledger.engine.runs import run_cancel
from recovery.models import RecoveryItem
from recovery.services import recovery_compensate
from sandbox import services as sandbox
from sandbox.selectors import record_get
from tests.helpers import acme, act, open_run


def test_a_wrong_priority_change_is_restored_from_the_before_snapshot(tools):
    run = open_run(tools, goal="Escalate the login bug")
    change = act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    assert change.before == {"priority": "normal", "status": "open"}
    assert change.after == {"priority": "high", "status": "open"} and change.verification == {"ok": True}
    run_cancel(run=run, actor="agent:booker", reason="wrong ticket")
    run.refresh_from_db()
    assert run.status == "compensated"
    assert record_get("tickets", "T-204", tenant=acme())["priority"] == "normal"


def test_a_target_changed_since_is_not_overwritten(tools):
    run = open_run(tools)
    act(run, "crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    sandbox.crm_update_ticket(tenant=acme(), ticket_id="T-182", status="pending", priority=None,
                              note="customer replied", updated_by="dana")
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    ticket = record_get("tickets", "T-182", tenant=acme())
    assert run.status == "needs_attention"
    assert (ticket["priority"], ticket["status"]) == ("high", "pending")  # dana's change stands
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "drift" and "T-182" in item.detail and "status" in item.detail


def test_an_operator_may_overwrite_a_drifted_target_on_purpose(tools):
    run = open_run(tools)
    act(run, "crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    sandbox.crm_update_ticket(tenant=acme(), ticket_id="T-182", status="pending", priority=None, note=None,
                              updated_by="dana")
    run_cancel(run=run, actor="agent:booker")
    recovery_compensate(item=RecoveryItem.objects.get(run=run), user=tools.oscar, reason="dana agreed")
    run.refresh_from_db()
    assert run.status == "compensated"
    assert record_get("tickets", "T-182", tenant=acme())["priority"] == "normal"
