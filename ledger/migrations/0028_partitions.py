"""Audit events, attempts and checkpoints partitioned by month on PostgreSQL (issue 42; ledger/db/partitions.py).

Converts an existing database, rows and all: each table is rebuilt as a table partitioned by range of the time its
rows were written, with a partition per month from its oldest row's to UNWIND_PARTITION_MONTHS_AHEAD months after
this one, and a DEFAULT partition; its rows are copied once (under this migration's lock: a large ledger wants a
maintenance window, docs/production.md#partitions). Its primary key becomes (id, key) and each unique constraint
gains the key, as PostgreSQL requires; Django's model state does not change (the models still name `id` as the
primary key, and ids stay unique: one sequence gives them all). The engine's functions are written again, as they
are, so that every open session compiles them against the new tables. SQLite is left as it is.

Going back leaves the tables partitioned: the earlier code reads and writes them the same way.
"""
from datetime import datetime, timezone as dt_timezone

from django.conf import settings
from django.db import migrations

from ledger.db import partitions
from ledger.engine import plpgsql


def partition(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    today = datetime.now(dt_timezone.utc).date()
    with schema_editor.connection.cursor() as cursor:
        for table in partitions.PARTITIONED:
            partitions.convert(cursor, table, ahead=settings.UNWIND_PARTITION_MONTHS_AHEAD, today=today)
        # A session that ran the engine's functions before keeps them compiled against the old tables' row types
        # ("cache lookup failed for type …" at its next step, until it reconnects): written again, unchanged, they
        # are compiled afresh in every session.
        for function in plpgsql.functions().values():
            cursor.execute(function.text)


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0027_erasure"),
    ]

    operations = [
        migrations.RunPython(partition, migrations.RunPython.noop, elidable=False),
    ]
