"""Issue 14, finding 2: one effect per logical action, whatever key the agent sends.

Within a run, a proposal with the content (tool, target, canonical args, or the tool's key_fields) of a step that
succeeded answers as that step (200, `Idempotent-Replayed: true`, `Unwind-Matched-By: content`); of a step in
flight, 409 `in_flight` naming it. Only `repeat_of: <that step's id>` does the call again. Over real HTTP against
a live server, with a loopback HTTP tool that counts what it was sent.
"""
from __future__ import annotations

import threading

import pytest
import requests

from ledger.audit.chain import ledger_transaction
from ledger.models import Action, ActionStatus, AuditEvent
from ledger.engine.transitions import action_transition
from tests.conftest import needs_postgres
from tests.recorder import recorder  # noqa: F401 - the fixture
from tests.test_args_as_sent import agent, open_run, put_tool
from unwind_client import Unwind

ORDER = {"customer": "acme", "amount_cents": 4900}


@pytest.fixture
def rec(http_tools, recorder):  # noqa: F811 - the fixture imported above
    """`rec.charge` (all args identify the call) and `rec.order` (only `order_id` does) at the recorder."""
    for name, extra in (("rec.charge", {}), ("rec.order", {"idempotency": {"key_fields": ["order_id"]}})):
        put_tool(http_tools, name, {"endpoint": f"{recorder.origin}/{name}", "args_schema": {"type": "object"},
                                    "compensation": "none", "retry": {"max_attempts": 1}, **extra})
    http_tools.recorder = recorder
    return http_tools


def propose(world, run_id: int, args: dict, *, tool: str = "rec.charge", key: str | None = None,
            **body) -> requests.Response:
    client = agent(world)
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(f"{client.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args, **body},
                       headers=headers, timeout=30)


def assert_content_replay(answer: requests.Response, first: requests.Response) -> None:
    assert answer.status_code == 200, answer.text
    assert answer.headers["Idempotent-Replayed"] == "true" and answer.headers["Unwind-Matched-By"] == "content"
    body = answer.json()
    assert body["id"] == first.json()["id"] and body["matched_by"] == "content" and body["replayed"] is True
    assert body["status"] == "succeeded" and body["result"] == first.json()["result"]


@pytest.mark.parametrize("first_key, second_key", [("k1", None), ("k1", "k2"), (None, "k1")],
                         ids=["key-then-none", "key-then-new-key", "none-then-key"])
def test_the_same_call_under_another_key_runs_once(rec, first_key, second_key):
    run_id = open_run(rec)
    first = propose(rec, run_id, ORDER, key=first_key)
    assert first.status_code == 201 and first.json()["matched_by"] is None, first.text
    assert_content_replay(propose(rec, run_id, dict(reversed(ORDER.items())), key=second_key), first)
    assert len(rec.recorder.bodies) == 1
    assert Action.objects.filter(run_id=run_id).count() == 1


def test_a_replay_by_key_says_so(rec):
    run_id = open_run(rec)
    first = propose(rec, run_id, ORDER, key="k1")
    again = propose(rec, run_id, ORDER, key="k1")
    assert again.status_code == 200 and again.headers["Unwind-Matched-By"] == "key"
    assert again.json()["matched_by"] == "key" and again.json()["id"] == first.json()["id"]


def test_key_fields_decide_what_is_the_same_call(rec):
    run_id = open_run(rec)
    first = propose(rec, run_id, {"order_id": "o-1", "note": "first try"}, tool="rec.order", key="a")
    assert first.status_code == 201, first.text
    assert_content_replay(propose(rec, run_id, {"order_id": "o-1", "note": "reworded"}, tool="rec.order", key="b"),
                          first)
    other = propose(rec, run_id, {"order_id": "o-2", "note": "first try"}, tool="rec.order", key="c")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"], other.text
    assert len(rec.recorder.bodies) == 2


