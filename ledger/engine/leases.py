"""Leases start on the database's clock, at the write that records them, once that write holds its locks.

A lease computed in the process before its statement runs starts too early by however long the statement then waits
for a lock (a row another transaction holds, a table locked by a migration or a backup): a claim that waited longer
than its lease was recorded already expired, and the sweep took the step away from the worker about to send it, then
counted the never-sent call as one that may have acted (issue 32). So every claim the Python path records takes its
lease here, inside its transaction, just before the write:

- on PostgreSQL, from `clock_timestamp()` read once the row the write moves is locked (taken here, for the rest of the
  transaction). A lock-only holder does not make PostgreSQL evaluate an UPDATE's SET again after the wait, so
  `SET lease = clock_timestamp() + …` alone would still start before it; the clock is read above the lock instead.
- on SQLite, from the process clock: the database is a file of this machine, whose clock it is.

The one-call functions do the same from `clock_timestamp()` after their locks, moving the lease their caller made
(from `p_at`) to start then (ledger/engine/plpgsql/unwind_propose.sql, unwind_compensated.sql).

What is written on the database's clock is judged on it (`db_now`, `now_in_sql`): the sweep's view of what is due,
a takeover's check, a due retry's claim, the sent mark's fence, and the deadlines of retries and read-backs. A
machine whose clock runs ahead or late then shifts nothing (tests/test_clock_skew.py).
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, models
from django.utils import timezone

from ledger.db import sql


def queued_seconds(tool) -> float:
    """How long a claim run by a worker task holds: the tool's timeout plus time in the queue."""
    return tool.timeout_seconds + settings.UNWIND_LEASE_SECONDS


def db_now() -> datetime:
    """The database's clock (PostgreSQL's, shared by every machine; SQLite's is this machine's), as it stands now."""
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return timezone.now()
    return sql.fetch_one("SELECT clock_timestamp()", [])[0]


def now_in_sql() -> tuple[str, list]:
    """The database's clock inside a statement: ("clock_timestamp()", []) on PostgreSQL, where every machine shares
    it; on SQLite this machine's, as a parameter. Deadlines are judged on the clock that wrote them: a process
    whose clock runs late must not find a lease it lost still its own (`attempts.mark_sent`)."""
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return "%s", [timezone.now()]
    return "clock_timestamp()", []


def lease_at_write(seconds: float | None = None, *, row: models.Model | None = None,
                   model: type[models.Model] | None = None, pk=None) -> datetime:
    """When a lease of `seconds` (UNWIND_LEASE_SECONDS unless told) ends, started now on the database's clock, after
    the lock on the row the caller is about to write (`row`, or `model` and `pk`), which this takes for the rest of
    the caller's transaction. Without a row (a new one is inserted), the clock is read as it stands now."""
    seconds = seconds or settings.UNWIND_LEASE_SECONDS
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql":
        return timezone.now() + timedelta(seconds=seconds)
    if row is not None:
        model, pk = type(row), row.pk
    started = None
    if model is not None:
        if not db.in_atomic_block:
            raise RuntimeError("a lease taken at the write needs the caller's transaction, which keeps the lock")
        table = db.ops.quote_name(model._meta.db_table)
        # The clock is read above the locking subquery: after the wait for the lock, not before it.
        started = sql.fetch_one(f"SELECT clock_timestamp() FROM (SELECT 1 FROM {table} WHERE id = %s"
                                f" FOR NO KEY UPDATE) locked", [pk])
    if started is None:  # no row to lock (the conditional write that follows finds none either)
        return db_now() + timedelta(seconds=seconds)
    return started[0] + timedelta(seconds=seconds)
