"""What an agent sees for a held step (issue 29): over REST, 202 with hold.executes_at and links.cancel, and cancelling
stops it; over MCP, the same in words (and unwind_status says it again while it is held)."""
import pytest

from ledger.models import Action
from ledger.policy.versions import tool_upsert
from tests.api_support import assert_problem, effects
from tests.conftest import in_process_policy
from tests.test_mcp_gateway import call, gateway, session  # noqa: F401

pytest_plugins = ["tests.api_fixtures"]

MAIL = {"to": "carol@example.com", "subject": "Your trip", "body": "Booked."}


def held_email(world, value="2s"):
    tool_upsert(tenant=world.acme, name="email.send", spec=dict(in_process_policy()["tools"]["email.send"], hold=value),
                actor="test")


def test_rest_answers_202_with_executes_at_and_how_to_stop_and_the_cancel_stops_it(api):
    held_email(api.world)
    run = api.open_run()
    answer = api.propose(run["id"], "email.send", MAIL)
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert body["status"] == "held" and body["attempts"] == 0 and body["stopped_by"] == ""
    hold = body["hold"]
    assert hold["executes_at"] and hold["customer_can_stop"] is False and "links.cancel" in hold["how_to_stop"]
    assert body["links"]["cancel"].endswith(f"/api/v1/runs/{run['id']}/cancel")
    assert effects("email.send") == []
    cancelled = api.agent.post(body["links"]["cancel"], {"reason": "wrong address"}, format="json")
    assert cancelled.status_code == 200, cancelled.content
    after = api.agent.get(body["links"]["self"]).json()
    assert after["status"] == "skipped" and after["stopped_by"] == "agent" and after["hold"] is None
    assert effects("email.send") == []


def test_rest_wait_answers_with_the_outcome_once_the_window_ended(api, django_capture_on_commit_callbacks):
    from ledger.engine.sweep import sweep
    import time

    held_email(api.world, "1s")
    run = api.open_run()
    body = api.propose(run["id"], "email.send", MAIL).json()
    assert api.wait(body["id"], timeout=0.2).status_code == 202  # still held
    time.sleep(1.1)
    with django_capture_on_commit_callbacks(execute=True):
        sweep()
    done = api.wait(body["id"], timeout=5)
    assert done.status_code == 200 and done.json()["status"] == "succeeded" and len(effects("email.send")) == 1


def test_mcp_says_when_it_runs_and_how_to_stop_it(gateway):  # noqa: F811
    held_email(gateway.world, {"for": "1s", "customer_can_stop": True})

    async def script(mcp):
        first = await call(mcp, "email.send", MAIL)
        status = await call(mcp, "unwind_status", {"action_id": first[1]["action_id"], "wait": 0.5})
        return first, status

    (is_error, payload, _), status = session(gateway.url, gateway.world.key, script)
    assert not is_error and payload["status"] == "held" and payload["pending"] is True and payload["executes_at"]
    assert f"held until {payload['executes_at']}" in payload["message"]
    assert "call unwind_rollback before then: the step is never executed" in payload["message"]
    # No worker runs in this test, so nothing releases it: unwind_status answers the same pending words.
    assert status[1]["status"] == "held" and status[1]["message"] == payload["message"]
    assert Action.objects.get(pk=payload["action_id"]).status == "held" and effects("email.send") == []


FLIGHT = {"passenger": "Carol", "flight": "TP101", "date": "2026-12-01"}
HOTEL = {"guest": "Carol", "hotel": "Lisboa Plaza", "nights": 2}
CHARGE = {"customer": "carol", "amount_cents": 4200}


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "python_path"])
def test_a_pivot_or_a_retriable_step_waits_until_an_earlier_held_step_has_run(api, settings, fast,
                                                                              django_capture_on_commit_callbacks):
    """A held step may still be stopped, and stopping it unwinds the run: a pivot or retriable step proposed after it
    would already have acted and could not be undone. So the agent is told to propose it once the held step has run
    (409 naming it and when it runs), nothing reaches the tool, and afterwards the same call goes through. A step
    of the same rank may follow (stopping the held one undoes it too). On PostgreSQL both paths: the one-call
    proposal hands a run with a held step to the Python path, which decides."""
    from ledger.engine.sweep import sweep
    import time

    settings.UNWIND_FAST_PATH = fast
    policy = in_process_policy()["tools"]
    tool_upsert(tenant=api.world.acme, name="travel.book_flight", spec=dict(policy["travel.book_flight"], hold="1s"),
                actor="test")
    tool_upsert(tenant=api.world.acme, name="payments.charge", spec=dict(policy["payments.charge"], approval="auto"),
                actor="test")
    run = api.open_run()
    flight = api.propose(run["id"], "travel.book_flight", FLIGHT)
    assert flight.status_code == 202 and flight.json()["status"] == "held", flight.content
    hotel = api.propose(run["id"], "travel.reserve_hotel", HOTEL)  # compensatable after compensatable: may follow
    assert hotel.status_code in (200, 201) and hotel.json()["status"] == "succeeded", hotel.content
    for tool, args in (("payments.charge", CHARGE), ("email.send", MAIL)):
        refused = assert_problem(api.propose(run["id"], tool, args), 409, "ordering_violation")
        assert refused["rule"] == "after_a_held_step" and refused["conflicts_with"]["seq"] == flight.json()["seq"]
        assert "held until" in refused["detail"] and "once step" in refused["detail"]
    assert effects("payments.charge") == [] and effects("email.send") == [] and effects("travel.book_flight") == []
    assert not Action.objects.filter(run_id=run["id"], tool__name__in=["payments.charge", "email.send"]).exists()
    time.sleep(1.1)
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["released"] == 1
    assert len(effects("travel.book_flight")) == 1
    charged = api.propose(run["id"], "payments.charge", CHARGE)
    assert charged.status_code in (200, 201) and charged.json()["status"] == "succeeded", charged.content
    assert len(effects("payments.charge")) == 1
