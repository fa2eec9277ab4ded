"""Who may call what: agent keys, people, separation of duties, tenant isolation (404), throttling."""
import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest
from ledger.api.throttle import AgentKeyThrottle
from ledger.models import Run
from ledger.engine.proposal import action_propose
from ledger.tenancy import agent_revoke
from tests.api_support import assert_problem, basic
from tests.helpers import act, open_run

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

USER = {"email": "ashu@company.com", "name": "Ashu Kumar"}


def test_no_credentials_is_401_with_a_bearer_challenge(api_db):
    response = api_db.anonymous.get("/api/v1/runs")
    assert_problem(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == 'Bearer realm="unwind"'
    people = api_db.anonymous.get("/api/v1/approvals")
    assert_problem(people, 401, "not_authenticated")
    assert people["WWW-Authenticate"].startswith("Basic")


@pytest.mark.parametrize("header", [
    "Bearer uw_0000_nope", "Bearer", "Bearer  ", "Bearer a b", "Bearer not-a-key", "bearer uw_x",
])
def test_a_bad_key_is_401(api_db, header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    assert_problem(client.get("/api/v1/runs"), 401, "authentication_failed")


def test_a_revoked_key_is_401(api_db):
    assert api_db.agent.get("/api/v1/runs").status_code == 200
    agent_revoke(agent=api_db.world.agent, actor="test")
    assert_problem(api_db.agent.get("/api/v1/runs"), 401, "authentication_failed")


def test_wrong_password_is_401(api_db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=basic("alice", "guess"))
    assert_problem(client.get("/api/v1/approvals"), 401, "authentication_failed")


def test_agents_request_and_people_decide(api_db):
    for path in ("/api/v1/approvals", "/api/v1/approvals/1", "/api/v1/recovery-items", "/api/v1/recovery-items/1"):
        assert_problem(api_db.agent.get(path), 403, "permission_denied")
    for path in ("/api/v1/approvals/1/approve", "/api/v1/approvals/1/reject", "/api/v1/recovery-items/1/close"):
        assert_problem(api_db.agent.post(path, {"reason": "self-service"}, format="json"), 403, "permission_denied")
    run = open_run(api_db.world)
    alice = api_db.person("alice")
    assert_problem(alice.post("/api/v1/runs", {}, format="json"), 403, "permission_denied")
    assert_problem(alice.post(f"/api/v1/runs/{run.pk}/actions", {"tool": "hr.create_user", "args": USER}, format="json"),
                   403, "permission_denied")
    assert_problem(alice.post(f"/api/v1/runs/{run.pk}/complete"), 403, "permission_denied")
    assert_problem(alice.get("/api/v1/compensations/pending"), 403, "permission_denied")


def test_a_person_of_no_tenant_sees_nothing(api_db):
    get_user_model().objects.create_user("drifter", "d@example.com", "pw-drifter")
    drifter = api_db.person("drifter")
    assert_problem(drifter.get("/api/v1/runs"), 403, "permission_denied")
    assert drifter.get("/api/v1/approvals").json()["results"] == []


def test_the_browsable_api_serves_people_with_a_session_and_checks_csrf(api_db):
    run = open_run(api_db.world)
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(api_db.world.oscar)
    page = client.get(f"/api/v1/runs/{run.pk}", HTTP_ACCEPT="text/html")
    assert page.status_code == 200 and page["Content-Type"].startswith("text/html")
    assert b"test run" in page.content
    refused = client.post(f"/api/v1/runs/{run.pk}/cancel", {}, format="json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    assert not Run.objects.get(pk=run.pk).cancel_requested_at
    assert client.get("/api/v1/tools", HTTP_ACCEPT="text/html").status_code == 200


def test_another_tenants_key_gets_404_on_every_object(api_db):
    world = api_db.world
    run = open_run(world)
    action = act(run, "hr.create_user", USER)
    gated = action_propose(run=run, tool_name="payments.charge", args={"customer": "c", "amount_cents": 1},
                           actor="agent:booker").action
    api_db.person("ada").put("/api/v1/tools/crm.escalate", {"executor": "client"}, format="json")
    intruder = api_db.intruder
    for path in (f"/api/v1/runs/{run.pk}", f"/api/v1/runs/{run.pk}/trail", f"/api/v1/actions/{action.pk}",
                 f"/api/v1/actions/{action.pk}/wait?timeout=0", f"/api/v1/actions/{gated.pk}",
                 "/api/v1/tools/crm.escalate"):
        assert_problem(intruder.get(path), 404, "not_found")
    for path, body in ((f"/api/v1/runs/{run.pk}/cancel", {}), (f"/api/v1/runs/{run.pk}/complete", {}),
                       (f"/api/v1/runs/{run.pk}/actions", {"tool": "hr.create_user", "args": USER}),
                       (f"/api/v1/actions/{action.pk}/report", {"ok": True})):
        assert_problem(intruder.post(path, body, format="json"), 404, "not_found")
    assert intruder.get("/api/v1/runs").json()["results"] == []
    run.refresh_from_db()
    assert run.status == "awaiting_approval" and run.cancel_requested_at is None

    mallory = api_db.person("mallory")
    request = ApprovalRequest.objects.get(action=gated)
    assert_problem(mallory.get(f"/api/v1/approvals/{request.pk}"), 404, "not_found")
    assert_problem(mallory.post(f"/api/v1/approvals/{request.pk}/approve", {}, format="json"), 404, "not_found")
    assert mallory.get("/api/v1/approvals").json()["results"] == []
    assert_problem(mallory.get(f"/api/v1/runs/{run.pk}"), 404, "not_found")
    assert_problem(mallory.post(f"/api/v1/runs/{run.pk}/cancel", {}, format="json"), 404, "not_found")
    request.refresh_from_db()
    assert request.status == "pending"


def test_throttling_is_per_agent_key(api_db, settings):
    settings.UNWIND_THROTTLE_RATE = "3/min"
    for _ in range(3):
        assert api_db.agent.get("/api/v1/tools").status_code == 200
    refused = api_db.agent.get("/api/v1/tools")
    body = assert_problem(refused, 429, "throttled")
    assert 1 <= int(refused["Retry-After"]) <= 20 and body["retry_after"] == int(refused["Retry-After"])
    assert api_db.intruder.get("/api/v1/tools").status_code == 200
    for _ in range(4):
        assert api_db.person("victor").get("/api/v1/tools").status_code == 200


def test_a_malformed_throttle_rate_fails_loudly(settings):
    settings.UNWIND_THROTTLE_RATE = "lots"
    with pytest.raises(ImproperlyConfigured, match="UNWIND_THROTTLE_RATE"):
        AgentKeyThrottle()
