"""Issue 31, finding 1: the agent does not choose which record is snapshotted, verified and restored.

Where a tool's policy derives the target (`target.from: args.<name>` or `result.<name>`), that is the target: a
different `target` in the proposal is refused (422 target_mismatch, naming both) with nothing recorded or done. A tool
whose policy says the agent names it (`target.from: agent`) takes the agent's target only once its own read finds it.
Everything over real HTTP against a live server, the sandbox's tools reached over HTTP too.
"""
from __future__ import annotations

import requests

from ledger.models import Action, AuditEvent, Run
from ledger.tenancy import agent_create
from sandbox.selectors import call_list, record_get, world_state
from tests.helpers import acme
from tests.test_args_as_sent import put_tool


def client(world, key: str | None = None) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key or world.key}"
    session.base = world.live_server.url
    return session


def open_run(agent: requests.Session) -> int:
    answer = agent.post(f"{agent.base}/api/v1/runs", json={"goal": "triage", "on_behalf_of": "carol@example.com"},
                        timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def propose(agent: requests.Session, run_id: int, tool: str, args: dict, **body) -> requests.Response:
    return agent.post(f"{agent.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args, **body},
                      timeout=30)


def assert_refused(answer: requests.Response, code: str) -> dict:
    assert answer.status_code == 422, answer.text
    assert answer.headers["Content-Type"].startswith("application/problem+json")
    body = answer.json()
    assert body["code"] == code, body
    return body


def test_a_target_other_than_the_policys_is_refused_and_the_right_record_is_restored(http_tools):
    agent = client(http_tools)
    run_id = open_run(agent)
    events = AuditEvent.objects.count()
    t311, t204 = record_get("tickets", "T-311", tenant=acme()), record_get("tickets", "T-204", tenant=acme())
    changed = {"ticket_id": "T-311", "priority": "urgent", "status": "closed"}

    refused = assert_refused(propose(agent, run_id, "crm.update_ticket", changed, target="T-204"), "target_mismatch")
    assert "'T-204'" in refused["detail"] and "'T-311'" in refused["detail"] and "args.ticket_id" in refused["detail"]
    assert refused["sent"] == "T-204" and refused["derived"] == "T-311" and refused["field"] == "target"
    # Nothing happened: no step, no event, no call of the tool, both tickets as they were.
    assert not Action.objects.filter(run_id=run_id).exists() and AuditEvent.objects.count() == events
    assert call_list(tenant=acme(), tool="crm.update_ticket")["results"] == []
    assert record_get("tickets", "T-311", tenant=acme()) == t311 and record_get("tickets", "T-204", tenant=acme()) == t204

    # The same target as the policy's is no disagreement; the step acts on, and the unwind restores, T-311.
    done = propose(agent, run_id, "crm.update_ticket", changed, target="T-311")
    assert done.status_code == 201 and done.json()["target"] == {"type": "ticket", "id": "T-311"}, done.text
    assert record_get("tickets", "T-311", tenant=acme())["status"] == "closed"
    cancelled = agent.post(f"{agent.base}/api/v1/runs/{run_id}/cancel", json={"reason": "wrong ticket"}, timeout=30)
    assert cancelled.status_code in (200, 202), cancelled.text
    assert Run.objects.get(pk=run_id).status == "compensated"
    restored = record_get("tickets", "T-311", tenant=acme())
    assert (restored["priority"], restored["status"]) == (t311["priority"], t311["status"])
    assert record_get("tickets", "T-204", tenant=acme()) == t204


def test_a_target_for_a_created_record_cannot_defeat_the_content_match(http_tools):
    agent = client(http_tools)
    run_id = open_run(agent)
    user = {"email": "ashu@company.com", "name": "Ashu Kumar"}
    for target in ("x1", "x2"):
        refused = assert_refused(propose(agent, run_id, "hr.create_user", user, target=target), "target_mismatch")
        assert f"'{target}'" in refused["detail"] and "result.id" in refused["detail"]
    assert world_state(tenant=acme())["users"] == [] and not Action.objects.filter(run_id=run_id).exists()
    first = propose(agent, run_id, "hr.create_user", user)
    again = propose(agent, run_id, "hr.create_user", user)
    assert first.status_code == 201 and again.status_code == 200 and again.json()["replayed"] is True
    assert len(world_state(tenant=acme())["users"]) == 1


def test_another_agent_cannot_read_a_record_through_target(http_tools):
    owner = client(http_tools)
    created = propose(owner, open_run(owner), "hr.create_user", {"email": "secret@company.com", "name": "Sam Secret"})
    assert created.status_code == 201, created.text
    user_id = created.json()["result"]["id"]
    _, other_key = agent_create(tenant=http_tools.acme, name="snoop")
    snoop = client(http_tools, other_key)
    run_id = open_run(snoop)
    answer = propose(snoop, run_id, "hr.create_user", {"email": "snoop@company.com", "name": "Snoop"}, target=user_id)
    assert_refused(answer, "target_mismatch")
    assert "secret@company.com" not in answer.text and "Sam Secret" not in answer.text
    assert not Action.objects.filter(run_id=run_id).exists()
    assert [u["email"] for u in world_state(tenant=acme())["users"]] == ["secret@company.com"]


def test_a_tool_without_a_target_rule_takes_no_target(http_tools):
    agent = client(http_tools)
    run_id = open_run(agent)
    mail = {"to": "c@example.com", "subject": "Hi", "body": "b"}
    refused = assert_refused(propose(agent, run_id, "email.send", mail, target="T-204"), "target_mismatch")
    assert "does not let the agent name" in refused["detail"]
    assert not Action.objects.filter(run_id=run_id).exists() and world_state(tenant=acme())["messages"] == []


def test_an_agent_named_target_is_taken_once_the_tools_read_finds_it(http_tools):
    put_tool(http_tools, "crm.note", {
        "endpoint": "/sandbox/crm/tickets/update", "args_schema": {"type": "object", "required": ["priority"]},
        "target": {"type": "ticket", "from": "agent"},
        "snapshot": {"read": "/sandbox/crm/tickets/{target}", "fields": ["priority", "status"]},
        "compensation": "none", "retry": {"max_attempts": 1}})
    agent = client(http_tools)
    run_id = open_run(agent)
    missing = propose(agent, run_id, "crm.note", {"ticket_id": "T-999", "priority": "low"}, target="T-999")
    body = assert_refused(missing, "target_not_found")
    assert "'T-999'" in body["detail"] and not Action.objects.filter(run_id=run_id).exists()
    assert call_list(tenant=acme(), tool="crm.note")["results"] == []
    found = propose(agent, run_id, "crm.note", {"ticket_id": "T-204", "priority": "low"}, target="T-204")
    assert found.status_code == 201, found.text
    assert found.json()["target"]["id"] == "T-204" and found.json()["before"]["priority"] == "normal"


def test_a_policy_cannot_let_the_agent_name_a_target_it_cannot_read(http_tools):
    people = requests.Session()
    people.auth = ("ada", "pw-ada")
    answer = people.put(f"{http_tools.live_server.url}/api/v1/tools/crm.blind", timeout=30, json={
        "endpoint": "/sandbox/crm/tickets/update", "target": {"type": "ticket", "from": "agent"},
        "compensation": "none"})
    assert answer.status_code == 400 and answer.json()["field"] == "tools.crm.blind.target.from", answer.text
