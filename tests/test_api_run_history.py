"""Agents read their own runs' attempts and audit events (issue 14, finding 4.4), over HTTP on a live server.

`GET /api/v1/runs/{id}/attempts` and `…/events` are scoped exactly like the run: the agent that opened it and
people with a role in its tenant read them; another agent of the same tenant, another tenant's agent or person,
and a deploy key do not, and what they get changes nothing. Nothing that widens power is shown: no keys, no
chain hashes, no row fingerprints.
"""
import json

import pytest
import yaml

from ledger.models import AuditEvent
from ledger.tenancy import agent_create, deploy_key_create
from tests.api_support import basic
from tests.wire_support import tool_service, wired  # noqa: F401 - fixtures


@pytest.fixture
def history(wired, tool_service):
    """A run of acme's agent: a booking that succeeds, a payment that fails twice with 503 (its retry
    budget), and the booking's undo."""
    loaded = wired.load({"tools": {
        "shop.book": {"executor": {"kind": "http", "url": tool_service.answer("/book", {"id": "B1"})},
                      "approval": "auto",
                      "compensation": {"strategy": "twin", "tool": "shop.cancel", "args": {"id": "$result.id"}}},
        "shop.cancel": {"executor": {"kind": "http", "url": tool_service.answer("/cancel", {})}, "approval": "auto"},
        "shop.pay": {"executor": {"kind": "http", "url": tool_service.answer("/pay", {"detail": "busy"}, status=503)},
                     "approval": "auto", "retry": {"max_attempts": 2, "backoff": 0}},
    }})
    assert loaded.status_code == 200, loaded.text
    run = wired.open_run()
    assert wired.propose(run["id"], "shop.book", {"n": 1}).json()["status"] == "succeeded"
    assert wired.propose(run["id"], "shop.pay", {"n": 1}).json()["status"] == "failed"
    assert wired.run(run["id"])["status"] == "compensated"
    wired.run_id = run["id"]
    return wired


def get(wired, client, what: str, **params):
    return client.get(f"{wired.base}/api/v1/runs/{wired.run_id}/{what}", params=params, timeout=10)


def test_the_agent_reads_every_attempt_of_its_run_oldest_first(history):
    answer = get(history, history.agent, "attempts")
    assert answer.status_code == 200, answer.text
    attempts = answer.json()["results"]
    assert [(a["tool"], a["kind"], a["number"], a["outcome"]) for a in attempts] == [
        ("shop.book", "forward", 1, "succeeded"),
        ("shop.pay", "forward", 1, "failed_transient"), ("shop.pay", "forward", 2, "failed_transient"),
        ("shop.cancel", "compensation", 1, "succeeded"),
    ]
    failed = attempts[1]
    assert failed["error_class"] == "http_503" and "answered 503: busy" in failed["error_message"]
    assert failed["latency_ms"] > 0 and failed["started_at"] <= failed["finished_at"]
    assert set(failed) == {"id", "action", "seq", "kind", "tool", "number", "outcome", "error_class",
                           "error_message", "latency_ms", "started_at", "finished_at"}


def test_the_agent_reads_its_runs_events_without_hashes_or_fingerprints(history):
    answer = get(history, history.agent, "events", limit=200)
    assert answer.status_code == 200, answer.text
    events = answer.json()["results"]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run.opened" and "forward.proposed" in kinds and "compensation.proposed" in kinds
    assert "run.compensated" in kinds
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    stored = AuditEvent.objects.filter(run_ref=history.run_id)
    assert len(events) == stored.count()
    assert events[0]["actor"] == "agent:booker" and events[0]["data"]["goal"] == "wire"
    shown = json.dumps(events)
    for event in stored:
        assert event.hash not in shown and event.prev_hash not in shown
        for secret in ("action_state", "run_state", "rows"):
            if secret in event.data:
                assert json.dumps(event.data[secret]) not in shown
    assert history.world.key not in shown
    assert all(set(e) == {"seq", "kind", "actor", "action", "data", "created_at"} for e in events)
    assert not any({"action_state", "run_state", "rows"} & set(e["data"]) for e in events)


def test_pages_follow_next_without_gaps_or_repeats(history):
    every = get(history, history.agent, "events", limit=200).json()["results"]
    seen, url = [], f"{history.base}/api/v1/runs/{history.run_id}/events?limit=3"
    while url:
        page = history.agent.get(url, timeout=10).json()
        assert len(page["results"]) <= 3
        seen += page["results"]
        url = page["next"]
    assert seen == every and len(every) > 3

    first = get(history, history.agent, "attempts", limit=2).json()
    rest = history.agent.get(first["next"], timeout=10).json()
    assert [a["number"] for a in first["results"] + rest["results"]] == [1, 1, 2, 1] and rest["next"] is None


def test_a_bad_cursor_is_a_problem_not_a_500(history):
    answer = get(history, history.agent, "events", cursor="cD0xJTNCK0RST1A=")
    assert answer.status_code == 400 and answer.json()["code"] == "validation_error"


def test_people_of_the_tenant_read_them_too(history):
    viewer = history.session(basic("victor"))
    assert get(history, viewer, "attempts").status_code == 200
    assert len(get(history, viewer, "events", limit=200).json()["results"]) > 3


@pytest.mark.parametrize("what", ["attempts", "events"])
def test_another_agent_another_tenant_and_strangers_get_404(history, what):
    _, colleague_key = agent_create(tenant=history.world.acme, name="colleague")
    outsiders = {
        "another agent of acme": history.session(f"Bearer {colleague_key}"),
        "globex's agent": history.session(f"Bearer {history.world.other_key}"),
        "globex's admin": history.session(basic("mallory")),
    }
    before = AuditEvent.objects.count()
    for who, client in outsiders.items():
        answer = get(history, client, what)
        assert answer.status_code == 404, (who, answer.text)
        assert answer.json()["code"] == "not_found" and "result" not in answer.text
    missing = history.agent.get(f"{history.base}/api/v1/runs/999999/{what}", timeout=10)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    assert AuditEvent.objects.count() == before and history.run(history.run_id)["status"] == "compensated"


@pytest.mark.parametrize("what", ["attempts", "events"])
def test_a_deploy_key_and_anonymous_callers_are_refused(history, what):
    _, token = deploy_key_create(tenant=history.world.acme, name="ci")
    answer = get(history, history.session(f"Bearer {token}"), what)
    assert answer.status_code == 403 and answer.json()["code"] == "deploy_key_cannot_act"
    anonymous = history.session("")
    del anonymous.headers["Authorization"]
    assert get(history, anonymous, what).status_code == 401


def test_both_are_in_the_openapi_schema(history):
    schema = yaml.safe_load(history.agent.get(f"{history.base}/api/schema/", timeout=30).text)
    for what, item in (("attempts", "AttemptOut"), ("events", "EventOut")):
        operation = schema["paths"][f"/api/v1/runs/{{run_id}}/{what}"]["get"]
        assert operation["operationId"] == f"runs_{what}"
        assert {p["name"] for p in operation["parameters"]} >= {"cursor", "limit"}
        assert item in json.dumps(operation["responses"]["200"])