def test_another_target_or_tool_is_another_call(rec):
    # A target the agent names (and the tool's read finds) is part of what the call is.
    put_tool(rec, "rec.note", {"endpoint": f"{rec.recorder.origin}/rec.note", "args_schema": {"type": "object"},
                               "compensation": "none", "retry": {"max_attempts": 1},
                               "target": {"type": "ticket", "from": "agent"},
                               "snapshot": {"read": "/sandbox/crm/tickets/{target}", "fields": ["priority"]}})
    run_id = open_run(rec)
    assert propose(rec, run_id, ORDER, tool="rec.note", key="a", target="T-204").status_code == 201
    assert propose(rec, run_id, ORDER, tool="rec.note", key="b", target="T-311").status_code == 201
    assert propose(rec, run_id, {"order_id": "o-1"}, tool="rec.order").status_code == 201
    assert propose(rec, run_id, {"order_id": "o-1"}, tool="rec.charge").status_code == 201
    assert len(rec.recorder.bodies) == 4


def test_the_same_call_in_another_run_is_another_call(rec):
    first, second = open_run(rec), open_run(rec)
    assert propose(rec, first, ORDER).status_code == 201
    assert propose(rec, second, ORDER).status_code == 201
    assert len(rec.recorder.bodies) == 2


@pytest.mark.parametrize("spec, waiting", [
    ({"executor": "client"}, "running"),
    ({"endpoint": "/rec.gated", "approval": "manual"}, "awaiting_approval"),
], ids=["awaiting-report", "awaiting-approval"])
def test_the_same_call_while_the_first_is_in_flight_is_refused(rec, spec, waiting):
    if "endpoint" in spec:
        spec = {**spec, "endpoint": rec.recorder.origin + spec["endpoint"]}
    put_tool(rec, "rec.slow", {"args_schema": {"type": "object"}, "compensation": "none", **spec})
    run_id = open_run(rec)
    first = propose(rec, run_id, ORDER, tool="rec.slow", key="k1")
    assert first.status_code == 202 and first.json()["status"] == waiting, first.text
    for key in ("k2", None):
        refused = propose(rec, run_id, ORDER, tool="rec.slow", key=key)
        assert refused.status_code == 409, refused.text
        problem = refused.json()
        assert problem["code"] == "in_flight" and problem["action_id"] == first.json()["id"], problem
        assert problem["matched_by"] == "content" and "repeat_of" in problem["detail"]
    assert Action.objects.filter(run_id=run_id).count() == 1 and rec.recorder.bodies == []


def test_a_step_that_did_nothing_does_not_match(rec):
    """A failed step (as a tool's refusal leaves it, the run still open) may be tried again under a new key."""
    put_tool(rec, "rec.local", {"executor": "client", "args_schema": {"type": "object"}, "compensation": "none"})
    run_id = open_run(rec)
    first = propose(rec, run_id, ORDER, tool="rec.local", key="k1")
    action = Action.objects.select_related("tool").get(pk=first.json()["id"])
    with ledger_transaction(action.tenant_id) as audit:
        action_transition(action, ActionStatus.FAILED, log=audit, actor="test:refused-by-the-tool")
    again = propose(rec, run_id, ORDER, tool="rec.local", key="k2")
    assert again.status_code == 202 and again.json()["id"] != action.pk, again.text


def test_repeat_of_does_the_call_again_and_is_recorded(rec):
    run_id = open_run(rec)
    first = propose(rec, run_id, ORDER, key="k1")
    first_id = first.json()["id"]
    repeat = propose(rec, run_id, ORDER, repeat_of=first_id)
    assert repeat.status_code == 201, repeat.text
    assert repeat.json()["repeat_of"] == first_id and repeat.json()["id"] != first_id
    assert len(rec.recorder.bodies) == 2
    event = AuditEvent.objects.get(kind="forward.proposed", action_ref=repeat.json()["id"])
    assert event.data["repeat_of"] == first_id
    assert "repeat_of" not in AuditEvent.objects.get(kind="forward.proposed", action_ref=first_id).data
    # A retry of the repeat (its answer lost) is the repeat again, not a third call.
    retried = propose(rec, run_id, ORDER, repeat_of=first_id)
    assert retried.status_code == 200 and retried.json()["id"] == repeat.json()["id"], retried.text
    assert len(rec.recorder.bodies) == 2
    # The first call's own key names the first call, not a repeat of it.
    reused = propose(rec, run_id, ORDER, key="k1", repeat_of=first_id)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_mismatch", reused.text
    # Without repeat_of, the content now matches the newest of the two.
    assert propose(rec, run_id, ORDER, key="k9").json()["id"] == repeat.json()["id"]


