"""The engine's PostgreSQL functions are installed from their files (ledger/engine/plpgsql/*.sql) from here on, no longer
from migrations: 0010 to 0016 keep the text they installed, as history, and nothing reads it any more.

This migration installs the files' definitions (on a database 0016 left, the very same text: nothing changes). After
it, every `migrate` ends by installing whichever file differs from the database (`ledger.engine.plpgsql.install_after_migrate`,
a post_migrate step), so a change to a function is an edit of its file and no new migration.
"""
import importlib

from django.db import migrations

from ledger.engine import plpgsql

EARLIER = importlib.import_module("ledger.migrations.0016_attempt_sent_and_lease_at_commit")


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        plpgsql.install(schema_editor.connection)


def restore(apps, schema_editor):
    """Back to 0016's functions, whatever the files hold now."""
    if schema_editor.connection.vendor == "postgresql":
        plpgsql.install(schema_editor.connection,
                        {name: plpgsql.parse(name, text.lstrip("\n")) for name, text in EARLIER.FUNCTIONS.items()})


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0016_attempt_sent_and_lease_at_commit"),
    ]

    operations = [migrations.RunPython(install, restore)]
