"""The approvals API: people approve and reject over HTTP (Basic auth); the agent's action follows."""
from approvals.models import ApprovalRequest
from tests.api_support import assert_problem, effects

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

CHARGE = {"customer": "cus_1", "amount_cents": 4900}


def gated(api, **run):
    opened = api.open_run(**run)
    action = api.propose(opened["id"], "payments.charge", CHARGE).json()
    return opened, action, ApprovalRequest.objects.get(action_id=action["id"])


def test_approval_round_trip_over_http(api):
    _, action, request = gated(api)
    alice = api.person("alice")
    listed = alice.get("/api/v1/approvals")
    assert listed.status_code == 200
    [row] = listed.json()["results"]
    assert row["id"] == request.pk and row["tool"] == "payments.charge" and row["status"] == "pending"
    assert row["preview"]["args"] == CHARGE and row["links"]["page"].endswith(f"/approvals/{request.pk}/")
    detail = alice.get(f"/api/v1/approvals/{request.pk}")
    assert detail.status_code == 200 and detail.json()["args_hash"] == request.args_hash

    approved = alice.post(f"/api/v1/approvals/{request.pk}/approve", {"reason": "within budget"}, format="json")
    assert approved.status_code == 200, approved.content
    assert approved.json()["status"] == "approved"
    assert [(d["user"], d["decision"]) for d in approved.json()["decisions"]] == [("alice", "approve")]
    outcome = api.wait(action["id"], timeout=10)
    assert outcome.status_code == 200 and outcome.json()["status"] == "succeeded"
    assert len(effects("payments.charge")) == 1
    assert_problem(api.person("ben").post(f"/api/v1/approvals/{request.pk}/approve", {}, format="json"), 409,
                   "state_conflict")
    assert alice.get("/api/v1/approvals").json()["results"] == []
    assert [r["id"] for r in alice.get("/api/v1/approvals", {"status": "approved"}).json()["results"]] == [request.pk]


def test_a_rejection_carries_its_reason_to_the_agent_and_unwinds(api):
    run = api.open_run()
    user = api.propose(run["id"], "hr.create_user", {"email": "a@company.com", "name": "A"}).json()
    action = api.propose(run["id"], "payments.charge", CHARGE).json()
    request = ApprovalRequest.objects.get(action_id=action["id"])
    ben = api.person("ben")
    assert assert_problem(ben.post(f"/api/v1/approvals/{request.pk}/reject", {}, format="json"), 400,
                          "validation_error")["field"] == "reason"
    rejected = ben.post(f"/api/v1/approvals/{request.pk}/reject", {"reason": "wrong customer"}, format="json")
    assert rejected.status_code == 200 and rejected.json()["status"] == "rejected"
    assert rejected.json()["outcome_reason"] == "wrong customer"
    outcome = api.wait(action["id"], timeout=5).json()
    assert outcome["status"] == "rejected" and outcome["decision_reason"] == "wrong customer"
    assert outcome["run_status"] == "compensated"
    assert api.agent.get(f"/api/v1/actions/{user['id']}").json()["status"] == "compensated"
    assert effects("payments.charge") == []


def test_who_may_decide(api):
    _, _, request = gated(api, on_behalf_of="alice@example.com")
    path = f"/api/v1/approvals/{request.pk}"
    assert_problem(api.person("victor").post(f"{path}/approve", {}, format="json"), 403, "permission_denied")
    assert_problem(api.person("oscar").get("/api/v1/approvals/999999"), 404, "not_found")
    on_her_behalf = api.person("alice").post(f"{path}/approve", {}, format="json")
    assert "someone else must decide" in assert_problem(on_her_behalf, 403, "permission_denied")["detail"]
    assert_problem(api.agent.post(f"{path}/approve", {}, format="json"), 403, "permission_denied")
    assert_problem(api.person("mallory").post(f"{path}/approve", {}, format="json"), 404, "not_found")
    assert api.person("victor").get(path).status_code == 200
    request.refresh_from_db()
    assert request.status == "pending"


def test_list_filters(api):
    first_run, _, first = gated(api)
    _, _, second = gated(api)
    alice = api.person("alice")
    assert [r["id"] for r in alice.get("/api/v1/approvals").json()["results"]] == [second.pk, first.pk]
    assert [r["id"] for r in alice.get("/api/v1/approvals", {"run": first_run["id"]}).json()["results"]] == [first.pk]
    assert alice.get("/api/v1/approvals", {"risk": "low"}).json()["results"] == []
    assert len(alice.get("/api/v1/approvals", {"tool": "payments.charge", "tenant": "acme"}).json()["results"]) == 2
    assert len(alice.get("/api/v1/approvals", {"limit": 1}).json()["results"]) == 1
