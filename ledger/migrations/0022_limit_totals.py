"""Running totals for limits per agent and per tenant (issue 28), kept by triggers on PostgreSQL.

A limit per agent or per tenant read every step of its scope and window: its cost grew with the traffic it limits.
On PostgreSQL it now reads totals (ledger_limittotal, per measure, scope and time bucket) that triggers keep: on
ledger_action, a forward step of a tool with such totals (`totalled`) recorded in, or moving into or out of, the
statuses that count moves its share (`unwind_limit_totals_keep`); on ledger_run, a run whose agent changed drops
the totals per agent, to be built again (`unwind_limit_totals_forget`). Their functions live in
ledger/engine/plpgsql like the engine's others; a trigger's function is replaced in place there, so these triggers
stay.

COUNTED is ledger/policy/limits.py's list as this migration made it (the trigger's WHEN and its arguments, so the
function holds no copy); tests/test_limit_totals.py fails when the two differ, and a change of it is a new
migration. SQLite keeps no totals (it reads the steps).
"""
import django.db.models.deletion
import ledger.models
from django.db import migrations, models

from ledger.engine import plpgsql

COUNTED = ("planned", "awaiting_approval", "approved", "held", "running", "retry_scheduled", "succeeded", "lost",
           "compensating", "compensation_failed")
_IN = "({})".format(", ".join(f"'{status}'" for status in COUNTED))
_ARGS = ", ".join(f"'{status}'" for status in COUNTED)

# A call of a trigger's function costs ~35 µs here even when it returns at once, and a WHEN clause that reads several
# columns of each moved row cost part 1's saga 5-7 % (bench/ab.py): only a step marked `totalled` (its tool keeps
# such totals; ledger/engine/decision.bind, unwind_limit_measure) calls them, and an update only when its status
# crosses in or out of the counted ones. A step's other columns that the totals read never change once recorded.
TRIGGERS = [
    "CREATE TRIGGER ledger_action_limit_totals_insert AFTER INSERT ON ledger_action FOR EACH ROW"
    f" WHEN (NEW.totalled AND NEW.kind = 'forward' AND NEW.status IN {_IN})"
    f" EXECUTE FUNCTION unwind_limit_totals_keep({_ARGS})",
    "CREATE TRIGGER ledger_action_limit_totals_update AFTER UPDATE OF status ON ledger_action FOR EACH ROW"
    f" WHEN (OLD.totalled AND OLD.kind = 'forward' AND (OLD.status IN {_IN}) <> (NEW.status IN {_IN}))"
    f" EXECUTE FUNCTION unwind_limit_totals_keep({_ARGS})",
    "CREATE TRIGGER ledger_run_limit_totals_agent AFTER UPDATE OF agent_id ON ledger_run FOR EACH ROW"
    " WHEN (OLD.agent_id IS DISTINCT FROM NEW.agent_id) EXECUTE FUNCTION unwind_limit_totals_forget()",
]
DROPS = ["DROP TRIGGER IF EXISTS ledger_action_limit_totals_insert ON ledger_action",
         "DROP TRIGGER IF EXISTS ledger_action_limit_totals_update ON ledger_action",
         "DROP TRIGGER IF EXISTS ledger_run_limit_totals_agent ON ledger_run"]


def create_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    plpgsql.install(schema_editor.connection)  # the triggers' functions, from their files
    for statement in TRIGGERS:
        schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for statement in DROPS:
        schema_editor.execute(statement)


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0021_rules_tool_rules_limits'),
    ]

    operations = [
        migrations.CreateModel(
            name='LimitMeasure',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('tool_name', models.CharField(max_length=120)),
                ('per', models.CharField(max_length=8)),
                ('path', models.CharField(blank=True, default='', max_length=200)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('tenant', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='ledger.tenant')),
            ],
        ),
        migrations.CreateModel(
            name='LimitTotal',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('scope', models.BigIntegerField()),
                ('span', models.PositiveIntegerField()),
                ('bucket', models.DateTimeField()),
                ('value', ledger.models.ExactNumber(default=0)),
                ('measure', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='ledger.limitmeasure')),
            ],
        ),
        migrations.AddConstraint(
            model_name='limitmeasure',
            constraint=models.UniqueConstraint(fields=('tenant', 'tool_name', 'per', 'path'), name='limit_measure_unique'),
        ),
        migrations.AddConstraint(
            model_name='limittotal',
            constraint=models.UniqueConstraint(fields=('measure', 'scope', 'span', 'bucket'), name='limit_total_unique'),
        ),
        migrations.AddField(
            model_name='action',
            name='totalled',
            field=models.BooleanField(db_default=False, default=False, help_text="Its tool keeps running totals for a limit per agent or per tenant (PostgreSQL; migration 0022): set when it is proposed under such a limit, or when such totals are built. Only such a step's moves call the triggers that keep them."),
        ),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
