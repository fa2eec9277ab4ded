"""No malformed input of any kind produces a 500: every refusal is a problem+json with a stable code."""
import base64

import pytest

from approvals.models import ApprovalRequest
from ledger.models import Tenant
from ledger.engine.proposal import action_propose
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from tests.api_support import assert_problem
from tests.helpers import act, fault, open_run

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

JSON = "application/json"
BODIES = [
    (b"[1, 2, 3]", JSON),
    (b'"a string"', JSON),
    (b"12345", JSON),
    (b"null", JSON),
    (b"true", JSON),
    (b"{", JSON),
    (b"", JSON),
    (b'{"a": NaN}', JSON),
    (b'{"a": Infinity}', JSON),
    (b'{"a": 1e400}', JSON),
    (b'{"a": 123456789012345678901234567890}', JSON),
    (b'{"a": ' + b"9" * 5000 + b"}", JSON),
    (b'{"goal": "a\\u0000b", "reason": "a\\u0000b", "tool": "a\\u0000b"}', JSON),
    (b'{"goal": "\\ud800", "reason": "\\udfff"}', JSON),
    (b'{"\\u0000": 1}', JSON),
    (b"[" * 50000 + b"]" * 50000, JSON),
    (b'{"a":' * 100 + b"1" + b"}" * 100, JSON),
    (b"\xff\xfe\xfa", JSON),
    (b'{"goal": "caf\xe9"}', JSON),
    (b'{"ok": true}', "application/json; charset=bogus"),
    (b'{"ok": true}', ""),
    (b"ok=true&reason=x", "application/x-www-form-urlencoded"),
    (b"plain words", "text/plain"),
    (b'<?xml version="1.0"?><a/>', "application/xml"),
    (b'{"tool": 5, "args": "x", "intent": [], "target": {}, "plan": 7, "reason": 9, "ok": "maybe"}', JSON),
    (b'{"tool": "hr.create_user", "args": {"email": 1}, "intent": {"confidence": 1e308}}', JSON),
    (b'{"tool": "hr.create_user", "args": {}, "intent": {"confidence": "high", "mood": "good"}}', JSON),
    (b'{"unknown_field": 1, "another": {"deep": [1, 2]}}', JSON),
    (b'{"tools": {"x": {"executor": {"kind": 5}}}, "defaults": []}', JSON),
    (b'{"tools": [], "agentSafety": "yes"}', JSON),
    (b'{"agentSafety": {"policies": {"t": {"timeout": "forever", "retry": {"max_attempts": 1e300}}}}}', JSON),
]


@pytest.fixture
def targets(api_db):
    """One of every object a POST or PUT can address: a run, a client action, a pending approval, an open item."""
    world = api_db.world
    tool_upsert(tenant=world.acme, name="chat.post", spec={"executor": "client", "timeout": 60}, actor="test")
    run = open_run(world)
    client_action = action_propose(run=run, tool_name="chat.post", args={"text": "hi"}, actor="agent:booker").action
    gated = action_propose(run=open_run(world), tool_name="payments.charge", args={"customer": "c", "amount_cents": 1},
                           actor="agent:booker").action
    Tenant.objects.filter(pk=world.acme.pk).update(approval_threshold="critical")
    stuck = open_run(world)
    act(stuck, "payments.charge", {"customer": "c", "amount_cents": 1})
    fault("email.send", "status", status=400, times=0)
    act(stuck, "email.send", {"to": "a@b.io", "subject": "s", "body": "b"})
    item = RecoveryItem.objects.get(run=stuck, status="open")
    request = ApprovalRequest.objects.get(action=gated)
    return {
        "agent": [("POST", "/api/v1/runs"), ("POST", f"/api/v1/runs/{run.pk}/actions"),
                  ("POST", f"/api/v1/runs/{run.pk}/cancel"), ("POST", f"/api/v1/actions/{client_action.pk}/report"),
                  ("PUT", "/api/v1/tools/chat.new"), ("POST", "/api/v1/policy")],
        "alice": [("POST", f"/api/v1/approvals/{request.pk}/approve"), ("POST", f"/api/v1/approvals/{request.pk}/reject")],
        "oscar": [("POST", f"/api/v1/recovery-items/{item.pk}/{operation}") for operation in ("resume", "compensate", "close")],
    }


