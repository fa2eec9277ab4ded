"""Guarantee 3: compensations run newest-first, each with its own key, retried, alert and continue."""
from django.core import mail as outbox_mail

from approvals.services import notifications_send
from ledger.models import Action
from sandbox.selectors import world_state
from tests.helpers import acme, act, fault, open_run


def forward_and_undo(run):
    actions = list(Action.objects.filter(run=run).order_by("seq").select_related("tool"))
    return [a for a in actions if a.kind == "forward"], [a for a in actions if a.kind == "compensation"]


def test_onboarding_unwinds_license_then_user(tools):
    run = open_run(tools, goal="Onboard Ashu")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    lic = act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=504, times=0)
    act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    run.refresh_from_db()
    assert run.status == "compensated"
    forward, undo = forward_and_undo(run)
    assert [u.compensates_id for u in undo] == [lic.pk, user.pk]  # newest first
    assert [u.tool.name for u in undo] == ["licenses.revoke", "hr.delete_user"]
    assert all(u.idempotency_key == f"{Action.objects.get(pk=u.compensates_id).idempotency_key}:undo" for u in undo)
    state = world_state(tenant=acme())
    assert state["users"] == [] and all(lic["status"] == "revoked" for lic in state["licenses"])


def test_a_compensation_that_fails_twice_then_succeeds_is_retried(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    fault("hr.delete_user", "status", status=503, times=2)
    fault("travel.reserve_hotel", "status", status=422)
    act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    run.refresh_from_db()
    _, undo = forward_and_undo(run)
    assert run.status == "compensated"
    assert undo[0].attempts == 3 and undo[0].status == "succeeded"


def test_alert_and_continue_when_one_compensation_never_succeeds(tools):
    run = open_run(tools)
    user = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    flight = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    fault("licenses.revoke", "status", status=500, times=0)
    fault("travel.reserve_hotel", "status", status=400)
    act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    run.refresh_from_db()
    forward, undo = forward_and_undo(run)
    by_tool = {a.tool.name: a.status for a in forward}
    assert by_tool["travel.book_flight"] == "compensated"
    assert by_tool["licenses.provision"] == "compensation_failed"
    assert by_tool["hr.create_user"] == "compensated"  # the older step was still undone
    assert run.status == "needs_attention"
    assert flight.pk == undo[0].compensates_id
    # The operators were told (outbox, sent after commit by the worker's sweep).
    notifications_send()
    assert any("Compensation failed: licenses.provision" in m.subject for m in outbox_mail.outbox)


def test_an_undo_that_cannot_be_put_together_is_alerted_and_the_rest_go_on(tools):
    """The step's compensation names a field its result does not have: it is recorded as failed, and the same
    unwind goes on to the older steps and settles the run (no sweep runs here to start another)."""
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    spec = in_process_policy()["tools"]["licenses.provision"]
    spec["compensation"] = {**spec["compensation"], "args": {"license_id": "$result.nowhere"}}
    tool_upsert(tenant=acme(), name="licenses.provision_unmapped", spec=spec, actor="user:adam")
    run = open_run(tools)
    user = act(run, "hr.create_user", {"email": "u@x.io", "name": "U"})
    act(run, "licenses.provision_unmapped", {"user_id": user.result["id"]})
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    fault("travel.reserve_hotel", "status", status=400)
    act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    run.refresh_from_db()
    forward, _ = forward_and_undo(run)
    by_tool = {a.tool.name: a.status for a in forward}
    assert by_tool["travel.book_flight"] == "compensated"
    assert by_tool["licenses.provision_unmapped"] == "compensation_failed"
    assert by_tool["hr.create_user"] == "compensated"
    assert run.status == "needs_attention"
