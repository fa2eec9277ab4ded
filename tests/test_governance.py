"""Agents act, people govern: an agent key cannot remove its own guardrails; a deploy key writes policy and
nothing else. Every attack runs over real HTTP against a live server, as an attacker holding acme's agent key
(booker's), and checks both the refusal and that nothing changed: the tool row, the tenant's threshold, the
audit chain, the world the tools act on.
"""
import pytest
import requests
from django.core.management import call_command
from django.core.management.base import CommandError
from django.forms.models import model_to_dict

from ledger.audit.verify import verify_chain
from ledger.models import Action, AuditEvent, AuditHead, Run, Tenant, Tool
from ledger.tenancy import deploy_key_create, deploy_key_revoke
from recovery.models import RecoveryItem
from sandbox.selectors import world_state
from tests.helpers import acme as acme_tenant

USER = {"email": "ashu@company.com", "name": "Ashu Kumar"}
CHARGE = {"customer": "cus_1", "amount_cents": 4900}


class Api:
    """requests against the live server with one credential: a key (Bearer) or a person (HTTP Basic)."""

    def __init__(self, world, *, key: str | None = None, person: str | None = None):
        self.base = world.live_server.url
        self.session = requests.Session()
        if key is not None:
            self.session.headers["Authorization"] = f"Bearer {key}"
        if person is not None:
            self.session.auth = (person, f"pw-{person}")

    def get(self, path, **params):
        return self.session.get(self.base + path, params=params, timeout=30)

    def post(self, path, body=None):
        return self.session.post(self.base + path, json=body if body is not None else {}, timeout=30)

    def put(self, path, body):
        return self.session.put(self.base + path, json=body, timeout=30)


def problem(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == code and body["detail"], body
    return body


def chain(tenant) -> tuple:
    """The tenant's audit chain as it stands: its head and how many events it holds."""
    head = AuditHead.objects.get(tenant=tenant)
    return head.seq, head.hash, AuditEvent.objects.filter(tenant=tenant).count()


def tool_row(tenant, name: str) -> dict:
    return model_to_dict(Tool.objects.get(tenant=tenant, name=name))


@pytest.fixture
def attacker(http_tools, settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    return Api(http_tools, key=http_tools.key)


@pytest.fixture
def pipeline(http_tools):
    key, raw = deploy_key_create(tenant=http_tools.acme, name="ci-policy", actor="test")
    http_tools.deploy_key = key
    return Api(http_tools, key=raw)


# --- attack 2: an agent removing its own guardrails ----------------------------------------------------------

def test_an_agent_cannot_set_approval_auto_on_payments_charge(http_tools, attacker):
    acme = http_tools.acme
    before, audit = tool_row(acme, "payments.charge"), chain(acme)
    policy = attacker.get("/api/v1/tools/payments.charge").json()["policy"]  # reading is allowed: it needs schemas
    assert policy["approval"] == "threshold"
    refused = attacker.put("/api/v1/tools/payments.charge", {**policy, "approval": "auto", "risk": "low"})
    body = problem(refused, 403, "agents_cannot_govern")
    assert "deploy key" in body["detail"] and "admin" in body["detail"]
    assert tool_row(acme, "payments.charge") == before
    assert chain(acme) == audit
    # The guardrail holds: a charge still waits for a person, and nothing was charged.
    run = attacker.post("/api/v1/runs", {"goal": "buy"}).json()
    charge = attacker.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "payments.charge", "args": CHARGE})
    assert charge.status_code == 202 and charge.json()["status"] == "awaiting_approval"
    assert world_state(tenant=acme_tenant())["charges"] == []


def test_an_agent_cannot_rewrite_the_description_approvers_read(http_tools, attacker):
    acme = http_tools.acme
    before, audit = tool_row(acme, "payments.charge"), chain(acme)
    refused = attacker.put("/api/v1/tools/payments.charge", {"description": "A harmless test charge, always refunded."})
    problem(refused, 403, "agents_cannot_govern")
    assert tool_row(acme, "payments.charge") == before
    assert Tool.objects.get(tenant=acme, name="payments.charge").description.startswith("Charge a customer's card")
    assert chain(acme) == audit


def test_an_agent_cannot_register_a_tool_of_its_own(http_tools, attacker):
    acme = http_tools.acme
    audit = chain(acme)
    problem(attacker.put("/api/v1/tools/exfiltrate", {"executor": "client"}), 403, "agents_cannot_govern")
    assert not Tool.objects.filter(name="exfiltrate").exists()
    assert chain(acme) == audit


