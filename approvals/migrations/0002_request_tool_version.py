# Approval requests bind to the tool version they were requested under; existing ones to their action's tool.

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def bind_existing_requests(apps, schema_editor):
    ApprovalRequest = apps.get_model("approvals", "ApprovalRequest")
    Action = apps.get_model("ledger", "Action")
    ApprovalRequest.objects.filter(tool__isnull=True).update(
        tool=Subquery(Action.objects.filter(pk=OuterRef("action_id")).values("tool_id")[:1]))


class Migration(migrations.Migration):

    dependencies = [
        ('approvals', '0001_initial'),
        ('ledger', '0005_tool_versions'),
    ]

    operations = [
        migrations.AddField(
            model_name='approvalrequest',
            name='tool',
            field=models.ForeignKey(help_text='The tool version (policy) the request was made under.', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='ledger.tool'),
        ),
        migrations.AlterField(
            model_name='approvalrequest',
            name='status',
            field=models.CharField(choices=[('pending', 'pending'), ('approved', 'approved'), ('rejected', 'rejected'), ('expired', 'expired'), ('withdrawn', 'withdrawn'), ('voided', 'voided')], default='pending', max_length=16),
        ),
        migrations.RunPython(bind_existing_requests, migrations.RunPython.noop),
    ]
