"""The agent API's actions: the fast path, idempotency over HTTP, long-poll, client-executed tools."""
import threading
import time

from django.db import connections

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.models import Action
from tests.api_support import assert_problem, effects, settle
from tests.helpers import fault

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

USER = {"email": "ashu@company.com", "name": "Ashu Kumar"}
INTENT = {"goal": "Onboard Ashu", "reasoning": "HR ticket 42", "confidence": 0.9, "model": "scripted"}


def test_proposal_runs_inline_and_answers_201_with_the_result(api):
    run = api.open_run()
    response = api.propose(run["id"], "hr.create_user", USER, intent=INTENT)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "succeeded" and body["result"]["email"] == USER["email"]
    assert body["run_status"] == "running" and body["replayed"] is False
    assert body["intent"] == INTENT and body["key_source"] == "derived"
    assert response["Idempotency-Key"] == body["idempotency_key"].strip() and body["idempotency_key"].startswith("uw-")
    assert response["Location"] == body["links"]["self"]
    assert response["Location"].endswith(f"/api/v1/actions/{body['id']}")
    assert body["links"]["wait"].endswith(f"/api/v1/actions/{body['id']}/wait")
    assert "report" not in body["links"]
    assert len(effects("hr.create_user")) == 1


def test_the_answer_to_an_executed_proposal_is_the_action_as_recorded(api):
    """The answer to a step executed inside the request is built from the action as its success was recorded
    (no second read): it must be what the ledger holds, field by field, as a later read shows it."""
    run = api.open_run()
    for tool, args in (("hr.create_user", USER), ("travel.reserve_hotel", {"guest": "Zoë", "hotel": "Ritz", "nights": 2})):
        answer = api.propose(run["id"], tool, args, intent=INTENT)
        assert answer.status_code == 201, answer.content
        body = answer.json()
        read = api.agent.get(f"/api/v1/actions/{body['id']}").json()
        assert {k: v for k, v in body.items() if k not in ("replayed", "matched_by")} == read


def test_a_threshold_lowered_between_two_proposals_gates_the_second(api):
    """An agent proposes right after a person made every step need approval: the second step waits for a person,
    whatever the process kept from the first (ledger/engine/fastpath.py checks it in the proposal's own call)."""
    from ledger.models import Tenant

    run = api.open_run()
    first = api.propose(run["id"], "hr.create_user", USER)
    assert first.status_code == 201, first.content
    Tenant.objects.filter(slug="acme").update(approval_threshold="low")
    second = api.propose(run["id"], "hr.create_user", {"email": "b@company.com", "name": "B"})
    assert second.status_code == 202 and second.json()["status"] == "awaiting_approval", second.content
    assert len(effects("hr.create_user")) == 1


def test_same_key_replays_the_stored_response_without_calling_the_tool(api):
    run = api.open_run()
    first = api.propose(run["id"], "hr.create_user", USER, key="onboard-ashu-1")
    again = api.propose(run["id"], "hr.create_user", USER, key="onboard-ashu-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    assert again.json()["replayed"] is True
    assert again.json()["id"] == first.json()["id"] and again.json()["result"] == first.json()["result"]
    assert again.json()["key_source"] == "header"
    assert len(effects("hr.create_user")) == 1


def test_a_resent_request_without_a_key_is_the_same_action(api):
    run = api.open_run()
    first = api.propose(run["id"], "travel.reserve_hotel", {"guest": "Zoë", "hotel": "Ritz", "nights": 2})
    again = api.propose(run["id"], "travel.reserve_hotel", {"nights": 2.0, "hotel": "Ritz", "guest": "Zoe\u0308"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert len(effects("travel.reserve_hotel")) == 1


def test_same_key_with_other_arguments_is_422(api):
    run = api.open_run()
    first = api.propose(run["id"], "hr.create_user", USER, key="k-1")
    refused = api.propose(run["id"], "hr.create_user", {"email": "b@company.com", "name": "B"}, key="k-1")
    body = assert_problem(refused, 422, "idempotency_mismatch")
    assert body["action_id"] == first.json()["id"]
    assert len(effects("hr.create_user")) == 1


def test_a_slow_tool_answers_202_and_the_same_key_meanwhile_is_409(api, settings):
    settings.UNWIND_INLINE_WAIT = 0.2
    fault("hr.create_user", "latency", ms=3000)
    run = api.open_run()
    started = time.monotonic()
    first = api.propose(run["id"], "hr.create_user", USER, key="slow-1")
    # Answered after the 0.2 s it waits, not after the tool's 3 s (the margin is a loaded CI machine's).
    assert first.status_code == 202 and time.monotonic() - started < 2.5
    assert first.json()["status"] == "running"
    duplicate = api.propose(run["id"], "hr.create_user", USER, key="slow-1")
    assert assert_problem(duplicate, 409, "in_flight")["action_id"] == first.json()["id"]
    settled = settle(api, first.json()["id"])
    assert settled["status"] == "succeeded" and settled["result"]["email"] == USER["email"]
    assert len(effects("hr.create_user")) == 1
    replay = api.propose(run["id"], "hr.create_user", USER, key="slow-1")
    assert replay.status_code == 200 and replay.json()["result"] == settled["result"]


def test_a_failed_step_unwinds_the_run_and_the_answer_says_so(api):
    run = api.open_run()
    user = api.propose(run["id"], "hr.create_user", USER).json()
    fault("email.send", "status", status=504, times=0)
    response = api.propose(run["id"], "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    assert response.status_code == 201
    body = response.json()
    assert body["status"] == "failed" and body["error"]["error_class"] == "http_504"
    assert body["run_status"] == "compensated"
    assert api.agent.get(f"/api/v1/actions/{user['id']}").json()["status"] == "compensated"


def test_a_gated_action_answers_202_with_the_approval_link(api):
    run = api.open_run()
    response = api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 4900})
    assert response.status_code == 202
    body = response.json()
    request = ApprovalRequest.objects.get(action_id=body["id"])
    assert body["status"] == "awaiting_approval" and body["run_status"] == "awaiting_approval"
    assert body["approval"]["id"] == request.pk and body["approval"]["status"] == "pending"
    assert body["approval"]["url"] == f"http://testserver/approvals/{request.pk}/"
    assert body["approval"]["api_url"] == f"http://testserver/api/v1/approvals/{request.pk}"
    assert set(body["approval"]) == {"id", "status", "expires_at", "url", "api_url"}
    again = api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 4900})
    assert again.status_code == 202 and again.json()["replayed"] is True and again.json()["id"] == body["id"]
    assert effects("payments.charge") == []


