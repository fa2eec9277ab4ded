"""Security: API keys never in clear (database, logs, errors), CSRF on every form, roles enforced, and tampering
with the audit chain or the ledger behind it reported by `manage.py verify_audit` (the command, end to end)."""
import io
import logging
import re
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from approvals.models import ApprovalRequest
from ledger.models import Action, Agent, AuditEvent, Run
from ledger.tenancy import agent_revoke
from recovery.models import RecoveryItem
from tests.api_support import basic
from tests.helpers import act, fault, open_run
from tests.test_g05_crash_safety import ROOT, database_url


@pytest.fixture
def gated(tools):
    """acme with a charge waiting for approval and a run in the recovery queue."""
    run = open_run(tools)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2027-01-01"})
    act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    stuck = open_run(tools)
    act(stuck, "hr.create_user", {"email": "a@x.io", "name": "A"})
    fault("hr.delete_user", "status", status=400)
    fault("email.send", "status", status=400)
    act(stuck, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    tools.approval = ApprovalRequest.objects.get(run=run)
    tools.item = RecoveryItem.objects.get(run=stuck)
    return tools


# --- API keys ----------------------------------------------------------------------------------------------

@pytest.fixture
def every_log(caplog):
    """Capture every logger at DEBUG, including `unwind`, which does not propagate to the root."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="unwind")
    unwind = logging.getLogger("unwind")
    unwind.addHandler(caplog.handler)
    yield caplog
    unwind.removeHandler(caplog.handler)


def dump_database() -> str:
    out = io.StringIO()
    call_command("dumpdata", stdout=out)
    return out.getvalue()


def test_api_keys_are_never_stored_or_logged_in_clear(transactional_db, tools, every_log, capsys, monkeypatch):
    call_command("create_agent", "acme", "second")
    printed = capsys.readouterr()
    key = printed.out.strip()
    assert re.fullmatch(r"uw_[0-9a-f]{12}_[\w-]{20,}", key), printed
    secret = key.split("_", 2)[2]
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {key}", raise_request_exception=False)
    run = agent.post("/api/v1/runs", {"goal": "g"}, content_type="application/json").json()
    assert agent.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "hr.create_user", "args": {"email": "k@x.io", "name": "K"}},
                      content_type="application/json").status_code == 201
    assert agent.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "nope", "args": {}},
                      content_type="application/json").status_code == 404
    assert agent.post("/api/v1/runs", "{not json", content_type="application/json").status_code == 400
    forged = Client(HTTP_AUTHORIZATION=f"Bearer {key[:-3]}xyz")
    assert forged.get("/api/v1/runs").status_code == 401
    monkeypatch.setattr("ledger.api.runs.selectors.run_list", lambda **kw: 1 / 0)
    assert agent.get("/api/v1/runs").status_code == 500  # a crash while the key is in the request
    agent_revoke(agent=Agent.objects.get(name="second"), actor="test")
    assert agent.get("/api/v1/runs").status_code == 401
    logged = every_log.text + "".join(str(r.__dict__) for r in every_log.records)
    assert every_log.records, "nothing was logged: the capture is broken"
    assert secret not in logged and key not in logged
    assert secret not in printed.err
    stored = dump_database()
    assert Agent.objects.get(name="second").key_prefix in stored  # the dump has the agent row…
    assert secret not in stored and key not in stored            # …but never the key
    for event in AuditEvent.objects.all():
        assert secret not in str(event.data) and secret not in event.actor


# --- CSRF --------------------------------------------------------------------------------------------------

def page_routes():
    def walk(patterns, prefix):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield prefix + str(pattern.pattern)
    return [r for r in walk(get_resolver().url_patterns, "") if r.startswith(("approvals/", "console/", "accounts/"))]


def fill(route: str, world) -> str:
    values = {"pk": world.item.pk if route.startswith("console/recovery/") else world.approval.pk,
              "operation": "resume", "token": "x", "action_id": 1}
    if route.startswith("console/runs/"):
        values["pk"] = world.item.run_id
    if "<int:link_id>" in route:
        from recovery.trail import trail_link_create

        values["link_id"] = trail_link_create(run=world.item.run, user=world.oscar)[0].pk
    return "/" + re.sub(r"<(?:[^>:]+:)?([^>]+)>", lambda m: str(values[m.group(1)]), route)


def test_every_page_refuses_a_post_without_a_csrf_token(gated):
    routes = page_routes()
    assert len(routes) >= 12, routes
    oscar = Client(enforce_csrf_checks=True)
    oscar.force_login(gated.oscar)
    for route in routes:
        response = oscar.post(fill(route, gated), {"reason": "r", "decision": "approve"})
        assert response.status_code == 403, (route, response.status_code)
        assert b"CSRF" in response.content, route
    gated.item.refresh_from_db()
    assert gated.item.status == "open"


def test_the_forms_work_with_their_token(gated):
    """The 403s above come from CSRF, not from the views: with the token the same posts go through."""
    alice = Client(enforce_csrf_checks=True)
    alice.force_login(gated.alice)
    page = alice.get(f"/approvals/{gated.approval.pk}/")
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.content).group(1).decode()
    response = alice.post(f"/approvals/{gated.approval.pk}/decide/",
                          {"decision": "reject", "reason": "no", "csrfmiddlewaretoken": token})
    assert response.status_code in (200, 302)
    gated.approval.refresh_from_db()
    assert gated.approval.status == "rejected"


def test_the_api_refuses_a_session_post_without_a_csrf_token(gated):
    alice = Client(enforce_csrf_checks=True)
    alice.force_login(gated.alice)
    response = alice.post(f"/api/v1/approvals/{gated.approval.pk}/approve", {}, content_type="application/json")
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]
    gated.approval.refresh_from_db()
    assert gated.approval.status == "pending"


# --- roles -------------------------------------------------------------------------------------------------

def test_a_viewer_can_neither_approve_nor_resolve(gated, client):
    victor_api = Client(HTTP_AUTHORIZATION=basic("victor"))
    assert victor_api.post(f"/api/v1/approvals/{gated.approval.pk}/approve", {}, content_type="application/json").status_code == 403
    assert victor_api.post(f"/api/v1/approvals/{gated.approval.pk}/reject", {"reason": "no"},
                           content_type="application/json").status_code == 403
    for operation in ("resume", "compensate", "close"):
        assert victor_api.post(f"/api/v1/recovery-items/{gated.item.pk}/{operation}", {"reason": "r"},
                               content_type="application/json").status_code == 403
    client.force_login(gated.victor)
    assert client.post(f"/approvals/{gated.approval.pk}/decide/", {"decision": "approve"}).status_code == 403
    for operation in ("resume", "compensate", "close"):
        assert client.post(f"/console/recovery/{gated.item.pk}/{operation}/", {"reason": "r"}).status_code == 403
    assert client.post("/console/recovery/bulk/", {"operation": "close", "items": [gated.item.pk], "reason": "r",
                                                   "confirmed": "on"}).status_code == 403
    gated.approval.refresh_from_db()
    gated.item.refresh_from_db()
    assert gated.approval.status == "pending" and gated.item.status == "open"


def test_an_approver_cannot_resolve_and_an_agent_cannot_decide(gated):
    alice = Client(HTTP_AUTHORIZATION=basic("alice"))
    assert alice.post(f"/api/v1/recovery-items/{gated.item.pk}/close", {"reason": "r"},
                      content_type="application/json").status_code == 403
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {gated.key}")
    assert agent.post(f"/api/v1/approvals/{gated.approval.pk}/approve", {}, content_type="application/json").status_code == 403
    assert agent.post(f"/api/v1/recovery-items/{gated.item.pk}/close", {"reason": "r"},
                      content_type="application/json").status_code == 403
    gated.approval.refresh_from_db()
    gated.item.refresh_from_db()
    assert gated.approval.status == "pending" and gated.item.status == "open"


# --- verify_audit, the command ------------------------------------------------------------------------------

def verify(*args) -> str:
    out = io.StringIO()
    call_command("verify_audit", *args, stdout=out)
    return out.getvalue()


TAMPERING = {
    "an audit event edited": lambda w: AuditEvent.objects.filter(pk=AuditEvent.objects.filter(
        tenant=w.acme, kind="forward.succeeded").first().pk).update(data={"forged": True}),
    "an audit event deleted": lambda w: AuditEvent.objects.filter(pk=AuditEvent.objects.filter(
        tenant=w.acme).order_by("seq")[3].pk).delete(),
    "an action's result edited": lambda w: Action.objects.filter(pk=Action.objects.filter(
        tenant=w.acme, status="succeeded").first().pk).update(result={"id": "usr_forged"}),
    "a run's status edited": lambda w: Run.objects.filter(tenant=w.acme).update(status="completed"),
    "a run deleted": lambda w: Run.objects.filter(tenant=w.acme).delete(),
}


@pytest.fixture
def history(tools):
    run = open_run(tools)
    user = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=400)
    act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    return tools


@pytest.mark.parametrize("tampering", list(TAMPERING))
def test_verify_audit_reports_tampering_and_names_the_tenant(history, tampering):
    assert verify().startswith("ok: ")
    TAMPERING[tampering](history)
    with pytest.raises(CommandError, match=r"^tenant acme: broken at .+"):
        verify()
    assert verify("--tenant", "globex").startswith("ok: ")  # the other tenant's chain is untouched


def test_verify_audit_refuses_an_unknown_tenant(history):
    with pytest.raises(CommandError, match="does not exist"):
        verify("--tenant", "nobody")


@pytest.mark.slow
@pytest.mark.skipif("sqlite" in database_url() and ":memory:" in database_url(), reason="needs a database file or server")
def test_the_command_exits_non_zero_on_a_broken_chain(transactional_db, tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    env = {"DATABASE_URL": database_url(), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "UNWIND_INSECURE_DEV_KEY": "1"}
    intact = subprocess.run([sys.executable, "manage.py", "verify_audit"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert intact.returncode == 0 and intact.stdout.startswith("ok: "), intact.stderr
    Action.objects.filter(run=run).update(status="failed")
    broken = subprocess.run([sys.executable, "manage.py", "verify_audit"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert broken.returncode == 1
    assert "tenant acme: broken at action" in broken.stderr and "behind the services' back" in broken.stderr
