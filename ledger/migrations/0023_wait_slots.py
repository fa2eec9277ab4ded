"""Wait slots (issue 39): each agent's (or person's) waits open at once, counted where every web process sees them
(ledger/api/waits.py).

On PostgreSQL the table is UNLOGGED: a slot lives for one wait (30 s at most), so taking and giving one back need not
wait for the write-ahead log to reach the disk (two commits per wait). After a crash of the database PostgreSQL
empties the table: every slot is free again, which is what the waits, cut off with it, would have left.
"""
from django.db import migrations, models


def unlogged(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE ledger_waitslot SET UNLOGGED")


def logged(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE ledger_waitslot SET LOGGED")


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0022_limit_totals"),
    ]

    operations = [
        migrations.CreateModel(
            name="WaitSlot",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("holder", models.CharField(help_text="Whose wait: agent:<id> or user:<id>.", max_length=40)),
                ("number", models.PositiveIntegerField()),
                ("until", models.DateTimeField(help_text="When the wait ends at the latest, on the database's clock.")),
                ("token", models.CharField(help_text="Who took it: only its taker gives it back.", max_length=32)),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("holder", "number"), name="wait_slot_unique_number")],
            },
        ),
        migrations.RunPython(unlogged, logged),
    ]