def test_wait_answers_as_soon_as_the_outcome_is_known(api):
    run = api.open_run()
    action_id = api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 4900}).json()["id"]

    def approve():
        try:
            approval_decide(request=ApprovalRequest.objects.get(action_id=action_id), user=api.world.alice, approve=True)
        finally:
            connections.close_all()

    approver = threading.Timer(0.3, approve)
    started = time.monotonic()
    approver.start()
    response = api.wait(action_id, timeout=20)
    approver.join()
    assert response.status_code == 200 and time.monotonic() - started < 10
    assert response.json()["status"] == "succeeded" and response.json()["result"]["status"] == "captured"


def test_wait_times_out_with_202_and_the_action_as_it_stands(api):
    run = api.open_run()
    action_id = api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 4900}).json()["id"]
    started = time.monotonic()
    response = api.wait(action_id, timeout=0.3)
    assert response.status_code == 202 and 0.3 <= time.monotonic() - started < 3
    assert response.json()["status"] == "awaiting_approval"


def test_wait_refuses_a_timeout_beyond_30_seconds(api):
    run = api.open_run()
    action_id = api.propose(run["id"], "hr.create_user", USER).json()["id"]
    assert assert_problem(api.wait(action_id, timeout=31), 400, "validation_error")["field"] == "timeout"
    assert_problem(api.agent.get(f"/api/v1/actions/{action_id}/wait", {"timeout": "soon"}), 400, "validation_error")


def test_get_action(api):
    run = api.open_run()
    created = api.propose(run["id"], "hr.create_user", USER).json()
    response = api.agent.get(f"/api/v1/actions/{created['id']}")
    assert response.status_code == 200
    assert {k: response.json()[k] for k in ("id", "status", "result")} == {k: created[k] for k in ("id", "status", "result")}
    assert_problem(api.agent.get("/api/v1/actions/999999"), 404, "not_found")


def test_refusals_have_their_codes(api):
    run = api.open_run()
    assert_problem(api.propose(run["id"], "no.such_tool", {}), 404, "unknown_tool")
    assert_problem(api.propose(999999, "hr.create_user", USER), 404, "not_found")
    invalid = assert_problem(api.propose(run["id"], "hr.create_user", {"email": "a@b.io", "name": 5}), 400,
                             "validation_error")
    assert invalid["field"] == "args.name"
    assert assert_problem(api.propose(run["id"], "hr.create_user", USER, key=""), 400,
                          "validation_error")["field"] == "Idempotency-Key"
    api.propose(run["id"], "email.send", {"to": "a@b.io", "subject": "s", "body": "b"})
    ordering = assert_problem(api.propose(run["id"], "hr.create_user", USER), 409, "ordering_violation")
    assert ordering["rule"] == "compensatable_before_pivot" and ordering["conflicts_with"]["tool"] == "email.send"


def test_a_cancelled_run_takes_no_new_action(api):
    run = api.open_run()
    api.propose(run["id"], "hr.create_user", USER)
    cancelled = api.agent.post(f"/api/v1/runs/{run['id']}/cancel", {"reason": "user changed their mind"}, format="json")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "compensated"
    assert_problem(api.propose(run["id"], "licenses.provision", {"user_id": "u1"}), 409, "run_cancelled")


def test_a_finished_run_takes_no_new_action(api):
    run = api.open_run()
    assert api.agent.post(f"/api/v1/runs/{run['id']}/complete").status_code == 200
    assert_problem(api.propose(run["id"], "hr.create_user", USER), 409, "run_not_active")


