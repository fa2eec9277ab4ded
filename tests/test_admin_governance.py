"""The deployers' ways to govern: tool policy and tenant defaults in the Django admin (superusers edit them;
any other staff user, even one granted every model permission, only reads them), deploy keys (listed and
revoked there), and `manage.py load_tools`, which records who ran it."""
import getpass
import json

import pytest
from django.core.management import call_command
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.forms.models import model_to_dict
from django.test import Client

from ledger.models import AuditEvent, DeployKey, Membership, Tenant, Tool
from ledger.tenancy import deploy_key_create, deploy_key_authenticate


def staff(username: str, *, superuser: bool = False) -> Client:
    User = get_user_model()
    if superuser:
        user = User.objects.create_superuser(username, f"{username}@example.com", f"pw-{username}")
    else:
        user = User.objects.create_user(username, f"{username}@example.com", f"pw-{username}", is_staff=True)
        user.user_permissions.set(Permission.objects.filter(content_type__app_label="ledger"))
    client = Client()
    client.force_login(user)
    return client


def tool_form(tool: Tool, **changes) -> dict:
    data = {k: v for k, v in model_to_dict(tool).items() if k != "id"}
    data.update(changes)
    data = {k: ("" if v is None else v) for k, v in data.items()}
    for field in ("args_schema", "snapshot", "verify", "lookup", "compensation", "key_fields", "describe"):
        data[field] = json.dumps(data[field])
    return data


def test_a_staff_user_with_every_permission_cannot_change_tools_or_tenant_defaults(tools):
    client = staff("stella")
    charge = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    before = model_to_dict(charge)
    url = f"/admin/ledger/tool/{charge.pk}/change/"
    assert client.get(url).status_code == 200  # reads it
    assert b'name="_save"' not in client.get(url).content
    assert client.post(url, tool_form(charge, approval="auto")).status_code == 403
    assert client.get("/admin/ledger/tool/add/").status_code == 403
    assert model_to_dict(Tool.objects.get(pk=charge.pk)) == before
    assert Tool.objects.filter(tenant=tools.acme, name="payments.charge").count() == 1  # no new version either
    tenant_url = f"/admin/ledger/tenant/{tools.acme.pk}/change/"
    refused = client.post(tenant_url, {"name": "Acme", "approval_threshold": "critical", "approval_ttl_seconds": 99})
    assert refused.status_code == 403
    assert Tenant.objects.get(pk=tools.acme.pk).approval_threshold == "high"
    # Nor can they make themselves the tenant's admin, which would let them change its policy over the API.
    stella = get_user_model().objects.get(username="stella")
    granted = client.post("/admin/ledger/membership/add/", {"user": stella.pk, "tenant": tools.acme.pk, "role": "admin"})
    assert granted.status_code == 403
    assert not Membership.objects.filter(user=stella).exists()
    victor = Membership.objects.get(user=tools.victor)
    assert client.post(f"/admin/ledger/membership/{victor.pk}/change/", {"role": "admin"}).status_code == 403
    assert Membership.objects.get(pk=victor.pk).role == "viewer"


def test_a_superuser_changes_tool_policy_and_it_is_audited(tools):
    client = staff("root", superuser=True)
    charge = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    saved = client.post(f"/admin/ledger/tool/{charge.pk}/change/", tool_form(charge, approval="manual"))
    assert saved.status_code == 302, saved.content[:2000]
    # A change is a new version; the one the form was opened on stays as it was.
    current = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    assert (current.approval, current.version) == ("manual", charge.version + 1)
    assert Tool.objects.get(pk=charge.pk).approval == charge.approval
    assert AuditEvent.objects.filter(tenant=tools.acme, kind="tool.updated", actor="user:root").exists()


def test_deploy_keys_show_their_prefix_and_are_revoked_in_the_admin(tools):
    key, raw = deploy_key_create(tenant=tools.acme, name="ci", actor="test")
    client = staff("root", superuser=True)
    listing = client.get("/admin/ledger/deploykey/").content.decode()
    assert key.key_prefix in listing and raw not in listing
    assert client.get("/admin/ledger/deploykey/add/").status_code == 403
    done = client.post("/admin/ledger/deploykey/", {"action": "revoke", "_selected_action": [key.pk]})
    assert done.status_code == 302
    assert DeployKey.objects.get(pk=key.pk).revoked_at is not None
    assert deploy_key_authenticate(raw) is None
    assert AuditEvent.objects.filter(tenant=tools.acme, kind="deploy_key.revoked", actor="user:root").exists()


@pytest.mark.parametrize("raw", ["uwd_", "uwd_x", "uw_abc_def", "uwd_abc_def", ""])
def test_a_malformed_or_unknown_deploy_key_authenticates_nobody(tools, raw):
    assert deploy_key_authenticate(raw) is None


def test_load_tools_records_the_shell_user_as_its_actor(tools, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tenant": "acme", "tools": {"chat.post": {"executor": "client"}}}))
    call_command("load_tools", str(policy))
    event = AuditEvent.objects.filter(tenant=tools.acme, kind="tool.registered").last()
    assert event.actor == f"system:load_tools:{getpass.getuser()}"
