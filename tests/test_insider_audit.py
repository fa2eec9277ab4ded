"""Issue 31, finding 7: an insider cannot switch approvals off, hand out a role or rewrite an attempt unnoticed.

Each edit is made in the database with raw SQL, as someone with its credentials would, and `manage.py verify_audit`
then fails naming its check. A tenant made the README's way (create_tenant, load_tools) stores its defaults from its
creation; role memberships are fingerprinted in the chain; an attempt that says it succeeded must belong to a step
the chain recorded as succeeded.
"""
from __future__ import annotations

import importlib
from datetime import timedelta
from pathlib import Path

import pytest
from django.apps import apps
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from ledger.audit.verify import verify_chain
from ledger.models import Action, AuditHead, Membership, Tenant, TenantPolicyVersion
from ledger.engine.actions import action_reclaim
from ledger.tenancy import membership_remove
from tests.test_agent_target import client, open_run, propose
from tests.test_args_as_sent import put_tool

ROOT = Path(__file__).resolve().parent.parent


def sql(statement: str, params: list) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def verify_fails(check: str) -> str:
    with pytest.raises(CommandError) as failed:
        call_command("verify_audit")
    assert f"[check: {check}]" in str(failed.value), str(failed.value)
    return str(failed.value)


def test_a_tenant_made_the_readmes_way_cannot_have_approvals_switched_off(transactional_db):
    call_command("create_tenant", "shop")
    call_command("load_tools", str(ROOT / "sandbox" / "policy.yaml"), "--tenant", "shop")
    shop = Tenant.objects.get(slug="shop")
    assert list(TenantPolicyVersion.objects.filter(tenant=shop).values_list("version", "approval_threshold")) == \
        [(0, "high")]
    call_command("verify_audit")
    sql("UPDATE ledger_tenant SET approval_threshold = 'critical' WHERE slug = %s", ["shop"])
    assert "differ from their version 0" in verify_fails("policy")


def test_a_viewer_made_admin_in_the_database_shows(http_tools):
    call_command("verify_audit")
    sql("UPDATE ledger_membership SET role = 'admin' WHERE user_id = %s", [http_tools.victor.pk])
    assert "ledger.membership" in verify_fails("fingerprint")


def test_a_role_given_or_taken_by_the_services_verifies(http_tools):
    membership_remove(membership=Membership.objects.get(user=http_tools.victor), actor="user:ada")
    call_command("verify_audit")
    sql("INSERT INTO ledger_membership (user_id, tenant_id, role) VALUES (%s, %s, 'admin')",
        [http_tools.victor.pk, http_tools.acme.pk])
    assert "has no audit event" in verify_fails("fingerprint")


def test_a_lost_steps_attempt_edited_to_success_shows(http_tools):
    put_tool(http_tools, "desk.call", {"executor": "client", "args_schema": {"type": "object"},
                                       "compensation": "none", "timeout": 1})
    agent = client(http_tools)
    proposed = propose(agent, open_run(agent), "desk.call", {"to": "carol"})
    assert proposed.status_code == 202, proposed.text
    action = Action.objects.get(pk=proposed.json()["id"])
    Action.objects.filter(pk=action.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=5))  # lease ran out
    action_reclaim(action.pk)
    assert Action.objects.get(pk=action.pk).status == "lost"
    call_command("verify_audit")
    sql("UPDATE ledger_attempt SET outcome = 'succeeded' WHERE action_id = %s", [action.pk])
    assert f"action {action.pk} says it succeeded" in verify_fails("attempt")


def test_the_migration_records_the_defaults_and_roles_of_tenants_made_before(transactional_db, django_user_model):
    old = Tenant.objects.create(slug="old", name="Old")  # as tenant_create made them before issue 31
    AuditHead.objects.create(tenant=old)
    user = django_user_model.objects.create_user("olga", "olga@example.com", "pw")
    Membership.objects.create(tenant=old, user=user, role="approver")
    assert verify_chain(old.pk).check == "fingerprint"  # a role nobody recorded
    migration = importlib.import_module("ledger.migrations.0015_agent_keys_defaults_roles")
    migration.record_defaults_and_roles(apps, None)
    assert verify_chain(old.pk).ok
    assert TenantPolicyVersion.objects.get(tenant=old).version == 0
    sql("UPDATE ledger_membership SET role = 'admin' WHERE user_id = %s", [user.pk])
    assert verify_chain(old.pk).check == "fingerprint"
