"""Agents are separated inside a tenant: acme's second agent ("rival") holds its own key and attacks booker's
runs over real HTTP against a live server. Each attempt answers 404 exactly like a missing object, and
booker's run and action are left as they were. People with a role see the whole tenant.
"""
import pytest

from ledger.models import Action, Run
from ledger.tenancy import agent_create
from ledger.policy.versions import tool_upsert
from tests.test_governance import Api, chain, problem

USER = {"email": "ashu@company.com", "name": "Ashu Kumar"}
CHAT = {"description": "Post to a chat channel.", "executor": "client", "saga_role": "compensatable", "timeout": 60,
        "compensation": {"strategy": "twin", "tool": "chat.delete", "args": {"message_id": "$result.id"}}}


@pytest.fixture
def agents(http_tools, settings):
    """booker (acme's agent) with a run holding a client-executed step that waits for its report, and rival."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    world = http_tools
    tool_upsert(tenant=world.acme, name="chat.delete", spec={"executor": "client", "timeout": 60}, actor="test")
    tool_upsert(tenant=world.acme, name="chat.post", spec=CHAT, actor="test")
    _, rival_key = agent_create(tenant=world.acme, name="rival", actor="test")
    world.booker = Api(world, key=world.key)
    world.rival = Api(world, key=rival_key)
    run = world.booker.post("/api/v1/runs", {"goal": "announce Ashu"}).json()
    step = world.booker.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "chat.post", "args": {"text": "hi"}})
    assert step.status_code == 202 and step.json()["awaiting_report"], step.text
    world.run_id, world.step_id = run["id"], step.json()["id"]
    return world


def snapshot(world) -> dict:
    run = Run.objects.get(pk=world.run_id)
    actions = sorted(Action.objects.filter(run=run).values_list("pk", "status", "result", "attempts", "lease_owner"))
    return {"run": (run.status, run.cancel_requested_at, run.next_seq), "actions": actions,
            "audit": chain(world.acme)}


def test_another_agent_cannot_report_a_made_up_success_for_my_client_step(agents):
    before = snapshot(agents)
    made_up = agents.rival.post(f"/api/v1/actions/{agents.step_id}/report", {"ok": True, "result": {"id": "m-fake"}})
    body = problem(made_up, 404, "not_found")
    missing = problem(agents.rival.post("/api/v1/actions/999999999/report", {"ok": True}), 404, "not_found")
    assert body["title"] == missing["title"]  # indistinguishable from an action that does not exist
    assert snapshot(agents) == before
    step = Action.objects.get(pk=agents.step_id)
    assert step.status == "running" and step.result is None
    # booker's own report is still the one that counts.
    reported = agents.booker.post(f"/api/v1/actions/{agents.step_id}/report", {"ok": True, "result": {"id": "m-1"}})
    assert reported.status_code == 200 and reported.json()["status"] == "succeeded"


def test_another_agent_cannot_cancel_my_run(agents):
    before = snapshot(agents)
    problem(agents.rival.post(f"/api/v1/runs/{agents.run_id}/cancel", {"reason": "mine now"}), 404, "not_found")
    problem(agents.rival.post(f"/api/v1/runs/{agents.run_id}/complete"), 404, "not_found")
    assert snapshot(agents) == before
    run = Run.objects.get(pk=agents.run_id)
    assert run.status == "running" and run.cancel_requested_at is None


def test_another_agent_cannot_propose_into_my_run(agents):
    before = snapshot(agents)
    problem(agents.rival.post(f"/api/v1/runs/{agents.run_id}/actions", {"tool": "chat.post", "args": {"text": "x"}}),
            404, "not_found")
    assert snapshot(agents) == before


def test_another_agent_lists_and_reads_none_of_my_runs(agents):
    own = agents.rival.post("/api/v1/runs", {"goal": "rival's own"}).json()
    assert [r["id"] for r in agents.rival.get("/api/v1/runs").json()["results"]] == [own["id"]]
    named = agents.rival.get("/api/v1/runs", agent="booker")  # naming the other agent does not widen the list
    assert named.status_code == 200 and named.json()["results"] == []
    for path in (f"/api/v1/runs/{agents.run_id}", f"/api/v1/runs/{agents.run_id}/trail",
                 f"/api/v1/actions/{agents.step_id}", f"/api/v1/actions/{agents.step_id}/wait"):
        problem(agents.rival.get(path), 404, "not_found")
    assert agents.rival.get("/api/v1/compensations/pending").json()["results"] == []
    # booker sees its own run and not rival's; a viewer sees the whole tenant.
    assert [r["id"] for r in agents.booker.get("/api/v1/runs").json()["results"]] == [agents.run_id]
    viewer = Api(agents, person="victor")
    assert {r["id"] for r in viewer.get("/api/v1/runs").json()["results"]} == {agents.run_id, own["id"]}
    assert viewer.get(f"/api/v1/actions/{agents.step_id}").status_code == 200


def test_another_agent_does_not_see_my_pending_compensations(agents):
    agents.booker.post(f"/api/v1/actions/{agents.step_id}/report", {"ok": True, "result": {"id": "m-1"}})
    cancelled = agents.booker.post(f"/api/v1/runs/{agents.run_id}/cancel", {"reason": "wrong channel"})
    assert cancelled.status_code == 200
    pending = agents.booker.get("/api/v1/compensations/pending").json()["results"]
    assert [p["tool"] for p in pending] == ["chat.delete"]
    assert agents.rival.get("/api/v1/compensations/pending").json()["results"] == []
    assert agents.rival.get("/api/v1/compensations/pending", run=agents.run_id).json()["results"] == []
    before = snapshot(agents)
    problem(agents.rival.post(f"/api/v1/actions/{pending[0]['id']}/report", {"ok": True}), 404, "not_found")
    assert snapshot(agents) == before