def test_an_agent_cannot_switch_a_compensation_to_client_and_report_it_done(http_tools, attacker):
    """The attack: make hr.delete_user client-executed, so that the agent itself 'reports' the undo that the
    world never saw. Refused; Unwind runs the compensation itself, and when it fails no report papers over it."""
    acme = http_tools.acme
    run = attacker.post("/api/v1/runs", {"goal": "onboard"}).json()
    created = attacker.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "hr.create_user", "args": USER})
    assert created.status_code == 201 and created.json()["status"] == "succeeded"
    before, audit = tool_row(acme, "hr.delete_user"), chain(acme)

    problem(attacker.put("/api/v1/tools/hr.delete_user", {"executor": "client"}), 403, "agents_cannot_govern")
    assert tool_row(acme, "hr.delete_user") == before and chain(acme) == audit

    # The undo fails for good in the world, so the run needs a person: nothing for the agent to report.
    requests.post(f"{http_tools.live_server.url}/sandbox/faults", auth=("oscar", "pw-oscar"),
                  json={"tool": "hr.delete_user", "mode": "status", "status": 400, "times": 0}, timeout=5).raise_for_status()
    cancelled = attacker.post(f"/api/v1/runs/{run['id']}/cancel", {"reason": "undo"})
    assert cancelled.status_code == 200, cancelled.text
    assert attacker.get("/api/v1/compensations/pending").json()["results"] == []
    compensation = Action.objects.get(run_id=run["id"], kind="compensation")
    settled = {"status": compensation.status, "result": compensation.result, "attempts": compensation.attempts}
    assert compensation.status == "failed"
    problem(attacker.post(f"/api/v1/actions/{compensation.pk}/report", {"ok": True, "result": {"deleted": True}}),
            409, "state_conflict")
    compensation.refresh_from_db()
    assert {"status": compensation.status, "result": compensation.result, "attempts": compensation.attempts} == settled
    assert Run.objects.get(pk=run["id"]).status == "needs_attention"
    assert RecoveryItem.objects.filter(run_id=run["id"], status="open").exists()
    assert [user["email"] for user in world_state(tenant=acme_tenant())["users"]] == [USER["email"]]  # still there, as the ledger says


def test_an_agent_cannot_raise_the_tenants_approval_threshold(http_tools, attacker):
    acme = http_tools.acme
    audit = chain(acme)
    assert acme.approval_threshold == "high"
    for document in ({"defaults": {"approval_threshold": "critical"}},
                     {"tenant": "acme", "defaults": {"approval_threshold": "critical", "approval_ttl": 99999},
                      "tools": {"payments.charge": {"approval": "auto"}}}):
        problem(attacker.post("/api/v1/policy", document), 403, "agents_cannot_govern")
    acme.refresh_from_db()
    assert (acme.approval_threshold, acme.approval_ttl_seconds) == ("high", 3600)
    assert Tool.objects.get(tenant=acme, name="payments.charge").approval == "threshold"
    assert chain(acme) == audit


def test_a_person_below_admin_cannot_govern_either(http_tools):
    oscar = Api(http_tools, person="oscar")  # operator
    problem(oscar.post("/api/v1/policy", {"defaults": {"approval_threshold": "critical"}}), 403, "permission_denied")
    problem(oscar.put("/api/v1/tools/payments.charge", {"approval": "auto"}), 403, "permission_denied")
    http_tools.acme.refresh_from_db()
    assert http_tools.acme.approval_threshold == "high"


def test_an_admin_person_governs_and_is_the_audited_actor(http_tools):
    ada = Api(http_tools, person="ada")
    changed = ada.post("/api/v1/policy", {"defaults": {"approval_threshold": "critical"}})
    assert changed.status_code == 200, changed.text
    http_tools.acme.refresh_from_db()
    assert http_tools.acme.approval_threshold == "critical"
    assert AuditEvent.objects.filter(tenant=http_tools.acme, kind="tenant.defaults").last().actor == "user:ada"


# --- the deploy key ------------------------------------------------------------------------------------------

def test_a_deploy_key_pushes_a_reviewed_policy_and_is_the_audited_actor(http_tools, pipeline):
    document = {"tenant": "acme", "defaults": {"approval_threshold": "critical"},
                "tools": {"chat.post": {"description": "Post to a channel.", "executor": "client"}}}
    loaded = pipeline.post("/api/v1/policy", document)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["loaded"] == ["chat.post"]
    http_tools.acme.refresh_from_db()
    assert http_tools.acme.approval_threshold == "critical"
    put = pipeline.put("/api/v1/tools/chat.post", {"description": "Post to a chat channel.", "executor": "client"})
    assert put.status_code == 200 and put.json()["policy"]["description"] == "Post to a chat channel."
    assert [t["name"] for t in pipeline.get("/api/v1/tools").json()].count("chat.post") == 1
    actors = set(AuditEvent.objects.filter(tenant=http_tools.acme, kind__in=["tenant.defaults", "tool.registered",
                                                                               "tool.updated"])
                 .exclude(actor="test").exclude(data__version=0).values_list("actor", flat=True))
    assert actors == {"deploy:ci-policy"}
    assert verify_chain(http_tools.acme.pk).ok


