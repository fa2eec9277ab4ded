"""Issue 14, finding 1: a tool receives the arguments exactly as the agent sent them.

The canonical form (integral floats as ints, NFC text) is only for the hash and for telling two calls apart; the
tool gets `500.0`, `1e2`, `0.10`, 12345678901234567890123 and a decomposed "Zoë" as written. Everything runs over
real HTTP: the agent talks to a live Unwind, which calls a loopback HTTP tool that keeps the raw bytes it got.
"""
from __future__ import annotations

import json
from decimal import Decimal

import pytest
import requests
from django.db import connection

from ledger.policy import registry
from ledger.audit.verify import verify_chain
from ledger.models import Action
from ledger.db.received import LiteralFloat, LiteralInt, dumps, loads
from tests.recorder import recorder  # noqa: F401 - the fixture
from unwind_client import Unwind

DECOMPOSED = "Zoe\u0308"  # e + COMBINING DIAERESIS: NFC would make it "Zo\u00eb"
# The args as the agent writes them: key order, number literals and code points are all part of what it said.
ARGS_TEXT = ('{"amount":500.0,"count":1e2,"big":12345678901234567890123,"price":0.10,"name":"' + DECOMPOSED
             + '","tags":[-0,2.50E+1]}')
SCHEMA = {"type": "object", "properties": {
    "amount": {"type": "number"}, "count": {"type": "integer"}, "big": {"type": "integer"},
    "price": {"type": "number"}, "name": {"type": "string"}, "tags": {"type": "array"}}}


CALLED_IN_PROCESS: list[dict] = []


@registry.tool("tests.args_as_sent")
def args_as_sent(args: dict, *, idempotency_key: str, target: str | None, tenant: str) -> dict:
    CALLED_IN_PROCESS.append(args)
    return {"ok": True}


def agent(world) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    session.base = world.live_server.url
    return session


def admin(world) -> requests.Session:
    session = requests.Session()
    session.auth = ("ada", "pw-ada")
    session.base = world.live_server.url
    return session


def put_tool(world, name: str, spec: dict) -> None:
    people = admin(world)
    answer = people.put(f"{people.base}/api/v1/tools/{name}", json=spec, timeout=30)
    assert answer.status_code in (200, 201), answer.text


