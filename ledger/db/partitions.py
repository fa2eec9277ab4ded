"""Monthly partitions of the ledger's append-only tables on PostgreSQL (issue 42).

Audit events, attempts and checkpoints are written once and read mostly while their run is young: each is a table
partitioned by month on the time it was written (`PARTITIONED`), so that reads bounded by that time touch only the
recent months, and a month that archiving emptied is detached and dropped whole instead of vacuumed row by row.
Actions are not partitioned (docs/production.md#partitions says why and what it would take).

Each partitioned table has a DEFAULT partition: a row whose month has no partition of its own (the upkeep did not run
for months, a clock far off) still lands, and `ensure` moves such rows into their month's partition when it creates
it. Without it an audit append, and so every step, would fail until someone created the month. `ensure` keeps
`UNWIND_PARTITION_MONTHS_AHEAD` months ahead; the sweep calls it (`ensure_now_and_then`) at most once an hour per
process, and `manage.py partitions` does on demand.

Reads of a run's or an action's rows bound the partition key by `recent(run.created_at)` (or the action's): every such
row is written after its run or action was, so a day's margin for clocks that disagree loses nothing, and
PostgreSQL prunes every older month from the plan.

SQLite has no partitions: every function here says so (`supported`) and does nothing there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction

# table -> its partition key: the moment the row was written, never changed afterwards.
PARTITIONED = {"ledger_auditevent": "created_at", "ledger_attempt": "started_at", "ledger_checkpoint": "created_at"}
PRUNE_MARGIN = timedelta(days=1)
_LOCK = 4242_0042  # pg_advisory_xact_lock key: one upkeep at a time, whichever process runs it
_ENSURE_EVERY = 3600.0
_ensured_at: list[float | None] = [None]


def recent(written_after: datetime) -> datetime:
    """The lower bound of the partition key for rows written after `written_after` (a run's or an action's
    created_at), with a margin for the clocks of the machines that wrote them."""
    return written_after - PRUNE_MARGIN


def supported() -> bool:
    return connection.vendor == "postgresql"


def month_of(moment: datetime | date) -> date:
    return date(moment.year, moment.month, 1)


def add_months(month: date, n: int) -> date:
    index = month.year * 12 + month.month - 1 + n
    return date(index // 12, index % 12 + 1, 1)


def partition_name(table: str, month: date) -> str:
    return f"{table}_y{month.year:04d}m{month.month:02d}"


def _bound(month: date) -> str:
    return datetime(month.year, month.month, 1, tzinfo=dt_timezone.utc).isoformat()


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def is_partitioned(cursor, table: str) -> bool:
    cursor.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)", [table])
    row = cursor.fetchone()
    return bool(row and row[0])


@dataclass
class Partition:
    table: str
    name: str
    month: date | None  # None: the DEFAULT partition
    rows: int  # the planner's estimate (reltuples), -1 before the table was first analysed
    bytes: int  # pg_total_relation_size: heap, indexes and TOAST


def partitions(cursor, table: str) -> list[Partition]:
    """The table's partitions, oldest month first, the DEFAULT last."""
    cursor.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT', c.reltuples::bigint,"
        " pg_total_relation_size(c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = to_regclass(%s) ORDER BY c.relname", [table])
    found = []
    for name, is_default, rows, size in cursor.fetchall():
        month = None
        if not is_default:
            stamp = name.rsplit("_y", 1)[1]  # y2026m11, as partition_name writes it
            month = date(int(stamp[:4]), int(stamp[5:7]), 1)
        found.append(Partition(table, name, month, rows, size))
    return sorted(found, key=lambda p: (p.month is None, p.month or date.min))


