"""Issue 31, finding 5: agents of one tenant are separated like tenants in their Idempotency-Keys.

Agent B reusing agent A's key learns nothing of A's action (no 422 naming A's run and tool: its own call is
recorded), and B taking a key first takes nothing from A. The key each sends to the tools differs too, so a tool
that deduplicates by key does not hand one agent the other's effect. Over HTTP against a live server, both agents
of acme, on SQLite and on PostgreSQL (where the fast path records proposals in one call).
"""
from __future__ import annotations

from django.db import connection

from ledger.models import Action
from ledger.tenancy import agent_create
from sandbox.selectors import call_list, world_state
from tests.helpers import acme
from tests.test_agent_target import client, open_run

TICKET = {"ticket_id": "T-311", "priority": "urgent"}
USER = {"email": "bee@company.com", "name": "Bee"}


def propose(agent, run_id: int, tool: str, args: dict, key: str):
    return agent.post(f"{agent.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args},
                      headers={"Idempotency-Key": key}, timeout=30)


def two_agents(world):
    _, other_key = agent_create(tenant=world.acme, name="second")
    return client(world), client(world, other_key)


def test_another_agents_key_is_unknown_and_reveals_nothing(http_tools):
    a, b = two_agents(http_tools)
    a_run, b_run = open_run(a), open_run(b)
    first = propose(a, a_run, "crm.update_ticket", TICKET, "shared-1")
    assert first.status_code == 201, first.text
    theirs = propose(b, b_run, "hr.create_user", USER, "shared-1")
    assert theirs.status_code == 201, theirs.text
    assert theirs.json()["id"] != first.json()["id"] and theirs.json()["run"] == b_run
    assert "crm.update_ticket" not in theirs.text and f"run {a_run}" not in theirs.text
    assert len(world_state(tenant=acme())["users"]) == 1
    # Each agent's key still answers for its own call.
    again = propose(a, a_run, "crm.update_ticket", TICKET, "shared-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = propose(b, b_run, "crm.update_ticket", TICKET, "shared-1")
    assert other.status_code == 422 and other.json()["code"] == "idempotency_mismatch"
    assert f"run {b_run}" in other.json()["detail"] and f"run {a_run}" not in other.json()["detail"]
    # The tools saw two keys, not one.
    sent = {call["idempotency_key"] for call in call_list(tenant=acme(), tool="crm.update_ticket")["results"]}
    sent |= {call["idempotency_key"] for call in call_list(tenant=acme(), tool="hr.create_user")["results"]}
    assert len(sent) == 2


def test_a_key_taken_first_by_another_agent_takes_nothing(http_tools):
    a, b = two_agents(http_tools)
    a_run, b_run = open_run(a), open_run(b)
    squat = propose(b, b_run, "hr.create_user", USER, "order-42")
    assert squat.status_code == 201, squat.text
    mine = propose(a, a_run, "crm.update_ticket", TICKET, "order-42")
    assert mine.status_code == 201 and mine.json()["status"] == "succeeded", mine.text
    assert Action.objects.get(pk=mine.json()["id"]).run_id == a_run


def test_a_key_recorded_before_keys_were_scoped_still_answers_its_agent_only(http_tools):
    a, b = two_agents(http_tools)
    a_run, b_run = open_run(a), open_run(b)
    first = propose(a, a_run, "hr.create_user", USER, "before-0015")
    assert first.status_code == 201, first.text
    action = Action.objects.get(pk=first.json()["id"])
    with connection.cursor() as cursor:  # as migration 0015 left the rows recorded before it
        cursor.execute("UPDATE ledger_action SET key_agent = 0 WHERE id = %s", [action.pk])
    action.refresh_from_db()
    assert action.tool_key == Action(tenant_id=action.tenant_id, idempotency_key="before-0015").tool_key
    again = propose(a, a_run, "hr.create_user", USER, "before-0015")
    assert again.status_code == 200 and again.json()["id"] == action.pk, again.text
    # Its agent's key, in another run: refused as before (the fast path's insert alone would not see the old row).
    elsewhere = propose(a, open_run(a), "hr.create_user", USER, "before-0015")
    assert elsewhere.status_code == 422 and elsewhere.json()["code"] == "idempotency_mismatch", elsewhere.text
    theirs = propose(b, b_run, "hr.create_user", {"email": "b2@company.com", "name": "B"}, "before-0015")
    assert theirs.status_code == 201 and theirs.json()["id"] != action.pk, theirs.text
    assert len(world_state(tenant=acme())["users"]) == 2


def test_a_run_opening_key_is_the_agents_own(http_tools):
    a, b = two_agents(http_tools)

    def open_with(agent, key: str, goal: str):
        return agent.post(f"{agent.base}/api/v1/runs", json={"goal": goal, "on_behalf_of": "carol@example.com"},
                          headers={"Idempotency-Key": key}, timeout=30)

    mine = open_with(a, "open-1", "A's goal")
    assert mine.status_code == 201, mine.text
    theirs = open_with(b, "open-1", "B's goal")
    assert theirs.status_code == 201 and theirs.json()["id"] != mine.json()["id"], theirs.text
    assert f"run {mine.json()['id']}" not in theirs.text and "A's goal" not in theirs.text
    squat = open_with(b, "open-2", "B first")
    later = open_with(a, "open-2", "A later")
    assert squat.status_code == 201 and later.status_code == 201 and later.json()["goal"] == "A later", later.text
    replay = open_with(a, "open-1", "A's goal")
    assert replay.status_code == 200 and replay.json()["id"] == mine.json()["id"], replay.text
