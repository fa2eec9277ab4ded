"""Runs over the API: open (with a declared plan), list with filters and pages, get, cancel, complete, trail."""
from datetime import timedelta

from django.utils import timezone

from ledger.models import Run
from ledger.engine.runs import run_open
from tests.api_support import assert_problem
from tests.helpers import open_run

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

USER = {"email": "ashu@company.com", "name": "Ashu Kumar"}


def test_open_a_run_with_a_plan(api_db):
    plan = ["hr.create_user", "licenses.provision", "payments.charge", "email.send"]
    response = api_db.agent.post("/api/v1/runs", {"goal": "Onboard Ashu", "on_behalf_of": "carol@example.com",
                                                  "intent": {"ticket": 42}, "plan": plan}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "running" and body["plan"] == plan and body["agent"] == "booker"
    assert body["intent"] == {"ticket": 42} and body["actions"] == [] and body["attention"] is None
    assert response["Location"] == body["links"]["self"] == f"http://testserver/api/v1/runs/{body['id']}"
    assert Run.objects.get(pk=body["id"]).tenant == api_db.world.acme


def test_the_opening_answer_is_the_run_as_read_back(api_db):
    """The 201 answers from the run in hand (no read back): it must say what a GET of the run says."""
    opened = api_db.agent.post("/api/v1/runs", {
        "goal": "Onboard Ashu", "on_behalf_of": "carol@example.com", "idle_timeout": 600, "plan": ["hr.create_user"],
        "intent": {"zeta": [1, 2.5, None], "a": {"nested": True, "b": "text"}, "model": "m"}}, format="json")
    assert opened.status_code == 201, opened.content
    read = api_db.agent.get(f"/api/v1/runs/{opened.json()['id']}")
    assert read.status_code == 200 and opened.json() == read.json()


def test_a_plan_that_breaks_the_ordering_law_is_refused_before_anything_runs(api_db):
    refused = api_db.agent.post("/api/v1/runs", {"plan": ["payments.charge", "hr.create_user"]}, format="json")
    body = assert_problem(refused, 409, "ordering_violation")
    assert body["rule"] == "compensatable_before_pivot" and body["conflicts_with"] == {"seq": 1, "tool": "payments.charge"}
    two_pivots = api_db.agent.post("/api/v1/runs", {"plan": ["payments.charge", "payments.charge"]}, format="json")
    assert assert_problem(two_pivots, 409, "ordering_violation")["rule"] == "one_pivot"
    unknown = api_db.agent.post("/api/v1/runs", {"plan": ["hr.create_user", "nope"]}, format="json")
    assert assert_problem(unknown, 400, "validation_error")["field"] == "plan[1]"
    assert not Run.objects.exists()


def test_open_refuses_wrong_types_and_unknown_fields(api_db):
    for body, field in [({"plan": "hr.create_user"}, "plan"), ({"intent": [1]}, "intent"), ({"goal": {"a": 1}}, "goal"),
                        ({"gaol": "typo"}, "gaol"), ({"on_behalf_of": "x" * 201}, "on_behalf_of")]:
        problem = assert_problem(api_db.agent.post("/api/v1/runs", body, format="json"), 400, "validation_error")
        assert problem["field"] == field, (body, problem)
    assert_problem(api_db.person("oscar").post("/api/v1/runs", {}, format="json"), 403, "permission_denied")


def test_list_filters_and_pages_newest_first(api_db):
    world = api_db.world
    runs = [open_run(world, goal=f"run {n}") for n in range(5)]
    Run.objects.filter(pk=runs[0].pk).update(created_at=timezone.now() - timedelta(days=3), status="completed")
    run_open(tenant=world.globex, agent=world.other_agent, actor="agent:intruder")
    first = api_db.agent.get("/api/v1/runs", {"limit": 2})
    assert first.status_code == 200
    assert [r["id"] for r in first.json()["results"]] == [runs[4].pk, runs[3].pk]
    second = api_db.agent.get(first.json()["next"])
    assert [r["id"] for r in second.json()["results"]] == [runs[2].pk, runs[1].pk]
    everything = api_db.agent.get("/api/v1/runs").json()["results"]
    assert {r["id"] for r in everything} == {r.pk for r in runs}
    completed = api_db.agent.get("/api/v1/runs", {"status": "completed"}).json()["results"]
    assert [r["id"] for r in completed] == [runs[0].pk]
    since = (timezone.now() - timedelta(days=1)).isoformat()
    assert len(api_db.agent.get("/api/v1/runs", {"since": since}).json()["results"]) == 4
    assert api_db.agent.get("/api/v1/runs", {"agent": "someone-else"}).json()["results"] == []
    assert len(api_db.agent.get("/api/v1/runs", {"agent": "booker"}).json()["results"]) == 5
    assert assert_problem(api_db.agent.get("/api/v1/runs", {"status": "sideways"}), 400, "validation_error")["field"] == "status"
    assert_problem(api_db.agent.get("/api/v1/runs", {"since": "yesterday"}), 400, "validation_error")
    assert_problem(api_db.agent.get("/api/v1/runs", {"cursor": "garbage"}), 400, "validation_error")
    assert len(api_db.person("victor").get("/api/v1/runs").json()["results"]) == 5


def test_get_a_run_with_its_actions_and_checkpoints(api):
    run = api.open_run()
    api.propose(run["id"], "hr.create_user", USER)
    api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 100})
    detail = api.agent.get(f"/api/v1/runs/{run['id']}")
    assert detail.status_code == 200
    body = detail.json()
    assert body["status"] == "awaiting_approval"
    assert [(a["seq"], a["tool"], a["status"]) for a in body["actions"]] == [
        (1, "hr.create_user", "succeeded"), (2, "payments.charge", "awaiting_approval")]
    assert body["actions"][1]["approval"]["status"] == "pending"
    assert body["checkpoints"][-1]["label"] == "awaiting_approval"
    assert api.person("victor").get(f"/api/v1/runs/{run['id']}").status_code == 200
    assert_problem(api.agent.get("/api/v1/runs/123456789"), 404, "not_found")


