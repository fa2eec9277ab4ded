"""Policy is versioned and actions are bound to it (issue 12, attack 2c).

Each change of a tool's policy is a new immutable version; an action runs, is approved and is compensated with
the version it was proposed under; an approval waiting when its tool gets a new version is voided, and the
approver page says why. The attacks run over real HTTP against a live server, with the tools reached over HTTP
and a loopback listener standing in for the place an attacker would point an executor at.
"""
import re
import socket
import threading

import pytest
import requests
from django.contrib.auth import get_user_model
from django.test import Client

from approvals.models import ApprovalRequest
from approvals.services import ApprovalVoided, approval_decide
from ledger import events
from ledger.audit.verify import verify_chain
from ledger.models import Action, AuditEvent, ImmutableVersion, Run, TenantPolicyVersion, Tool
from ledger.engine.runs import run_cancel
from ledger.tenancy import membership_set
from ledger.policy.versions import tool_upsert
from sandbox.selectors import world_state
from tests.api_support import basic
from tests.helpers import acme, act, open_run


class LoopbackListener:
    """A real TCP server on 127.0.0.1:<free port> that records every connection it accepts (and answers 200)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                self.connections.append(data)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def listener(settings):
    """A place an admin may point a tool at: its origin is allowed, so only the version binding keeps calls off it."""
    server = LoopbackListener()
    settings.UNWIND_TOOL_ORIGINS = [*settings.UNWIND_TOOL_ORIGINS, server.url]
    yield server
    server.close()


@pytest.fixture
def live(http_tools):
    """acme's tools over HTTP on a live server, an admin (adam) who writes policy, and HTTP sessions per persona."""
    world = http_tools
    adam = get_user_model().objects.create_user("adam", "adam@example.com", "pw-adam")
    membership_set(tenant=world.acme, user=adam, role="admin")
    world.base = world.live_server.url

    def session(auth: str) -> requests.Session:
        s = requests.Session()
        s.headers["Authorization"] = auth
        return s

    world.agent_http = session(f"Bearer {world.key}")
    world.admin_http = session(basic("adam"))
    world.approver_http = session(basic("alice"))
    return world


