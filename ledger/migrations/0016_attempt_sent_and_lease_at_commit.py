"""Sent or not, known: an attempt records when its request left Unwind (`sent_at`, written only for tools that ignore
idempotency keys, just before the call, under the lease) and who decided to send it again after an unknown outcome
(`resend_by`); and a proposal's lease runs from the database's clock once its locks are held.

Every attempt recorded before this migration is taken as sent (`sent_at` = its start): nothing then said otherwise,
and a step is never sent again on the guess that it was not.

`unwind_propose` (0014, 0015) computed nothing itself: the action's lease came in its row, decided before the call, so a
proposal that waited on the chain head's or the run's lock longer than its lease was inserted already expired, and
the sweep reclaimed a step its caller was about to send. Now the lease is the same length (the row's lease less the
moment the caller decided it, `p_at`) from `clock_timestamp()` after the locks; the Python path decides it after the
same locks (`proposal._record`). Nothing else in the function changes, nor its arguments or answers.

The text of `unwind_propose` this migration once changed is gone from here (issue 40): migration 0017
installs the engine's functions from ledger/engine/plpgsql/*.sql, and git history keeps the old text.
"""
from django.db import migrations, models
from django.db.models import F


def every_earlier_attempt_sent(apps, schema_editor):
    apps.get_model("ledger", "Attempt").objects.filter(sent_at__isnull=True).update(sent_at=F("started_at"))


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0015_agent_keys_defaults_roles"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt", name="sent_at",
            field=models.DateTimeField(blank=True, null=True, help_text=(
                "When the request left Unwind (tools that ignore idempotency keys); empty: never sent."))),
        migrations.AddField(
            model_name="attempt", name="resend_by",
            field=models.CharField(blank=True, default="", db_default="", max_length=160, help_text=(
                "Who decided, after an unknown outcome, that the tool did not act and the step is sent again."))),
        migrations.RunPython(every_earlier_attempt_sent, migrations.RunPython.noop),
    ]
