"""The engine's PostgreSQL functions are installed from their files (ledger/engine/plpgsql/*.sql), not from
migrations: on a fresh database this is the first migration that creates them; on one that ran the old migrations'
text (0010 to 0016, which held it until issue 40 took it out), it replaces that text with the files'.

After it, every `migrate` ends by installing whichever file differs from the database (`ledger.engine.plpgsql.
install_after_migrate`, a post_migrate step), so a change to a function is an edit of its file and no new migration.
Back past it, the database holds no engine function, and the engine takes its Python path (`fastpath` trusts
nothing it cannot fingerprint).
"""
from django.db import migrations

from ledger.engine import plpgsql


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        plpgsql.install(schema_editor.connection)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        plpgsql.install(schema_editor.connection, {})


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0016_attempt_sent_and_lease_at_commit"),
    ]

    operations = [migrations.RunPython(install, drop)]
