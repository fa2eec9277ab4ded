"""A before-snapshot that cannot be read for a passing reason is a 503 the agent can simply resend.

Chaos found it: a web process killed while Unwind read a ticket before changing it made the agent's proposal a
409 `state_conflict`, which a careful agent takes as final. Nothing had been recorded or done, so the honest
answer is 503 `target_unreadable` with Retry-After, and the client resends the same request by itself.
"""
import pytest

from ledger.models import Action
from tests.wire_support import tool_service, wired  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)


def ticket_tool(service) -> dict:
    return {"tools": {"crm.set_priority": {
        "executor": {"kind": "http", "url": service.answer("/set", {"ok": True})},
        "args_schema": {"type": "object", "required": ["ticket_id", "priority"]},
        "target": {"type": "ticket", "from": "args.ticket_id"},
        "snapshot": {"read": service.url + "/tickets/{target}", "fields": ["priority"]},
        "saga_role": "retriable", "risk": "low", "approval": "auto",
    }}}


def test_a_passing_read_failure_is_503_with_nothing_recorded_and_the_resend_acts_once(wired, tool_service):
    loaded = wired.load(ticket_tool(tool_service))
    assert loaded.status_code == 200, loaded.text
    tool_service.answer_in_turn("/tickets/T-1", (503, {"detail": "busy"}), (200, {"priority": "low"}))
    run = wired.open_run()

    first = wired.propose(run["id"], "crm.set_priority", {"ticket_id": "T-1", "priority": "high"})
    assert first.status_code == 503, first.text
    assert first.json()["code"] == "target_unreadable" and first.headers["Retry-After"] == "1"
    assert "nothing was done" in first.json()["detail"]
    assert not Action.objects.filter(run_id=run["id"]).exists() and tool_service.calls_to("/set") == []

    again = wired.propose(run["id"], "crm.set_priority", {"ticket_id": "T-1", "priority": "high"})
    assert again.status_code == 201 and again.json()["status"] == "succeeded", again.text
    assert tool_service.calls_to("/set") == [{"ticket_id": "T-1", "priority": "high"}]


def test_a_read_refused_for_good_stays_a_409_state_conflict(wired, tool_service):
    loaded = wired.load(ticket_tool(tool_service))
    assert loaded.status_code == 200, loaded.text
    tool_service.answer_in_turn("/tickets/T-2", (403, {"detail": "not yours to read"}))
    run = wired.open_run()
    answer = wired.propose(run["id"], "crm.set_priority", {"ticket_id": "T-2", "priority": "high"})
    assert answer.status_code == 409 and answer.json()["code"] == "state_conflict", answer.text
    assert tool_service.calls_to("/set") == []
