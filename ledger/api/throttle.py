"""The agent-key throttle: each agent key may make UNWIND_THROTTLE_RATE requests (REST and MCP together), decided in
the database, so that every web process on every machine counts the same ones.

It is a generic cell rate algorithm (GCRA, as in redis-cell): for a rate of N requests per D seconds, a key may make
a burst of N at once, then one every T = D/N seconds, N per D on average. A key's state is one number, its
theoretical arrival time (`tat`): a request at `now` is let through when max(tat, now) + T - now <= D, which moves
`tat` on to max(tat, now) + T; a refused request changes nothing. `AgentThrottle` holds one row per key.

One statement per request decides it: an INSERT of a fresh row, or on a conflict an UPDATE under the guard,
RETURNING the new `tat` (no row returned: refused). Only a refused request reads the row once more, for its
Retry-After. It runs in autocommit, its own statement on the request's connection, so the row is locked for that
statement only: a key's requests on several processes wait on each other for microseconds, never for a request.

Times are whole microseconds, in integers (T rounded to one, D taken as N * T): the guard compares exactly, so a
burst is exactly N at any rate, where floats summed N times can drift by an ulp and refuse the Nth. Rewritten with
the burst, the guard is `tat <= now + (N - 1) * T`: Python works out that bound and the new values, the statement
only compares and picks.

Whose clock: the web process's (`time.time()`), sent with the statement. Several machines may run web processes,
and their clocks differ by a few milliseconds under NTP: a machine s seconds ahead of the others lets a key make at
most s/T requests more, once, and the average stays N per D, since every request let through moves `tat` on by T
whichever clock it read. A clock s seconds behind (or one that steps back) makes the key wait s longer, no more.
The database's clock (PostgreSQL's clock_timestamp()) would remove the skew, at the cost of the arithmetic moving
into each vendor's SQL (SQLite's clock is this machine's anyway) and of a decision no test can set the time of; for
sharing the server fairly a few milliseconds do not matter.
"""
from __future__ import annotations

from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from rest_framework import throttling

from ledger.models import Agent, AgentThrottle

MICROSECONDS = 1_000_000


@lru_cache(maxsize=None)
def _statements(vendor: str) -> tuple[str, str]:
    """The upsert under its guard, and the read a refusal makes. Both vendors (PostgreSQL, SQLite 3.35+) take
    INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING as written; max(tat, now) is a CASE, the same in both."""
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    table, key, tat = quote(AgentThrottle._meta.db_table), quote("key"), quote("tat")
    take = (f"INSERT INTO {table} ({key}, {tat}) VALUES (%s, %s) ON CONFLICT ({key}) DO UPDATE "
            f"SET {tat} = CASE WHEN {table}.{tat} > %s THEN {table}.{tat} + %s ELSE %s END "
            f"WHERE {table}.{tat} <= %s RETURNING {tat}")
    read = f"SELECT {tat} FROM {table} WHERE {key} = %s"
    return take, read


def _connection():
    db = connections[DEFAULT_DB_ALIAS]
    if db.in_atomic_block and not db.atomic_blocks[-1]._from_testcase:
        # Inside a transaction the key's row would stay locked until it ends, and the key's requests on every
        # process would wait for it. A test's own rolled-back transaction (pytest-django's `db`, marked as Django's
        # durable check reads it) is let be: no other connection uses the row meanwhile.
        raise RuntimeError("the agent-key throttle runs in autocommit, outside any transaction: it is called "
                           "inside one (ATOMIC_REQUESTS, or an atomic block around the view)")
    return db


def agent_throttle_take(*, key: str, now: int, interval: int, burst: int) -> bool:
    """Whether `key`'s request at `now` is let through, at one request per `interval` after a burst of `burst`
    (microseconds; burst >= 1). Let through, it moved the key's `tat` on by one interval; refused, it wrote nothing."""
    db = _connection()
    take, _ = _statements(db.vendor)
    with db.cursor() as cursor:
        cursor.execute(take, [key, now + interval, now, interval, now + interval, now + (burst - 1) * interval])
        return cursor.fetchone() is not None


def agent_throttle_wait(*, key: str, now: int, interval: int, burst: int) -> int:
    """Microseconds until `key`'s next request would be let through (0: it would now)."""
    db = _connection()
    _, read = _statements(db.vendor)
    with db.cursor() as cursor:
        cursor.execute(read, [key])
        row = cursor.fetchone()
    return 0 if row is None else max(0, row[0] - now - (burst - 1) * interval)


class AgentKeyThrottle(throttling.SimpleRateThrottle):
    """Requests per agent key, at UNWIND_THROTTLE_RATE (e.g. 6000/min): a burst of that many, then that many per
    period on average (GCRA, above). People are not throttled here.

    Counted in the database, as every decision that must hold across web processes is: the request path depends on
    no other server, and the throttle answers whenever the database does. (It was kept in Django's cache: each
    process's own memory, so four workers let a key make four times its rate, or Redis, which let every key through
    unthrottled while Redis did not answer.) A rate of 0 refuses every agent request.

    Cost on PostgreSQL, a loop of calls on a loaded 2-core machine: 130-240 µs a request let through, where a
    `SELECT 1` took 60-135 µs; 225-310 µs a refusal (it reads the row again). The cache cost 15-30 µs in a process's
    memory, 280-520 µs on Redis (a read and a write)."""

    scope = "agent"

    def allow_request(self, request, view) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = round(self.timer() * MICROSECONDS)
        if self.num_requests == 0:
            return False
        # At least a microsecond: a rate past a million a second is a burst of N per microsecond.
        self.interval = max(1, round(self.duration * MICROSECONDS / self.num_requests))
        return agent_throttle_take(key=self.key, now=self.now, interval=self.interval, burst=self.num_requests)

    def wait(self) -> float:
        """Seconds until the key's next request would be let through (DRF rounds it up for Retry-After)."""
        if self.num_requests == 0:
            return float(self.duration)
        waited = agent_throttle_wait(key=self.key, now=self.now, interval=self.interval, burst=self.num_requests)
        return max(waited, 1) / MICROSECONDS

    def get_rate(self) -> str:
        rate = settings.UNWIND_THROTTLE_RATE
        number, _, period = rate.partition("/")
        if not number.strip().isdigit() or period.strip()[:1] not in ("s", "m", "h", "d"):
            raise ImproperlyConfigured(f"UNWIND_THROTTLE_RATE must look like 6000/min or 20/s, not {rate!r}.")
        return f"{int(number)}/{period.strip()}"

    def get_cache_key(self, request, view) -> str | None:
        """The key's row: its prefix, the same ident the cache key was made of."""
        if not isinstance(request.auth, Agent):
            return None
        return request.auth.key_prefix