def create_month(cursor, table: str, month: date) -> bool:
    """Create the month's partition of `table` if it is missing, moving into it any rows of that month the DEFAULT
    partition holds. Returns whether it created one. The caller holds a transaction."""
    name = partition_name(table, month)
    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
    if cursor.fetchone()[0]:
        return False
    key = PARTITIONED[table]
    low, high = _bound(month), _bound(add_months(month, 1))
    # Built beside the table and attached: ATTACH takes a lighter lock on the parent than CREATE … PARTITION OF, and
    # the DEFAULT partition's rows of that month must leave it before the month's range exists.
    cursor.execute(f"CREATE TABLE {_q(name)} (LIKE {_q(table)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
                   " INCLUDING STORAGE)")
    default = _q(f"{table}_default")
    cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{table}_default"])
    if cursor.fetchone()[0]:
        cursor.execute(f"WITH moved AS (DELETE FROM {default} WHERE {_q(key)} >= %s AND {_q(key)} < %s RETURNING *)"
                       f" INSERT INTO {_q(name)} SELECT * FROM moved", [low, high])
    # The range as a CHECK first, so that ATTACH finds it proven and does not scan the new table.
    cursor.execute(f"ALTER TABLE {_q(name)} ADD CONSTRAINT {_q(name + '_range')} CHECK ({_q(key)} IS NOT NULL AND "
                   f"{_q(key)} >= '{low}' AND {_q(key)} < '{high}')")
    cursor.execute(f"ALTER TABLE {_q(table)} ATTACH PARTITION {_q(name)} FOR VALUES FROM ('{low}') TO ('{high}')")
    cursor.execute(f"ALTER TABLE {_q(name)} DROP CONSTRAINT {_q(name + '_range')}")
    return True


def ensure(*, ahead: int | None = None, today: date | None = None) -> list[str]:
    """Create every partitioned table's partitions from this month to `ahead` months after it (default
    UNWIND_PARTITION_MONTHS_AHEAD). Returns the names created; [] on SQLite. Waits at most
    UNWIND_PARTITION_LOCK_TIMEOUT for the locks it needs, so that it never holds up the ledger's writers for long:
    a timeout raises (OperationalError) and the next call tries again."""
    if not supported():
        return []
    ahead = settings.UNWIND_PARTITION_MONTHS_AHEAD if ahead is None else ahead
    first = month_of(today or datetime.now(dt_timezone.utc))
    created = []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])
        _short_lock_waits(cursor)
        for table in PARTITIONED:
            if not is_partitioned(cursor, table):
                continue
            for n in range(ahead + 1):
                month = add_months(first, n)
                if create_month(cursor, table, month):
                    created.append(partition_name(table, month))
    return created


def ensure_now_and_then(now: float | None = None) -> list[str]:
    """`ensure`, at most once an hour in this process (the sweep calls it on every round)."""
    now = time.monotonic() if now is None else now
    if not supported() or (_ensured_at[0] is not None and now - _ensured_at[0] < _ENSURE_EVERY):
        return []
    _ensured_at[0] = now
    return ensure()


def _short_lock_waits(cursor) -> None:
    """For this transaction: wait for a lock at most UNWIND_PARTITION_LOCK_TIMEOUT, and never as long as PostgreSQL
    waits before it looks for a deadlock (`deadlock_timeout`, 1 s by default). Upkeep's DDL and a step's writes take
    a table's and its partitions' locks in orders that can cross (a step's cached plan locks the partitions it may
    read); if they do, upkeep's wait ends first and it gives up, so the deadlock check never runs and never picks
    the step as its victim."""
    cursor.execute("SELECT setting::int FROM pg_settings WHERE name = 'deadlock_timeout'")  # in ms
    wait = min(int(settings.UNWIND_PARTITION_LOCK_TIMEOUT * 1000), max(cursor.fetchone()[0] // 2, 1))
    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{wait}ms"])


@dataclass
class Detached:
    name: str
    dropped: bool
    why: str


def detach_before(month: date, *, today: date | None = None) -> list[Detached]:
    """Detach and drop every month partition older than `month` that holds no row (archiving removed them); one that
    still holds rows is left in place and named, with why. Never the current month or later, never the DEFAULT.
    Nothing is rewritten: an empty partition is detached from its table, then dropped.

    Each table in a transaction of its own that locks the table itself first (ACCESS EXCLUSIVE, within
    UNWIND_PARTITION_LOCK_TIMEOUT): a writer locks the table before the partition its row goes to, so taking a
    partition first deadlocked with a step appending its events (found by bench/years.py's archive part). While it
    holds the lock, no row can arrive between the look and the drop; writers wait the few milliseconds it takes.
    The partition is dropped where it is attached, not DETACHed first: DETACH turns the partition's inherited foreign
    keys into its own, creating their triggers on the referenced table (SHARE ROW EXCLUSIVE on ledger_action for an
    attempt's month) and DROP then removes them (ACCESS EXCLUSIVE there), while a step holds ledger_action and waits
    for ledger_attempt: each time the bench's saga ran beside the pass, attempts and checkpoints came out "busy" and
    kept their emptied months. Dropping an attached partition locks only the partition and its parent.
    A table that stays busy past the timeout is skipped and named: the next pass takes it."""
    from django.db import OperationalError

    if not supported():
        return []
    current = month_of(today or datetime.now(dt_timezone.utc))
    month = min(month, current)
    done = []
    for table in PARTITIONED:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])
                if not is_partitioned(cursor, table):
                    continue
                old = [part for part in partitions(cursor, table) if part.month is not None and part.month < month]
                if not old:
                    continue
                _short_lock_waits(cursor)
                cursor.execute(f"LOCK TABLE {_q(table)} IN ACCESS EXCLUSIVE MODE")
                for part in old:
                    cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {_q(part.name)})")
                    if cursor.fetchone()[0]:
                        done.append(Detached(part.name, False, "still holds rows: archive its runs first"))
                        continue
                    cursor.execute(f"DROP TABLE {_q(part.name)}")  # attached: see the docstring
                    done.append(Detached(part.name, True, "empty: detached and dropped"))
        except OperationalError as exc:
            if "lock timeout" not in str(exc):
                raise
            done.append(Detached(table, False, "busy (a lock wait cut short): the next pass takes it"))
    return done


