# Every tool row becomes one immutable policy version: existing rows are version 1 and current (the field defaults).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0004_deploykey'),
    ]

    operations = [
        migrations.CreateModel(
            name='TenantPolicyVersion',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('version', models.PositiveIntegerField()),
                ('approval_threshold', models.CharField(choices=[('low', 'low'), ('medium', 'medium'), ('high', 'high'), ('critical', 'critical')], max_length=16)),
                ('approval_ttl_seconds', models.PositiveIntegerField()),
                ('actor', models.CharField(max_length=160)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'ordering': ['tenant_id', '-version'],
            },
        ),
        migrations.AlterModelOptions(
            name='tool',
            options={'ordering': ['name', '-version']},
        ),
        migrations.RemoveConstraint(
            model_name='tool',
            name='tool_name_unique_per_tenant',
        ),
        migrations.AddField(
            model_name='action',
            name='defaults_version',
            field=models.PositiveIntegerField(default=0, help_text="The tenant's defaults version it was proposed under (0: as the tenant was created)."),
        ),
        migrations.AddField(
            model_name='tool',
            name='actor',
            field=models.CharField(blank=True, help_text='Who wrote this version.', max_length=160),
        ),
        migrations.AddField(
            model_name='tool',
            name='is_current',
            field=models.BooleanField(default=True),
        ),
        migrations.AddField(
            model_name='tool',
            name='version',
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.AddConstraint(
            model_name='tool',
            constraint=models.UniqueConstraint(fields=('tenant', 'name', 'version'), name='tool_version_unique'),
        ),
        migrations.AddConstraint(
            model_name='tool',
            constraint=models.UniqueConstraint(condition=models.Q(('is_current', True)), fields=('tenant', 'name'), name='one_current_tool_version'),
        ),
        migrations.AddField(
            model_name='tenantpolicyversion',
            name='tenant',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='policy_versions', to='ledger.tenant'),
        ),
        migrations.AddConstraint(
            model_name='tenantpolicyversion',
            constraint=models.UniqueConstraint(fields=('tenant', 'version'), name='tenant_policy_version_unique'),
        ),
    ]
