"""Issue 31: agents' keys are separated like tenants', every tenant stores its defaults from its creation, and who
holds which role is in the audit chain.

- A run's opening key is unique per (tenant, agent, key) too (per tenant for a run no agent opened).
- `Action.key_agent`: the agent among whose keys the action's `Idempotency-Key` is; the key is unique per (tenant,
  agent, key) instead of per (tenant, key), so another agent's key is neither seen nor taken. Rows recorded before
  keep `key_agent` 0 and the key they were sent with (`Action.tool_key` is unchanged for them); their agent still
  finds them (`proposal._replay_of_key`). `unwind_propose` is redefined: its insert conflicts on the new constraint,
  and a key that a row from before (`key_agent` 0) holds sends the proposal to the Python path, which decides
  whose it is.
- `local_part_case_sensitive`, a tenant default (and in its versions): whether `Alice@…` and `alice@…` are two people
  when telling a requester from an approver; false by default.
- Each tenant without a stored defaults version gets version 0 (its defaults as they stand), chained as a
  `tenant.defaults` event; each tenant's memberships are chained (`membership.recorded`), so that `verify_audit`
  catches a role or a default changed in the database from here on.

The text of `unwind_propose` this migration once installed is gone from here (issue 40): migration 0017
installs the engine's functions from ledger/engine/plpgsql/*.sql, and git history keeps the old text.
"""
from django.db import migrations, models


def record_defaults_and_roles(apps, schema_editor):
    """Through the services (the chain's HMAC needs the audit key, which only the running code holds); a new
    database has no tenants, so nothing here runs there."""
    Tenant = apps.get_model("ledger", "Tenant")
    if not Tenant.objects.exists():
        return
    from ledger.audit.chain import ledger_transaction
    from ledger.models import Membership, Tenant as LiveTenant, TenantPolicyVersion
    from ledger.policy.versions import defaults_record_initial

    for tenant in LiveTenant.objects.order_by("pk"):
        with ledger_transaction(tenant.pk) as audit:
            if not TenantPolicyVersion.objects.filter(tenant=tenant).exists():
                defaults_record_initial(tenant=tenant, actor="system:migration", audit=audit)
            memberships = list(Membership.objects.filter(tenant=tenant).order_by("pk"))
            if memberships:
                audit.record("membership.recorded", actor="system:migration", rows=memberships,
                             roles={str(m.user_id): m.role for m in memberships})


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0014_fastpath_fewer_statements"),
    ]

    operations = [
        migrations.AddField(
            model_name="action", name="key_agent",
            field=models.PositiveBigIntegerField(default=0, help_text="The agent among whose keys `idempotency_key` is (agents are separated like tenants: another agent's keys are invisible); 0 for a run no agent opened, and for actions recorded before keys were scoped by agent (migration 0015), whose keys stay as sent.")),
        migrations.RemoveConstraint(model_name="action", name="idempotency_key_unique_per_tenant"),
        migrations.AddConstraint(
            model_name="action",
            constraint=models.UniqueConstraint(fields=("tenant", "key_agent", "idempotency_key"),
                                               name="idempotency_key_unique_per_agent")),
        migrations.RemoveConstraint(model_name="run", name="run_open_key_unique_per_tenant"),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.UniqueConstraint(
                condition=models.Q(models.Q(("open_key", ""), _negated=True), ("agent__isnull", False)),
                fields=("tenant", "agent", "open_key"), name="run_open_key_unique_per_agent")),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.UniqueConstraint(
                condition=models.Q(models.Q(("open_key", ""), _negated=True), ("agent__isnull", True)),
                fields=("tenant", "open_key"), name="run_open_key_unique_without_agent")),
        migrations.AddField(
            model_name="tenant", name="local_part_case_sensitive",
            field=models.BooleanField(default=False, help_text="Whether Alice@… and alice@… are two people when telling a requester from an approver (the domain is always case-insensitive).")),
        migrations.AddField(
            model_name="tenantpolicyversion", name="local_part_case_sensitive",
            field=models.BooleanField(default=False)),
        migrations.RunPython(record_defaults_and_roles, migrations.RunPython.noop),
    ]
