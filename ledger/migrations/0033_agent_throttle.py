"""The agent-key throttle's state in the database (ledger/api/throttle.py), where every web process sees it; it was
kept in Django's cache, each process's own memory unless Redis was set.

On PostgreSQL the table is UNLOGGED: a row changes on every agent request, and the change need not wait for the
write-ahead log to reach the disk. After a crash of the database PostgreSQL empties the table, and each key may make
a full burst again: the cost of a crash is one burst per key, never a refusal.
"""
from django.db import migrations, models


def unlogged(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE ledger_agentthrottle SET UNLOGGED")


def logged(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE ledger_agentthrottle SET LOGGED")


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0032_audit_hashes_as_bytes"),
    ]

    operations = [
        migrations.CreateModel(
            name="AgentThrottle",
            fields=[
                ("key", models.CharField(help_text="The agent key's prefix (Agent.key_prefix).", max_length=16,
                                         primary_key=True, serialize=False)),
                ("tat", models.BigIntegerField(help_text="Theoretical arrival time: microseconds since the Unix "
                                                         "epoch, on the web processes' clocks.")),
            ],
        ),
        migrations.RunPython(unlogged, logged),
    ]