def convert(cursor, table: str, *, ahead: int, today: date) -> None:
    """Turn a plain table into one partitioned by month on PARTITIONED[table], rows and all (migration 0028).

    The rows are copied once under the migration's lock. The primary key becomes (id, key) and each unique
    constraint gains the key, as PostgreSQL requires of a partitioned table; `id` keeps its sequence (now owned by
    the column instead of an identity), so ids go on where they were. Indexes and foreign keys come back with
    their names. Column order is kept (the engine's functions insert `SELECT *` of a row of the table's type)."""
    if is_partitioned(cursor, table):
        return
    key = PARTITIONED[table]
    cursor.execute("SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint"
                   " WHERE conrelid = to_regclass(%s) AND contype IN ('u', 'f') ORDER BY conname", [table])
    constraints = cursor.fetchall()
    cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = %s"
                   " ORDER BY indexname", [table])
    backing = {name for name, kind, _ in constraints if kind == "u"} | {f"{table}_pkey"}
    indexes = [definition for name, definition in cursor.fetchall() if name not in backing]
    cursor.execute(f"SELECT min({_q(key)}), max(id) FROM {_q(table)}")
    oldest, last_id = cursor.fetchone()
    old = f"{table}__unpartitioned"
    cursor.execute(f"ALTER TABLE {_q(table)} RENAME TO {_q(old)}")
    cursor.execute(f"CREATE TABLE {_q(table)} (LIKE {_q(old)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
                   f" INCLUDING STORAGE)"
                   f" PARTITION BY RANGE ({_q(key)})")
    cursor.execute(f"CREATE TABLE {_q(table + '_default')} PARTITION OF {_q(table)} DEFAULT")
    month = min(month_of(oldest), month_of(today)) if oldest else month_of(today)
    while month <= add_months(month_of(today), ahead):
        create_month(cursor, table, month)
        month = add_months(month, 1)
    cursor.execute(f"INSERT INTO {_q(table)} SELECT * FROM {_q(old)}")
    cursor.execute(f"DROP TABLE {_q(old)}")  # and its identity sequence, its indexes and constraints
    sequence = f"{table}_id_seq"
    cursor.execute(f"CREATE SEQUENCE {_q(sequence)} AS bigint OWNED BY {_q(table)}.id")
    if last_id is not None:
        cursor.execute("SELECT setval(%s, %s)", [sequence, last_id])
    cursor.execute(f"ALTER TABLE {_q(table)} ALTER COLUMN id SET DEFAULT nextval('{sequence}'::regclass)")
    cursor.execute(f"ALTER TABLE {_q(table)} ADD CONSTRAINT {_q(table + '_pkey')} PRIMARY KEY (id, {_q(key)})")
    for name, kind, definition in constraints:
        if kind == "u":
            definition = definition.rstrip(")") + f", {_q(key)})"
        cursor.execute(f"ALTER TABLE {_q(table)} ADD CONSTRAINT {_q(name)} {definition}")
    for definition in indexes:
        cursor.execute(definition)
