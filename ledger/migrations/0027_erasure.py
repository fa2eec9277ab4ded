import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0026_archive'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='fingerprint_key',
            field=models.CharField(blank=True, default='', editable=False, help_text='A run acted for someone: the random key (hex) the chain\'s fingerprints of its rows are made under (ledger/audit/subjects.py); erasing the person blanks it. Empty for a run acted for nobody.', max_length=64),
        ),
        migrations.CreateModel(
            name='Erasure',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('erased_at', models.DateTimeField()),
                ('erased_by', models.CharField(max_length=160)),
                ('reason', models.TextField()),
                ('runs', models.PositiveIntegerField()),
                ('actions', models.PositiveIntegerField()),
                ('fields', models.PositiveIntegerField(help_text='How many stored values were replaced by the erasure marker.')),
                ('events', models.PositiveIntegerField(help_text="How many audit events were rewritten (each vouched for by the erasure's own event).")),
                ('unkeyed_events', models.PositiveIntegerField(help_text="How many of the runs' events were recorded before their fingerprints were keyed: their digests stay.")),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='ledger.tenant')),
            ],
        ),
        migrations.CreateModel(
            name='ErasedRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('erased_at', models.DateTimeField()),
                ('erasure', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='erased_runs', to='ledger.erasure')),
                ('run', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='erasure', to='ledger.run')),
                ('tenant', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='ledger.tenant')),
            ],
        ),
    ]
