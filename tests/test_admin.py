"""The Django admin: every ledger and recovery model is there; ledger and audit rows cannot be edited."""
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from ledger.audit.verify import verify_chain
from ledger.models import (
    Action, Agent, Attempt, AuditEvent, AuditHead, Checkpoint, Membership, Run, Tenant, TenantPolicyVersion, Tool,
)
from recovery.models import RecoveryItem
from tests.test_console_scenarios import drift_run, onboarding_compensated, open_item

READ_ONLY = [Run, Action, Attempt, Checkpoint, AuditEvent, AuditHead, RecoveryItem]
EDITABLE = [Tenant, Membership, Tool]


def url(model, view: str, pk=None) -> str:
    meta = model._meta
    base = f"/admin/{meta.app_label}/{meta.model_name}/"
    return base + {"changelist": "", "add": "add/", "change": f"{pk}/change/", "delete": f"{pk}/delete/"}[view]


@pytest.fixture
def admin_world(tools):
    tools.admin_user = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root")
    tools.client = Client()
    tools.client.force_login(tools.admin_user)
    tools.done = onboarding_compensated(tools)
    tools.stuck = drift_run(tools)
    return tools


def some_pk(model):
    if model is AuditHead:
        return AuditHead.objects.order_by("pk").values_list("pk", flat=True).first()
    return model.objects.order_by("pk").values_list("pk", flat=True).first()


@pytest.mark.parametrize("model", [*READ_ONLY, *EDITABLE, Agent])
def test_every_model_lists_and_shows_for_a_superuser(admin_world, model):
    client = admin_world.client
    assert client.get(url(model, "changelist")).status_code == 200
    assert client.get(url(model, "changelist"), {"q": "acme"}).status_code == 200
    assert client.get(url(model, "change", some_pk(model))).status_code == 200


@pytest.mark.parametrize("model", READ_ONLY)
def test_ledger_rows_refuse_edits(admin_world, model):
    client = admin_world.client
    pk = some_pk(model)
    assert client.get(url(model, "add")).status_code == 403
    assert client.post(url(model, "add"), {}).status_code == 403
    assert client.post(url(model, "change", pk), {"status": "completed"}).status_code == 403
    assert client.post(url(model, "delete", pk), {"post": "yes"}).status_code == 403
    assert model.objects.filter(pk=pk).exists()
    assert b'name="_save"' not in client.get(url(model, "change", pk)).content


def test_run_change_view_is_read_only_and_links_to_the_console(admin_world):
    page = admin_world.client.get(url(Run, "changelist")).content.decode()
    assert f'href="/console/runs/{admin_world.stuck.pk}/"' in page
    assert "read-only here" in page
    detail = admin_world.client.get(url(Run, "change", admin_world.stuck.pk)).content.decode()
    assert 'name="_save"' not in detail


def test_ledger_stays_verifiable_after_admin_visits(admin_world):
    for model in READ_ONLY:
        admin_world.client.post(url(model, "change", some_pk(model)), {"status": "completed"})
    assert verify_chain(admin_world.acme.pk).ok


def test_recovery_item_links_to_the_console(admin_world):
    item = open_item(admin_world.stuck)
    page = admin_world.client.get(url(RecoveryItem, "changelist"), {"status__exact": "open"}).content.decode()
    assert f'href="/console/recovery/{item.pk}/"' in page


def test_agents_show_prefix_not_key_and_cannot_be_edited(admin_world):
    client = admin_world.client
    agent = admin_world.agent
    listing = client.get(url(Agent, "changelist")).content.decode()
    assert agent.key_prefix in listing
    assert "create_agent" in listing  # the help text says how agents are made
    detail = client.get(url(Agent, "change", agent.pk)).content.decode()
    assert agent.key_hash not in detail and admin_world.key not in detail
    assert "create_agent" in detail
    assert client.post(url(Agent, "change", agent.pk), {"name": "renamed"}).status_code == 403


