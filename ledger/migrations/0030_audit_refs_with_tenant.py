# The indexes by run and by step carry the tenant (issue 40; ledger/models.py AuditEvent.Meta).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0029_limit_totals_on_delete'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='auditevent',
            name='audit_run',
        ),
        migrations.RemoveIndex(
            model_name='auditevent',
            name='audit_action',
        ),
        migrations.AddIndex(
            model_name='auditevent',
            index=models.Index(fields=['run_ref', 'tenant', 'seq'], name='audit_run_tenant'),
        ),
        migrations.AddIndex(
            model_name='auditevent',
            index=models.Index(fields=['action_ref', 'tenant', 'seq'], name='audit_action_tenant'),
        ),
    ]