def open_run(world) -> int:
    client = agent(world)
    answer = client.post(f"{client.base}/api/v1/runs", json={"goal": "as sent", "on_behalf_of": "carol@example.com"},
                         timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def propose_raw(world, run_id: int, args_text: str, *, tool: str = "rec.send", key: str | None = None,
                extra: str = "") -> requests.Response:
    """POST a proposal whose args are exactly `args_text` (bytes on the wire, not a re-serialised dict)."""
    client = agent(world)
    body = f'{{"tool":"{tool}","args":{args_text}{extra}}}'.encode()
    headers = {"Content-Type": "application/json", **({"Idempotency-Key": key} if key else {})}
    return client.post(f"{client.base}/api/v1/runs/{run_id}/actions", data=body, headers=headers, timeout=30)


@pytest.fixture
def rec(http_tools, recorder):  # noqa: F811 - the fixture imported above
    """`rec.send`: an HTTP tool at the recorder, and `rec.undo` (its twin) that undoes it, also at the recorder."""
    put_tool(http_tools, "rec.undo", {"endpoint": f"{recorder.origin}/undo", "args_schema": {"type": "object"},
                                      "compensation": "none", "retry": {"max_attempts": 1}})
    put_tool(http_tools, "rec.send", {
        "endpoint": f"{recorder.origin}/send", "args_schema": SCHEMA, "retry": {"max_attempts": 1},
        "compensation": {"strategy": "twin", "tool": "rec.undo", "args": {
            "amount": "$args.amount", "count": "$args.count", "big": "$args.big", "name": "$args.name",
            "label": {"$concat": ["undo-", "$args.count", "-", "$args.price"]}}}})
    http_tools.recorder = recorder
    return http_tools


def test_the_tool_receives_the_args_byte_for_byte(rec):
    run_id = open_run(rec)
    answer = propose_raw(rec, run_id, ARGS_TEXT, key="as-sent-1")
    assert answer.status_code == 201 and answer.json()["status"] == "succeeded", answer.text
    assert rec.recorder.received("/send") == [ARGS_TEXT.encode()]
    # The ledger still hashes and shows the canonical form.
    action = Action.objects.get(pk=answer.json()["id"])
    assert action.args["amount"] == 500 and type(action.args["amount"]) is int
    assert action.args["name"] == "Zo\u00eb" and action.args_text == ARGS_TEXT


def test_a_reordered_renormalised_duplicate_replays_and_sends_nothing(rec):
    run_id = open_run(rec)
    first = propose_raw(rec, run_id, ARGS_TEXT, key="dup-1")
    assert first.status_code == 201, first.text
    same = '{"tags":[0,25],"name":"Zo\\u00eb","price":0.1,"big":12345678901234567890123,"count":100,"amount":500}'
    for key in ("dup-1", None):  # the same key; and no key at all (then it matches by content)
        again = propose_raw(rec, run_id, same, key=key)
        assert again.status_code == 200, again.text
        assert again.headers["Idempotent-Replayed"] == "true" and again.json()["id"] == first.json()["id"]
    assert rec.recorder.received("/send") == [ARGS_TEXT.encode()]


def test_schema_still_sees_literal_numbers_as_numbers(rec):
    run_id = open_run(rec)
    wrong = propose_raw(rec, run_id, '{"count":1.5,"amount":"500.0"}')
    assert wrong.status_code == 400 and wrong.json()["code"] == "validation_error", wrong.text
    assert {e["field"] for e in wrong.json()["errors"]} == {"args.count", "args.amount"}
    assert rec.recorder.bodies == [] and not Action.objects.filter(run_id=run_id).exists()
    # 1e2 and 2.0 are integers in JSON Schema (a number with a zero fraction), and still reach the tool as written.
    right = propose_raw(rec, run_id, '{"count":2.0,"big":1e2}')
    assert right.status_code == 201, right.text
    assert rec.recorder.received("/send") == [b'{"count":2.0,"big":1e2}']


def test_the_compensation_gets_args_values_as_written(rec):
    run_id = open_run(rec)
    assert propose_raw(rec, run_id, ARGS_TEXT).status_code == 201
    client = agent(rec)
    cancelled = client.post(f"{client.base}/api/v1/runs/{run_id}/cancel", json={"reason": "undo it"}, timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    [undo] = rec.recorder.received("/undo")
    # Key order of a policy template is the database's business (jsonb sorts keys); the values are the agent's.
    assert json.loads(undo, parse_float=str, parse_int=str) == {
        "amount": "500.0", "count": "1e2", "big": "12345678901234567890123", "name": DECOMPOSED,
        "label": "undo-1e2-0.10"}
    for literal in (b":500.0", b":1e2", b":12345678901234567890123", DECOMPOSED.encode()):
        assert literal in undo, (literal, undo)


def test_big_integers_are_accepted_only_where_they_are_forwarded(rec):
    client = agent(rec)
    refused = client.post(f"{client.base}/api/v1/runs", data=b'{"goal": "g", "intent": {"n": 12345678901234567890123}}',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["code"] == "parse_error", refused.text
    assert "64 bits" in refused.json()["detail"]


def test_the_python_client_sends_numbers_as_written(rec):
    unwind = Unwind(rec.live_server.url, rec.key)
    with unwind.run(goal="client") as run:
        run.act("rec.send", {"amount": 500.0, "price": Decimal("0.10"), "big": 12345678901234567890123,
                             "name": DECOMPOSED}, idempotency_key="client-1")
    assert rec.recorder.received("/send") == [
        ('{"amount":500.0,"price":0.10,"big":12345678901234567890123,"name":"' + DECOMPOSED + '"}').encode()]


def test_a_client_executed_tool_runs_with_the_args_the_agent_passed(rec):
    put_tool(rec, "rec.local", {"executor": "client", "args_schema": {"type": "object"}, "compensation": "none"})
    seen = []

    def execute(args):
        seen.append(args)
        return {"done": True}

    unwind = Unwind(rec.live_server.url, rec.key)
    with unwind.run(goal="client tool") as run:
        assert run.act("rec.local", {"amount": 500.0, "name": DECOMPOSED}, execute=execute) == {"done": True}
    assert seen == [{"amount": 500.0, "name": DECOMPOSED}]
    assert type(seen[0]["amount"]) is float and seen[0]["name"] == DECOMPOSED


def test_literal_numbers_round_trip_and_compare_as_numbers():
    document = loads('{"a":500.0,"b":1e2,"c":-0,"d":[0.10,12345678901234567890123]}')
    assert dumps(document) == '{"a":500.0,"b":1e2,"c":-0,"d":[0.10,12345678901234567890123]}'
    assert isinstance(document["b"], LiteralFloat) and document["b"] == 100 and isinstance(document["c"], LiteralInt)
    assert dumps({"d": Decimal("0.10"), "f": 500.0, "t": "Zoe\u0308"}) == '{"d":0.10,"f":500.0,"t":"Zoe\u0308"}'
    with pytest.raises(ValueError):
        dumps({"nan": float("nan")})


@pytest.mark.parametrize("column, value", [
    ("args_text", ARGS_TEXT.replace(DECOMPOSED, "Zo\u00eb")),  # only its Unicode form: the canonical hash still matches
    ("content_key", "0" * 64),  # let a duplicate of it through
])
def test_editing_what_the_tool_would_receive_breaks_the_audit_chain(rec, column, value):
    """Someone with database access rewrites the text a retry or an undo would send, or what later calls are
    matched on: `args` and its hash are untouched, but the audit chain's fingerprint of the action breaks."""
    run_id = open_run(rec)
    action_id = propose_raw(rec, run_id, ARGS_TEXT, key="audited").json()["id"]
    assert verify_chain(rec.acme.pk).ok
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE ledger_action SET {column} = %s WHERE id = %s", [value, action_id])
    report = verify_chain(rec.acme.pk)
    assert not report.ok and report.check == "fingerprint" and f"action {action_id}" in report.problem


def test_an_in_process_tool_gets_the_numbers_and_text_as_written(rec):
    put_tool(rec, "rec.inproc", {"executor": {"kind": "python", "path": "tests.args_as_sent"}, "args_schema": SCHEMA,
                                 "compensation": "none"})
    CALLED_IN_PROCESS.clear()
    assert propose_raw(rec, open_run(rec), ARGS_TEXT, tool="rec.inproc").status_code == 201
    [args] = CALLED_IN_PROCESS
    assert args == {"amount": 500.0, "count": 100.0, "big": 12345678901234567890123, "price": 0.1,
                    "name": DECOMPOSED, "tags": [0, 25.0]}
    assert type(args["amount"]) is not int and isinstance(args["amount"], float) and args["amount"].literal == "500.0"
    assert args["count"].literal == "1e2" and args["price"].literal == "0.10" and args["name"] == DECOMPOSED