def test_a_superuser_adds_an_agent_and_sees_its_key_once(admin_world, live_server):
    import requests

    from ledger.tenancy import hash_key

    client = admin_world.client
    assert client.get(url(Agent, "add")).status_code == 200
    shown = client.post(url(Agent, "add"), {"tenant": admin_world.acme.pk, "name": "my-agent"})
    assert shown.status_code == 200 and "no-store" in shown["Cache-Control"]
    page = shown.content.decode()
    key = page.split('id="agent-key" type="text" readonly value="')[1].split('"')[0]
    agent = Agent.objects.get(tenant=admin_world.acme, name="my-agent")
    assert agent.key_hash == hash_key(key) and key not in client.get(url(Agent, "change", agent.pk)).content.decode()
    assert AuditEvent.objects.filter(kind="agent.created", actor="user:root", data__name="my-agent").exists()
    answer = requests.get(f"{live_server.url}/api/v1/runs", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert answer.status_code == 200  # the key works, over HTTP
    again = client.post(url(Agent, "add"), {"tenant": admin_world.acme.pk, "name": "my-agent"})
    assert again.status_code == 200 and "already has an agent named" in again.content.decode()
    assert Agent.objects.filter(tenant=admin_world.acme, name="my-agent").count() == 1
    staff = get_user_model().objects.create_user("staffer", "s@example.com", "pw-staffer", is_staff=True)
    other = Client()
    other.force_login(staff)
    assert other.get(url(Agent, "add")).status_code == 403


def test_agents_can_be_revoked_through_the_service(admin_world):
    agent = admin_world.agent
    response = admin_world.client.post(url(Agent, "changelist"), {"action": "revoke", "_selected_action": [agent.pk]})
    assert response.status_code == 302
    agent.refresh_from_db()
    assert agent.revoked_at is not None
    assert AuditEvent.objects.filter(kind="agent.revoked", actor="user:root").exists()


def test_tool_policy_edit_writes_a_new_version_and_is_audited(admin_world):
    tool = Tool.objects.get(tenant=admin_world.acme, name="crm.update_ticket")
    page = admin_world.client.get(url(Tool, "change", tool.pk))
    form = page.context["adminform"].form
    data = {name: form[name].value() for name in form.fields}
    data = {k: ("" if v is None else v) for k, v in data.items()}
    for name in ("args_schema", "key_fields", "snapshot", "verify", "lookup", "compensation"):
        data[name] = form[name].value()
    data["risk"] = "high"
    response = admin_world.client.post(url(Tool, "change", tool.pk), data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    current = Tool.objects.get(tenant=admin_world.acme, name="crm.update_ticket", is_current=True)
    assert (current.version, current.risk, current.actor) == (2, "high", "user:root")
    tool.refresh_from_db()
    assert (tool.version, tool.risk, tool.is_current) == (1, "medium", False)  # the first version is history
    assert AuditEvent.objects.filter(kind="tool.updated", actor="user:root", data__tool="crm.update_ticket",
                                     data__version=2, data__changed=["risk"]).exists()
    assert verify_chain(admin_world.acme.pk).ok
    # An earlier version can be read, not edited.
    assert admin_world.client.get(url(Tool, "change", tool.pk)).context["has_change_permission"] is False
    data["risk"] = "low"
    assert admin_world.client.post(url(Tool, "change", tool.pk), data).status_code == 403
    assert Tool.objects.filter(tenant=admin_world.acme, name="crm.update_ticket").count() == 2


def test_tool_admin_validates_like_the_api(admin_world):
    tool = Tool.objects.get(tenant=admin_world.acme, name="crm.update_ticket")
    form = admin_world.client.get(url(Tool, "change", tool.pk)).context["adminform"].form
    data = {name: ("" if form[name].value() is None else form[name].value()) for name in form.fields}
    data["endpoint"] = "ftp://example.invalid/x"
    data["executor"] = "http"
    response = admin_world.client.post(url(Tool, "change", tool.pk), data)
    assert response.status_code == 200
    assert "endpoint" in str(response.context["adminform"].form.non_field_errors())
    assert Tool.objects.filter(tenant=admin_world.acme, name="crm.update_ticket").count() == 1


def test_tenant_defaults_changed_in_admin_are_a_new_version(admin_world):
    tenant = admin_world.acme
    too_short = admin_world.client.post(url(Tenant, "change", tenant.pk), {
        "name": "Acme", "approval_threshold": "critical", "approval_ttl_seconds": 600, "run_idle_timeout_seconds": 10, "customer_requests_seconds": 0})
    assert too_short.status_code == 200 and "run_idle_timeout_seconds" in too_short.context["adminform"].form.errors
    response = admin_world.client.post(url(Tenant, "change", tenant.pk), {
        "name": "Acme", "approval_threshold": "critical", "approval_ttl_seconds": 600, "run_idle_timeout_seconds": 1800,
        "customer_requests_seconds": 0, "retention_seconds": 0})
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.approval_threshold, tenant.approval_ttl_seconds) == ("critical", 600)
    assert tenant.run_idle_timeout_seconds == 1800
    version = TenantPolicyVersion.objects.filter(tenant=tenant).latest("version")  # version 0: as created
    assert (version.version, version.approval_threshold, version.actor) == (1, "critical", "user:root")
    assert AuditEvent.objects.filter(tenant=tenant, kind="tenant.defaults", actor="user:root", data__version=1).exists()
    assert verify_chain(tenant.pk).ok


def test_tenant_added_in_admin_gets_its_audit_chain(admin_world):
    response = admin_world.client.post(url(Tenant, "add"), {
        "slug": "initech", "name": "Initech", "approval_threshold": "medium", "approval_ttl_seconds": 600,
        "run_idle_timeout_seconds": 3600, "customer_requests_seconds": 0, "retention_seconds": 0})
    assert response.status_code == 302
    tenant = Tenant.objects.get(slug="initech")
    assert tenant.approval_threshold == "medium" and tenant.approval_ttl_seconds == 600
    assert AuditHead.objects.filter(pk=tenant.pk).exists()
    assert AuditEvent.objects.filter(tenant=tenant, kind="tenant.created", actor="user:root").exists()
    assert verify_chain(tenant.pk).ok


def test_membership_added_in_admin_is_audited(admin_world):
    newcomer = get_user_model().objects.create_user("nina", "nina@example.com", "pw-nina")
    response = admin_world.client.post(url(Membership, "add"), {
        "user": newcomer.pk, "tenant": admin_world.acme.pk, "role": "operator"})
    assert response.status_code == 302
    assert Membership.objects.get(user=newcomer).role == "operator"
    assert AuditEvent.objects.filter(kind="membership.set", actor="user:root", data__user="nina").exists()


def test_non_staff_cannot_reach_the_admin(admin_world):
    oscar = Client()
    oscar.force_login(admin_world.oscar)
    response = oscar.get(url(Run, "changelist"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
