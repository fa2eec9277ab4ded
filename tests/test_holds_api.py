"""What an agent sees for a held step (issue 29): over REST, 202 with hold.executes_at and links.cancel, and cancelling
stops it; over MCP, the same in words (and unwind_status says it again while it is held)."""
from ledger.models import Action
from ledger.policy.versions import tool_upsert
from tests.api_support import effects
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