def repoint(world, tool: str, url: str) -> dict:
    """As the admin, over the API: the tool's policy as it stands, with its executor sent to `url`."""
    policy = world.admin_http.get(f"{world.base}/api/v1/tools/{tool}", timeout=10).json()["policy"]
    policy["executor"], policy["endpoint"] = "http", url
    answer = world.admin_http.put(f"{world.base}/api/v1/tools/{tool}", json=policy, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # the version written: its `version` is checked where it matters


def charge_awaiting_approval(world) -> tuple[dict, dict]:
    """Over the agent API: a run that booked a flight and proposes a charge, which waits for a person."""
    run = world.agent_http.post(f"{world.base}/api/v1/runs", json={"goal": "book a trip"}, timeout=10).json()
    flight = world.agent_http.post(f"{world.base}/api/v1/runs/{run['id']}/actions", timeout=30, json={
        "tool": "travel.book_flight", "args": {"passenger": "P", "flight": "LH1", "date": "2027-01-01"}})
    assert flight.status_code in (200, 201) and flight.json()["status"] == "succeeded", flight.text
    charge = world.agent_http.post(f"{world.base}/api/v1/runs/{run['id']}/actions", timeout=30, json={
        "tool": "payments.charge", "args": {"customer": "cus_1", "amount_cents": 5000}})
    assert charge.status_code == 202 and charge.json()["status"] == "awaiting_approval", charge.text
    return run, charge.json()


def page_session(world, username: str) -> requests.Session:
    """A browser-like session on the live server, logged in through the login form."""
    s = requests.Session()
    login = f"{world.base}/accounts/login/"
    s.get(login, timeout=10)
    answer = s.post(login, timeout=10, data={"username": username, "password": f"pw-{username}",
                                             "csrfmiddlewaretoken": s.cookies["csrftoken"]}, headers={"Referer": login})
    assert answer.status_code == 200 and "sessionid" in s.cookies, answer.text[:300]
    return s


# --- attack 2c: re-point the executor while a charge waits for approval ---------------------------------------

def test_repointing_a_waiting_charge_voids_its_approval_and_nothing_reaches_the_new_url(live, listener):
    run, charge = charge_awaiting_approval(live)
    request = ApprovalRequest.objects.get(action_id=charge["id"])
    assert request.tool.version == 1

    written = repoint(live, "payments.charge", listener.url + "/steal")
    assert written["version"] == 2

    # The change itself voids the request, in the same commit: the run follows its rejection path at once.
    request.refresh_from_db()
    assert request.status == "voided"
    assert request.outcome_reason == "the policy of payments.charge changed from version 1 to 2 while this waited"
    action = Action.objects.get(pk=charge["id"])
    assert action.status == "rejected" and "version 1 to 2" in action.decision_reason
    assert Run.objects.get(pk=run["id"]).status == "compensated"
    assert [b["status"] for b in world_state(tenant=acme())["flights"]] == ["cancelled"]

    # The approver approves anyway: 409 with a stable code, and nothing is sent anywhere.
    answer = live.approver_http.post(f"{live.base}/api/v1/approvals/{request.pk}/approve", json={}, timeout=30)
    assert answer.status_code == 409 and answer.headers["Content-Type"].startswith("application/problem+json")
    problem = answer.json()
    assert problem["code"] == "approval_voided" and "version 1 to 2" in problem["detail"]
    assert listener.connections == []
    assert world_state(tenant=acme())["charges"] == []
    assert Action.objects.get(pk=charge["id"]).status == "rejected"
    shown = live.approver_http.get(f"{live.base}/api/v1/approvals/{request.pk}", timeout=10).json()
    assert (shown["status"], shown["tool_version"]) == ("voided", 1) and "version 1 to 2" in shown["outcome_reason"]

    # The audit chain says what happened and who caused it.
    voided = AuditEvent.objects.get(tenant=live.acme, kind="approval.voided")
    assert voided.actor == "user:adam" and voided.data["version"] == 1 and voided.data["tool"] == "payments.charge"
    updated = AuditEvent.objects.get(tenant=live.acme, kind="tool.updated", data__tool="payments.charge")
    assert updated.data["version"] == 2 and updated.data["changed"] == ["endpoint"] and len(updated.data["policy"]) == 64
    assert verify_chain(live.acme.pk).ok

    # The approver page says why, instead of offering approve and reject.
    alice = page_session(live, "alice")
    page = alice.get(f"{live.base}/approvals/{request.pk}/", timeout=10)
    assert page.status_code == 200
    assert "Voided" in page.text and "the policy of payments.charge changed from version 1 to 2" in page.text
    assert "<button type=\"submit\">Approve</button>" not in page.text
    # A decision posted from a page opened before the change is refused there too, saying why.
    decided = alice.post(f"{live.base}/approvals/{request.pk}/decide/", timeout=10, headers={"Referer": page.url},
                         data={"decision": "approve", "csrfmiddlewaretoken": alice.cookies["csrftoken"]})
    assert decided.status_code == 409
    assert "This request was voided" in decided.text and "version 1 to 2" in decided.text
    assert listener.connections == []


def test_a_change_racing_the_decision_voids_instead_of_approving(live, listener, monkeypatch):
    """Even when the void on change did not reach the request (a race, or a request older than versioned
    approvals), the decision re-checks that its version is still current."""
    monkeypatch.setitem(events._subscribers, "policy_changed", [])
    _, charge = charge_awaiting_approval(live)
    request = ApprovalRequest.objects.get(action_id=charge["id"])
    repoint(live, "payments.charge", listener.url + "/steal")
    assert ApprovalRequest.objects.get(pk=request.pk).status == "pending"  # nobody voided it on the change

    answer = live.approver_http.post(f"{live.base}/api/v1/approvals/{request.pk}/approve", json={}, timeout=30)
    assert answer.status_code == 409 and answer.json()["code"] == "approval_voided", answer.text
    request.refresh_from_db()
    assert request.status == "voided" and not request.decisions.exists()
    assert Action.objects.get(pk=charge["id"]).status == "rejected"
    assert listener.connections == [] and world_state(tenant=acme())["charges"] == []
    assert AuditEvent.objects.filter(tenant=live.acme, kind="approval.voided", actor="system:approvals").exists()


# --- actions keep their version ----------------------------------------------------------------------------

def test_an_approved_action_in_flight_keeps_its_versions_executor(live, listener, monkeypatch):
    queued = []
    monkeypatch.setattr("ledger.engine.dispatch.async_task", lambda func, *args, **kw: queued.append((func, args)))
    _, charge = charge_awaiting_approval(live)
    request = ApprovalRequest.objects.get(action_id=charge["id"])
    answer = live.approver_http.post(f"{live.base}/api/v1/approvals/{request.pk}/approve", json={}, timeout=30)
    assert answer.status_code == 200 and answer.json()["status"] == "approved", answer.text
    # Approved and handed to a worker, which has not picked it up yet: now the executor is re-pointed.
    assert Action.objects.get(pk=charge["id"]).status == "running"
    repoint(live, "payments.charge", listener.url + "/steal")

    from ledger import tasks
    for func, args in queued:
        assert func == "ledger.tasks.execute_action"
        tasks.execute_action(*args)
    assert listener.connections == []
    assert [c["amount_cents"] for c in world_state(tenant=acme())["charges"]] == [5000]
    action = Action.objects.select_related("tool").get(pk=charge["id"])
    assert action.status == "succeeded" and action.tool.version == 1 and not action.tool.is_current


def test_a_compensation_runs_with_the_twin_version_bound_at_the_forward_step(live, listener):
    run = open_run(live)
    flight = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH2", "date": "2027-01-02"})
    assert flight.compensation_plan["tool_version"] == 1
    repoint(live, "travel.cancel_flight", listener.url + "/steal")
    run_cancel(run=run, actor="agent:booker")

    assert listener.connections == []
    assert [b["status"] for b in world_state(tenant=acme())["flights"]] == ["cancelled"]
    run.refresh_from_db()
    assert run.status == "compensated"
    undo = Action.objects.select_related("tool").get(run=run, kind="compensation")
    assert undo.tool.name == "travel.cancel_flight" and undo.tool.version == 1
    # A step proposed after the change binds the new version of the twin.
    later = open_run(live)
    assert act(later, "travel.book_flight", {"passenger": "Q", "flight": "LH3", "date": "2027-01-03"}) \
        .compensation_plan["tool_version"] == 2


def test_a_replay_after_a_policy_change_answers_the_recorded_outcome(live):
    run = open_run(live)
    first = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH4", "date": "2027-01-04"}, key="trip-1")
    policy = live.admin_http.get(f"{live.base}/api/v1/tools/travel.book_flight", timeout=10).json()["policy"]
    answer = live.admin_http.put(f"{live.base}/api/v1/tools/travel.book_flight", timeout=30,
                                 json={**policy, "description": "Book a flight (v2)."})
    assert answer.json()["version"] == 2
    again = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH4", "date": "2027-01-04"}, key="trip-1")
    assert again.pk == first.pk and len(world_state(tenant=acme())["flights"]) == 1


# --- versions are immutable ------------------------------------------------------------------------------

def test_a_recorded_version_is_never_changed_only_superseded(tools):
    v1 = Tool.objects.get(tenant=tools.acme, name="crm.update_ticket")
    spec = {"description": "Update a ticket.", "executor": "http", "endpoint": "/sandbox/crm/tickets/update",
            "target": {"type": "ticket", "from": "args.ticket_id"}}
    v2, created = tool_upsert(tenant=tools.acme, name="crm.update_ticket", spec=spec, actor="user:adam")
    assert not created and (v2.version, v2.is_current, v2.actor) == (2, True, "user:adam")
    fresh = Tool.objects.get(pk=v1.pk)
    assert not fresh.is_current
    assert (fresh.endpoint, fresh.description, fresh.compensation) == (v1.endpoint, v1.description, v1.compensation)
    # The same policy again is no new version.
    assert tool_upsert(tenant=tools.acme, name="crm.update_ticket", spec=spec, actor="user:adam")[0].pk == v2.pk
    assert Tool.objects.filter(tenant=tools.acme, name="crm.update_ticket").count() == 2
    # Nothing writes a recorded version's policy in place.
    with pytest.raises(ImmutableVersion):
        Tool.objects.filter(pk=v1.pk).update(endpoint="http://127.0.0.1:9/steal")
    with pytest.raises(ImmutableVersion):
        Tool.objects.update_or_create(tenant=tools.acme, name="crm.update_ticket", is_current=True,
                                      defaults={"endpoint": "http://127.0.0.1:9/steal"})
    fresh.endpoint = "http://127.0.0.1:9/steal"
    with pytest.raises(ImmutableVersion):
        fresh.save()
    assert Tool.objects.get(pk=v1.pk).endpoint == v1.endpoint
    assert Tool.objects.get(pk=v2.pk).endpoint == "/sandbox/crm/tickets/update"


def test_tenant_defaults_are_versioned_and_actions_record_theirs(tools):
    from ledger.policy.versions import tenant_defaults_set

    run = open_run(tools)
    before = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH5", "date": "2027-01-05"})
    assert before.defaults_version == 0
    version = tenant_defaults_set(tenant=tools.acme, values={"approval_threshold": "critical"}, actor="user:adam")
    assert version.version == 1 and (version.approval_threshold, version.approval_ttl_seconds) == ("critical", 3600)
    assert tenant_defaults_set(tenant=tools.acme, values={"approval_threshold": "critical"}, actor="user:adam") is None
    after = act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    assert after.status == "succeeded" and after.defaults_version == 1  # critical threshold: no approval needed
    event = AuditEvent.objects.filter(tenant=tools.acme, kind="tenant.defaults").latest("seq")
    assert event.actor == "user:adam" and event.data["version"] == 1 and event.data["changed"] == ["approval_threshold"]
    # Version 0 is what the tenant was created with, stored from its creation (issue 31).
    assert sorted(TenantPolicyVersion.objects.filter(tenant=tools.acme).values_list("version", flat=True)) == [0, 1]


# --- the console's policy history ----------------------------------------------------------------------------

def test_the_policy_page_lists_versions_with_their_diff_for_members_only(tools):
    spec_v2 = {"description": "Charge a card (v2).", "executor": "http", "endpoint": "/sandbox/elsewhere",
               "saga_role": "pivot", "risk": "high", "action_class": "external_irreversible"}
    tool_upsert(tenant=tools.acme, name="payments.charge", spec=spec_v2, actor="user:adam")
    from ledger.policy.versions import tenant_defaults_set
    tenant_defaults_set(tenant=tools.acme, values={"approval_ttl_seconds": 600}, actor="user:adam")

    victor = Client()  # a viewer: people with any role in the tenant read its policy history
    victor.force_login(tools.victor)
    page = victor.get("/console/policy/", {"tenant": "acme", "tool": "payments.charge"})
    assert page.status_code == 200
    html = page.content.decode()
    assert '<a href="/console/policy/" aria-current="page">Policy</a>' in html  # in the navigation, marked current
    charge = re.search(r'data-subject="payments.charge" data-version="2">(.*?)</article>', html, re.S).group(1)
    assert "current" in charge and "by user:adam" in charge
    assert "endpoint" in charge and "sandbox.payments.charge" in charge and "/sandbox/elsewhere" in charge
    assert "args_schema" in charge  # v2 dropped the schema: shown as changed
    assert "max_attempts" not in charge  # unchanged settings are not listed
    first = re.search(r'data-subject="payments.charge" data-version="1">(.*?)</article>', html, re.S).group(1)
    assert "first version" in first and "current" not in first
    defaults = re.search(r'data-subject="tenant defaults" data-version="1">(.*?)</article>', html, re.S).group(1)
    assert "approval_ttl_seconds" in defaults and "3600" in defaults and "600" in defaults
    assert "approval_threshold" not in defaults

    mallory = Client()  # globex only: acme's policy does not exist for her
    mallory.force_login(tools.mallory)
    assert mallory.get("/console/policy/", {"tenant": "acme"}).status_code == 404
    assert "Policy of Globex" in mallory.get("/console/policy/").content.decode()
    outsider = Client()
    outsider.force_login(get_user_model().objects.create_user("nobody", "n@example.com", "pw"))
    assert outsider.get("/console/policy/").status_code == 403
    assert Client().get("/console/policy/").status_code == 302  # to the login page


def test_a_waiting_compensation_is_voided_when_its_tools_policy_changes(tools, django_capture_on_commit_callbacks):
    from tests.conftest import in_process_policy
    from tests.test_approval_pages import refund_waiting_for_approval

    run, charge, undo = refund_waiting_for_approval(tools, django_capture_on_commit_callbacks)
    spec = {**in_process_policy()["tools"]["payments.refund"], "description": "Refund a charge (v2)."}
    with django_capture_on_commit_callbacks(execute=True):
        tool_upsert(tenant=tools.acme, name="payments.refund", spec=spec, actor="user:adam")
    undo.refresh_from_db()
    assert undo.status == "voided" and "payments.refund changed from version 1 to 2" in undo.outcome_reason
    # Refused as a rejected compensation is: the charge stands, and a person is told.
    assert [c["status"] for c in world_state(tenant=acme())["charges"]] == ["captured"]
    charge.refresh_from_db()
    assert charge.status == "compensation_failed"
    run.refresh_from_db()
    assert run.status == "needs_attention" and "payments.charge (step 3) could not be compensated" in run.attention_detail
    with pytest.raises(ApprovalVoided):
        approval_decide(request=undo, user=tools.ben, approve=True)
    assert [c["status"] for c in world_state(tenant=acme())["charges"]] == ["captured"]
