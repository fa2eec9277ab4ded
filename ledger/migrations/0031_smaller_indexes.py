# Smaller indexes (issue 42): no (run, content_key) on actions, which no query reads; a step's audit events indexed
# by (action_ref, tenant) where it is set, deduplicated by PostgreSQL, instead of (action_ref, tenant, seq) on every event.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0030_audit_refs_with_tenant'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='action',
            name='action_run_content',
        ),
        migrations.RemoveIndex(
            model_name='auditevent',
            name='audit_action_tenant',
        ),
        migrations.AddIndex(
            model_name='auditevent',
            index=models.Index(condition=models.Q(('action_ref__isnull', False)), fields=['action_ref', 'tenant'], name='audit_action_tenant'),
        ),
    ]