def test_malformed_bodies_are_refused_with_a_problem_never_a_500(api_db, targets, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1_000_000
    clients = {"agent": api_db.agent, "alice": api_db.person("alice"), "oscar": api_db.person("oscar")}
    seen = set()
    for who, endpoints in targets.items():
        for method, path in endpoints:
            for body, content_type in BODIES:
                response = clients[who].generic(method, path, body, content_type=content_type)
                assert response.status_code < 500, (method, path, body[:60], content_type, response.content[:300])
                if response.status_code >= 400:  # an empty body is a valid "no options" request on some endpoints
                    assert response["Content-Type"].startswith("application/problem+json"), (path, body[:60])
                    seen.add(response.json()["code"])
    assert {"validation_error", "parse_error", "unsupported_media_type"} <= seen


def test_a_body_over_the_upload_limit_is_413(api_db, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = b'{"goal": "' + b"x" * 2000 + b'"}'
    assert_problem(api_db.agent.generic("POST", "/api/v1/runs", body, content_type=JSON), 413, "payload_too_large")


def test_parse_errors_and_validation_errors_say_where(api_db):
    broken = assert_problem(api_db.agent.generic("POST", "/api/v1/runs", b'{"goal": ', content_type=JSON), 400,
                            "parse_error")
    assert "not valid JSON" in broken["detail"]
    nul = assert_problem(api_db.agent.generic("POST", "/api/v1/runs", b'{"goal": "\\u0000"}', content_type=JSON), 400,
                         "parse_error")
    assert "body.goal" in nul["detail"]
    wrong = assert_problem(api_db.agent.post("/api/v1/runs", [1], format="json"), 400, "validation_error")
    assert wrong["field"] is None and wrong["errors"][0]["message"]
    many = assert_problem(api_db.agent.post("/api/v1/runs", {"plan": 1, "goal": [], "extra": 1}, format="json"), 400,
                          "validation_error")
    assert {error["field"] for error in many["errors"]} == {"plan", "goal", "extra"}


@pytest.mark.parametrize("path", [
    "/api/v1/runs/99999999999999999999999999", "/api/v1/actions/-1", "/api/v1/actions/1.5/wait",
    "/api/v1/tools/a%0Ab",
])
def test_odd_paths_are_404(api_db, path):
    assert api_db.agent.get(path).status_code == 404


@pytest.mark.parametrize("path", ["/api/v1/runs/%00", "/api/v1/tools/%00"])
def test_a_nul_in_the_path_is_400(api_db, path):
    assert assert_problem(api_db.agent.get(path), 400, "validation_error")["field"] == "path"


@pytest.mark.parametrize("query", [
    {"timeout": "nan"}, {"timeout": "1e999"}, {"timeout": "-1"}, {"timeout": "\x00"},
])
def test_odd_wait_timeouts_are_400(api_db, query):
    run = open_run(api_db.world)
    action = action_propose(run=run, tool_name="payments.charge", args={"customer": "c", "amount_cents": 1},
                            actor="agent:booker").action
    assert_problem(api_db.agent.get(f"/api/v1/actions/{action.pk}/wait", query), 400, "validation_error")


@pytest.mark.parametrize("path, query", [
    ("/api/v1/runs", {"status": "\x00"}), ("/api/v1/runs", {"agent": "a\x00b"}), ("/api/v1/runs", {"since": "\x00"}),
    ("/api/v1/runs", {"since": "9999999-01-01"}),
    ("/api/v1/compensations/pending", {"run": "99999999999999999999999"}),
    ("/api/v1/compensations/pending", {"run": "x"}),
])
def test_odd_query_parameters_are_400(api_db, path, query):
    assert_problem(api_db.agent.get(path, query), 400, "validation_error")


def test_odd_people_query_parameters_are_400(api_db):
    alice = api_db.person("alice")
    for path, query in [("/api/v1/approvals", {"status": "maybe"}), ("/api/v1/approvals", {"run": "0"}),
                        ("/api/v1/approvals", {"tenant": "\x00"}), ("/api/v1/tools", {"tenant": "a\x00"}),
                        ("/api/v1/recovery-items", {"reason": "boredom"}),
                        ("/api/v1/recovery-items", {"run": "1" * 30})]:
        assert_problem(alice.get(path, query), 400, "validation_error")


def test_cursor_garbage_and_odd_limits_do_not_break_pages(api_db):
    open_run(api_db.world)
    for cursor in ("\x00", "!!!", base64.b64encode(b"p=abc").decode(), base64.b64encode(b"p=1&o=x").decode(),
                   base64.b64encode(b"p=" + b"9" * 40).decode(), base64.b64encode(b"r=2&p=1").decode()):
        response = api_db.agent.get("/api/v1/runs", {"cursor": cursor})
        assert response.status_code in (200, 400), (cursor, response.content[:300])
    for limit in ("-5", "0", "99999999999999999999", "many"):
        assert api_db.agent.get("/api/v1/runs", {"limit": limit}).status_code == 200


def test_method_not_allowed_is_405_with_allow(api_db):
    response = api_db.agent.delete("/api/v1/runs")
    assert_problem(response, 405, "method_not_allowed")
    assert set(response["Allow"].replace(" ", "").split(",")) >= {"GET", "POST"}


def test_an_unsupported_accept_is_406(api_db):
    response = api_db.agent.get("/api/v1/runs", HTTP_ACCEPT="application/xml")
    assert response.status_code == 406 and response.json()["code"] == "not_acceptable"


def test_odd_idempotency_keys_are_400(api_db):
    run = open_run(api_db.world)
    for key in ("", "   ", "k" * 256, "tab\there", "nul\x00"):
        response = api_db.agent.post(f"/api/v1/runs/{run.pk}/actions", {"tool": "payments.charge",
                                     "args": {"customer": "c", "amount_cents": 1}}, format="json",
                                     HTTP_IDEMPOTENCY_KEY=key)
        assert assert_problem(response, 400, "validation_error")["field"] == "Idempotency-Key", key