# --- client-executed tools ---------------------------------------------------------------------------------

CHAT_POST = {"executor": "client", "saga_role": "compensatable", "risk": "low", "timeout": 30,
             "args_schema": {"type": "object", "required": ["channel", "text"]},
             "compensation": {"strategy": "twin", "tool": "chat.delete", "args": {"message_id": "$result.id"}}}
CHAT_DELETE = {"executor": "client", "risk": "low", "timeout": 30, "args_schema": {"type": "object"}}


def register_chat(api):
    for name, policy in (("chat.delete", CHAT_DELETE), ("chat.post", CHAT_POST)):
        assert api.person("ada").put(f"/api/v1/tools/{name}", policy, format="json").status_code == 201


def test_a_client_executed_step_waits_for_the_agents_report(api):
    register_chat(api)
    run = api.open_run()
    proposed = api.propose(run["id"], "chat.post", {"channel": "#new", "text": "Welcome Ashu"})
    assert proposed.status_code == 202
    body = proposed.json()
    assert body["status"] == "running" and body["awaiting_report"] is True
    assert body["links"]["report"].endswith(f"/api/v1/actions/{body['id']}/report")
    assert api.wait(body["id"], timeout=5).status_code == 200  # nothing to wait for: the agent must act
    reported = api.agent.post(f"/api/v1/actions/{body['id']}/report", {"ok": True, "result": {"id": "m-1"}},
                              format="json")
    assert reported.status_code == 200
    assert reported.json()["status"] == "succeeded" and reported.json()["result"] == {"id": "m-1"}
    again = api.agent.post(f"/api/v1/actions/{body['id']}/report", {"ok": True, "result": {"id": "m-1"}}, format="json")
    assert again.status_code == 200  # the same report twice is harmless
    other = api.agent.post(f"/api/v1/actions/{body['id']}/report", {"ok": True, "result": {"id": "m-2"}}, format="json")
    assert_problem(other, 409, "state_conflict")


def test_compensations_of_client_tools_wait_for_the_agent_and_finish_the_unwind(api):
    register_chat(api)
    run = api.open_run()
    post = api.propose(run["id"], "chat.post", {"channel": "#new", "text": "Welcome"}).json()
    api.agent.post(f"/api/v1/actions/{post['id']}/report", {"ok": True, "result": {"id": "m-1"}}, format="json")
    fault("email.send", "status", status=504, times=0)
    failed = api.propose(run["id"], "email.send", {"to": "a@b.io", "subject": "s", "body": "b"}).json()
    assert failed["status"] == "failed" and failed["run_status"] == "unwinding"

    pending = api.agent.get("/api/v1/compensations/pending")
    assert pending.status_code == 200
    [compensation] = pending.json()["results"]
    assert compensation["tool"] == "chat.delete" and compensation["args"] == {"message_id": "m-1"}
    assert compensation["undoes"]["id"] == post["id"] and compensation["awaiting_report"] is True
    assert api.agent.get("/api/v1/compensations/pending", {"run": run["id"] + 1}).json()["results"] == []

    done = api.agent.post(compensation["links"]["report"], {"ok": True, "result": {"deleted": True}}, format="json")
    assert done.status_code == 200 and done.json()["run_status"] == "compensated"
    assert api.agent.get("/api/v1/compensations/pending").json()["results"] == []
    assert api.agent.get(f"/api/v1/actions/{post['id']}").json()["status"] == "compensated"


def test_a_reported_failure_unwinds_like_any_failed_step(api):
    register_chat(api)
    run = api.open_run()
    user = api.propose(run["id"], "hr.create_user", USER).json()
    post = api.propose(run["id"], "chat.post", {"channel": "#new", "text": "Welcome"}).json()
    response = api.agent.post(f"/api/v1/actions/{post['id']}/report", {"ok": False, "error": "channel archived"},
                              format="json")
    assert response.status_code == 200
    assert response.json()["status"] == "failed" and response.json()["error"]["message"] == "channel archived"
    assert response.json()["run_status"] == "compensated"
    assert Action.objects.get(pk=user["id"]).status == "compensated"


def test_report_refusals(api):
    register_chat(api)
    run = api.open_run()
    server_side = api.propose(run["id"], "hr.create_user", USER).json()
    assert_problem(api.agent.post(f"/api/v1/actions/{server_side['id']}/report", {"ok": True}, format="json"), 409,
                   "state_conflict")
    post = api.propose(run["id"], "chat.post", {"channel": "#new", "text": "Welcome"}).json()
    mixed = api.agent.post(f"/api/v1/actions/{post['id']}/report", {"ok": True, "error": "what"}, format="json")
    assert assert_problem(mixed, 400, "validation_error")["field"] == "error"
    assert_problem(api.agent.post(f"/api/v1/actions/{post['id']}/report", {"result": {}}, format="json"), 400,
                   "validation_error")
    assert_problem(api.agent.post("/api/v1/actions/999999/report", {"ok": True}, format="json"), 404, "not_found")
    api.agent.post(f"/api/v1/actions/{post['id']}/report", {"ok": True, "result": {"id": "m"}}, format="json")