def test_a_deploy_key_governs_only_its_own_tenant(http_tools, pipeline):
    globex_tools = sorted(Tool.objects.filter(tenant=http_tools.globex).values_list("name", flat=True))
    refused = pipeline.post("/api/v1/policy", {"tenant": "globex", "tools": {"chat.post": {"executor": "client"}}})
    assert problem(refused, 400, "validation_error")["field"] == "tenant"
    put = pipeline.put("/api/v1/tools/chat.post?tenant=globex", {"executor": "client"})  # ?tenant is for people
    assert put.status_code == 201
    assert Tool.objects.get(name="chat.post").tenant == http_tools.acme
    assert sorted(Tool.objects.filter(tenant=http_tools.globex).values_list("name", flat=True)) == globex_tools


def test_a_deploy_key_cannot_act_or_read_the_ledger(http_tools, pipeline, attacker):
    run = attacker.post("/api/v1/runs", {"goal": "mine"}).json()
    action = attacker.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "hr.create_user", "args": USER}).json()
    runs, actions, audit = Run.objects.count(), Action.objects.count(), chain(http_tools.acme)
    for response in (
        pipeline.post("/api/v1/runs", {"goal": "pipeline run"}),
        pipeline.post(f"/api/v1/runs/{run['id']}/actions", {"tool": "hr.create_user", "args": USER}),
        pipeline.post(f"/api/v1/runs/{run['id']}/cancel", {}),
        pipeline.post(f"/api/v1/runs/{run['id']}/complete"),
        pipeline.post(f"/api/v1/actions/{action['id']}/report", {"ok": True}),
        pipeline.get("/api/v1/runs"),
        pipeline.get(f"/api/v1/runs/{run['id']}"),
        pipeline.get(f"/api/v1/actions/{action['id']}"),
        pipeline.get("/api/v1/compensations/pending"),
        pipeline.get("/api/v1/approvals"),
        pipeline.get("/api/v1/recovery-items"),
    ):
        body = problem(response, 403, "deploy_key_cannot_act")
        assert "ci-policy" not in body["detail"] and "acme" not in response.text
    assert (Run.objects.count(), Action.objects.count(), chain(http_tools.acme)) == (runs, actions, audit)
    assert Run.objects.get(pk=run["id"]).status == "running"


def test_a_revoked_deploy_key_is_401_everywhere_it_was_accepted(http_tools, pipeline):
    assert pipeline.get("/api/v1/tools").status_code == 200
    deploy_key_revoke(key=http_tools.deploy_key, actor="user:ada")
    audit = chain(http_tools.acme)
    for response in (pipeline.get("/api/v1/tools"), pipeline.get("/api/v1/tools/hr.create_user"),
                     pipeline.put("/api/v1/tools/chat.post", {"executor": "client"}),
                     pipeline.post("/api/v1/policy", {"defaults": {"approval_threshold": "low"}})):
        problem(response, 401, "authentication_failed")
    assert not Tool.objects.filter(name="chat.post").exists()
    assert Tenant.objects.get(pk=http_tools.acme.pk).approval_threshold == "high"
    assert chain(http_tools.acme) == audit


def test_a_made_up_deploy_key_is_401(http_tools):
    forged = Api(http_tools, key="uwd_000000000000_" + "x" * 43)
    problem(forged.put("/api/v1/tools/chat.post", {"executor": "client"}), 401, "authentication_failed")
    assert not Tool.objects.filter(name="chat.post").exists()


def test_create_deploy_key_prints_a_working_key_once(http_tools, capsys):
    call_command("create_deploy_key", "acme", "release-pipeline")
    out, err = capsys.readouterr()
    raw = out.strip()
    assert raw.startswith("uwd_") and "shown once" in err
    assert Api(http_tools, key=raw).put("/api/v1/tools/chat.post", {"executor": "client"}).status_code == 201
    assert AuditEvent.objects.filter(kind="tool.registered", actor="deploy:release-pipeline").exists()
    with pytest.raises(CommandError, match="already has a deploy key"):
        call_command("create_deploy_key", "acme", "release-pipeline")
    with pytest.raises(CommandError, match="does not exist"):
        call_command("create_deploy_key", "nowhere", "x")
