"""The audit chain's two hashes stored as their 32 bytes on PostgreSQL (issue 42; ledger/models.py HexDigestField).

Each event's `prev_hash` and `hash` were 64 hex digits of text (65 bytes a column); as bytea they take 33: 64 bytes
an event, about 190 an action. Python, SQLite, the HMACs, archive segments and signed heads keep the hex text: the
field converts at the column, so what every hash covers, and so every existing chain, is unchanged. The tables are
rewritten once (each monthly partition), under this migration's lock, as migration 0028 did. A hash that is not hex
(only a row edited behind the services' back holds one) stops the migration with its tenant and number: `manage.py
verify_audit` names what happened to it. Going back turns the bytes into the same hex text again. SQLite is left as it
is (its column stays text).
"""
from django.db import migrations

import ledger.models

NOT_HEX = ("SELECT tenant_id, seq FROM ledger_auditevent WHERE prev_hash !~ '^([0-9a-f]{2})*$' OR hash !~ "
           "'^([0-9a-f]{2})*$' ORDER BY tenant_id, seq LIMIT 1")


def _column_type(cursor) -> str:
    cursor.execute("SELECT data_type FROM information_schema.columns WHERE table_name = 'ledger_auditevent'"
                   " AND column_name = 'hash'")
    return cursor.fetchone()[0]


def to_bytes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        if _column_type(cursor) == "bytea":  # already (tests/test_partitions.py converts an older schema so)
            return
        cursor.execute(NOT_HEX)
        found = cursor.fetchone()
        if found:
            raise RuntimeError(f"audit event #{found[1]} of tenant {found[0]} has a hash that is not lowercase hex, "
                               "which no service writes: run `manage.py verify_audit` and restore it before migrating")
        cursor.execute("ALTER TABLE ledger_auditevent"
                       " ALTER COLUMN prev_hash TYPE bytea USING decode(prev_hash, 'hex'),"
                       " ALTER COLUMN hash TYPE bytea USING decode(hash, 'hex')")


def to_text(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        if _column_type(cursor) != "bytea":
            return
        cursor.execute("ALTER TABLE ledger_auditevent"
                       " ALTER COLUMN prev_hash TYPE varchar(64) USING encode(prev_hash, 'hex'),"
                       " ALTER COLUMN hash TYPE varchar(64) USING encode(hash, 'hex')")


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0031_smaller_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(to_bytes, to_text, elidable=False)],
            state_operations=[
                migrations.AlterField(model_name="auditevent", name="prev_hash",
                                      field=ledger.models.HexDigestField()),
                migrations.AlterField(model_name="auditevent", name="hash", field=ledger.models.HexDigestField()),
            ],
        ),
    ]