def test_repeat_of_a_step_that_does_not_match_is_refused_and_nothing_runs(rec, tools_of_globex):
    run_id, other_run = open_run(rec), open_run(rec)
    first = propose(rec, run_id, ORDER, key="k1").json()["id"]
    elsewhere = propose(rec, other_run, ORDER, key="k2").json()["id"]
    different = propose(rec, run_id, {**ORDER, "amount_cents": 1}, key="k3").json()["id"]
    refused_before = len(rec.recorder.bodies), Action.objects.count()
    for wrong, why in [(elsewhere, "not a step of run"), (different, "differs"), (10**9, "not a step of run"),
                       (tools_of_globex, "not a step of run")]:
        answer = propose(rec, run_id, ORDER, key=f"repeat-{wrong}", repeat_of=wrong)
        assert answer.status_code == 409, answer.text
        assert answer.json()["code"] == "repeat_of_mismatch" and why in answer.json()["detail"], answer.json()
        assert answer.json()["repeat_of"] == wrong
    # A read-only call never matches by content, so it repeats nothing.
    put_tool(rec, "rec.read", {"endpoint": f"{rec.recorder.origin}/read", "action_class": "read_only",
                               "args_schema": {"type": "object"}, "compensation": "none"})
    read = propose(rec, run_id, ORDER, tool="rec.read", repeat_of=first)
    assert read.status_code == 409 and read.json()["code"] == "repeat_of_mismatch", read.text
    for bad in ("1", True, 0, -3):
        assert propose(rec, run_id, ORDER, repeat_of=bad).json()["code"] == "validation_error"
    assert (len(rec.recorder.bodies), Action.objects.count()) == refused_before


@pytest.fixture
def tools_of_globex(rec):
    """The id of an action in another tenant's run (globex's agent, its own tool)."""
    from ledger.engine.proposal import action_propose
    from ledger.engine.runs import run_open
    from ledger.policy.versions import tools_load

    tools_load(tenant=rec.globex, document={"tools": {"g.note": {"executor": "client", "compensation": "none"}}},
               actor="test")
    run = run_open(tenant=rec.globex, agent=rec.other_agent, goal="theirs", actor="agent:intruder")
    return action_propose(run=run, tool_name="g.note", args=ORDER, actor="agent:intruder").action.pk


def test_reading_again_is_not_matched(rec):
    put_tool(rec, "rec.read", {"endpoint": f"{rec.recorder.origin}/read", "action_class": "read_only",
                               "args_schema": {"type": "object"}, "compensation": "none"})
    run_id = open_run(rec)
    assert propose(rec, run_id, ORDER, tool="rec.read", key="r1").status_code == 201
    assert propose(rec, run_id, ORDER, tool="rec.read", key="r2").status_code == 201
    assert len(rec.recorder.received("/read")) == 2


@needs_postgres
def test_concurrent_proposals_with_different_keys_run_the_tool_once(rec):
    rec.recorder.delay = 0.3  # hold the first call in flight while the others arrive
    run_id = open_run(rec)
    start = threading.Barrier(6)
    answers: list[requests.Response] = []

    def send(index: int) -> None:
        start.wait()
        answers.append(propose(rec, run_id, ORDER, key=f"concurrent-{index}"))

    threads = [threading.Thread(target=send, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == 6
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses.count(201) == 1, [(a.status_code, a.text[:200]) for a in answers]
    winner = next(a for a in answers if a.status_code == 201).json()["id"]
    for answer in answers:
        if answer.status_code == 409:
            assert answer.json()["code"] == "in_flight" and answer.json()["action_id"] == winner
        elif answer.status_code == 200:
            assert answer.json()["id"] == winner and answer.json()["matched_by"] == "content"
    assert len(rec.recorder.bodies) == 1
    assert Action.objects.filter(run_id=run_id).count() == 1


def test_the_client_gets_the_first_result_and_repeats_only_when_told(rec):
    unwind = Unwind(rec.live_server.url, rec.key)
    with unwind.run(goal="client") as run:
        first = run.act("rec.charge", ORDER, idempotency_key="c1")
        assert run.act("rec.charge", ORDER, idempotency_key="c2") == first  # answered by the first step
        first_id = run.refresh().data["actions"][0]["id"]
        repeated = run.act("rec.charge", ORDER, repeat_of=first_id)
    assert first == {"ok": True, "n": 1} and repeated == {"ok": True, "n": 2}
    assert len(rec.recorder.bodies) == 2
