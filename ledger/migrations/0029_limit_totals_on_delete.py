"""A step deleted gives back its share of the running totals (PostgreSQL), as a step moved out of the counted
statuses does (migration 0022): archiving (ledger/archive) deletes settled runs' steps, and the totals the limits
per agent and per tenant read must go on saying what the hot steps add up to (`verify_audit` checks they do). The
same function keeps them (`unwind_limit_totals_keep`, ledger/engine/plpgsql), with the same list of counted
statuses as its arguments. SQLite keeps no totals (it reads the steps)."""
from importlib import import_module

from django.db import migrations

_0022 = import_module("ledger.migrations.0022_limit_totals")  # COUNTED as 0022 froze it: the triggers agree

TRIGGER = ("CREATE TRIGGER ledger_action_limit_totals_delete AFTER DELETE ON ledger_action FOR EACH ROW"
           f" WHEN (OLD.totalled AND OLD.kind = 'forward' AND OLD.status IN {_0022._IN})"
           f" EXECUTE FUNCTION unwind_limit_totals_keep({_0022._ARGS})")
DROP = "DROP TRIGGER IF EXISTS ledger_action_limit_totals_delete ON ledger_action"


def create_trigger(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    from ledger.engine import plpgsql

    plpgsql.install(schema_editor.connection)  # the function that now knows a delete, from its file
    schema_editor.execute(TRIGGER)


def drop_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0028_partitions"),
    ]

    operations = [
        migrations.RunPython(create_trigger, drop_trigger),
    ]