def test_cancel_unwinds_and_cancelling_twice_is_harmless(api):
    run = api.open_run()
    user = api.propose(run["id"], "hr.create_user", USER).json()
    cancelled = api.agent.post(f"/api/v1/runs/{run['id']}/cancel", {"reason": "wrong person"}, format="json")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "compensated" and cancelled.json()["cancel_requested_at"]
    assert [a["status"] for a in cancelled.json()["actions"] if a["id"] == user["id"]] == ["compensated"]
    assert api.agent.post(f"/api/v1/runs/{run['id']}/cancel", {}, format="json").status_code == 200
    other = api.open_run()
    api.agent.post(f"/api/v1/runs/{other['id']}/complete")
    assert_problem(api.agent.post(f"/api/v1/runs/{other['id']}/cancel", {}, format="json"), 409, "state_conflict")


def test_operators_cancel_and_viewers_cannot(api):
    run = api.open_run()
    assert_problem(api.person("victor").post(f"/api/v1/runs/{run['id']}/cancel", {}, format="json"), 403,
                   "permission_denied")
    assert_problem(api.person("alice").post(f"/api/v1/runs/{run['id']}/cancel", {}, format="json"), 403,
                   "permission_denied")
    response = api.person("oscar").post(f"/api/v1/runs/{run['id']}/cancel", {"reason": "fraud"}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "compensated"


def test_complete(api):
    run = api.open_run()
    api.propose(run["id"], "hr.create_user", USER)
    completed = api.agent.post(f"/api/v1/runs/{run['id']}/complete")
    assert completed.status_code == 200 and completed.json()["status"] == "completed"
    assert api.agent.post(f"/api/v1/runs/{run['id']}/complete").status_code == 200
    gated = api.open_run()
    api.propose(gated["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 100})
    assert_problem(api.agent.post(f"/api/v1/runs/{gated['id']}/complete"), 409, "state_conflict")
    assert_problem(api.person("oscar").post(f"/api/v1/runs/{run['id']}/complete"), 403, "permission_denied")


def test_the_correction_trail(api):
    run = api.open_run(goal="Onboard Ashu")
    api.propose(run["id"], "hr.create_user", USER)
    api.agent.post(f"/api/v1/runs/{run['id']}/cancel", {"reason": "wrong person"}, format="json")
    trail = api.agent.get(f"/api/v1/runs/{run['id']}/trail")
    assert trail.status_code == 200
    body = trail.json()
    assert body["run"] == run["id"] and body["status"] == "compensated" and body["headline"]
    kinds = [statement["kind"] for statement in body["statements"]]
    assert "changed" in kinds and "restored" in kinds
    assert body["audit"]["verified"] is True
    assert api.person("victor").get(f"/api/v1/runs/{run['id']}/trail").status_code == 200
    assert_problem(api.intruder.get(f"/api/v1/runs/{run['id']}/trail"), 404, "not_found")


def test_lists_cost_the_same_number_of_queries_whatever_their_length(api):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def cost(client, path, params=None) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get(path, params).status_code == 200
        return len(queries)

    def grow(steps: int):
        run = api.open_run()
        users = [api.propose(run["id"], "hr.create_user", {"email": f"u{run['id']}-{n}@company.com", "name": "U"})
                 for n in range(steps)]
        assert all(user.status_code == 201 for user in users)
        api.propose(run["id"], "payments.charge", {"customer": "c", "amount_cents": run["id"]})
        return run

    first = grow(1)
    alice = api.person("alice")
    before = [cost(api.agent, "/api/v1/runs"), cost(api.agent, f"/api/v1/runs/{first['id']}"),
              cost(alice, "/api/v1/approvals"), cost(api.person("victor"), "/api/v1/runs")]
    last = [grow(3) for _ in range(3)][-1]
    after = [cost(api.agent, "/api/v1/runs"), cost(api.agent, f"/api/v1/runs/{last['id']}"),
             cost(alice, "/api/v1/approvals"), cost(api.person("victor"), "/api/v1/runs")]
    assert after == before


def test_opening_again_with_the_same_key_returns_the_same_run(api_db):
    body = {"goal": "Trip", "on_behalf_of": "carol@example.com"}
    first = api_db.agent.post("/api/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="open-1")
    again = api_db.agent.post("/api/v1/runs", body, format="json", HTTP_IDEMPOTENCY_KEY="open-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    other = api_db.agent.post("/api/v1/runs", {"goal": "Another"}, format="json", HTTP_IDEMPOTENCY_KEY="open-1")
    assert_problem(other, 422, "idempotency_mismatch")
