"""What every benchmark part shares: the bench database, Django set-up, percentiles, the no-op tenant."""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG_BASE = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
BENCH_DB = os.environ.get("BENCH_DB", "unwind_bench")
DATABASE_URL = f"{PG_BASE}/{BENCH_DB}"
# DBOS's system database follows BENCH_DB, so two benchmarks on one server (CI's smoke beside a full run) never
# drop each other's: dbos_saga_sys beside the default unwind_bench, <BENCH_DB>_dbos beside any other.
DBOS_DB = os.environ.get("BENCH_DBOS_DB") or ("dbos_saga_sys" if BENCH_DB == "unwind_bench" else f"{BENCH_DB}_dbos")
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")


def psycopg_url(db: str = BENCH_DB) -> str:
    return f"{PG_BASE.replace('postgres://', 'postgresql://', 1)}/{db}"


def bench_env(**extra) -> dict:
    """The environment of every process the benchmark starts: the bench database, quiet engine settings."""
    # Persistent connections, as production runs them (README: `?conn_max_age=60`). Without them, every enqueue of
    # background work (an unwind, say) closes the connection (django-q2's ORM broker calls close_old_connections),
    # and the next saga pays for a new connection and for preparing its statements again.
    env = dict(os.environ, DATABASE_URL=f"{DATABASE_URL}?conn_max_age=600", DJANGO_SETTINGS_MODULE="config.settings",
               PYTHONPATH=str(ROOT), DEBUG="0", UNWIND_SANDBOX="0",
               UNWIND_PYTHON_TOOL_MODULES="bench.noop_tools")
    env.setdefault("UNWIND_INSECURE_DEV_KEY", "1")  # a throwaway bench database: the public development key
    env.update({k: str(v) for k, v in extra.items()})
    return env


def django_setup(**extra) -> None:
    os.environ.update(bench_env(**extra))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def summary(seconds: list[float]) -> dict:
    """p50/p95/p99 in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50": round(statistics.median(ms), 3), "p95": round(percentile(ms, 95), 3),
            "p99": round(percentile(ms, 99), 3)}


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ensure_database(name: str) -> None:
    import psycopg

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        if conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone() is None:
            conn.execute(f'create database "{name}"')


def recreate_database(name: str) -> None:
    import psycopg

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')
        conn.execute(f'create database "{name}"')


def xact_commits(name: str) -> int:
    """Transactions committed in a database so far (pg_stat_database; flushed when backends exit)."""
    import psycopg

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        row = conn.execute("select xact_commit from pg_stat_database where datname = %s", (name,)).fetchone()
    return int(row[0]) if row else 0


def wal_position() -> int:
    """The server's write-ahead log position in bytes (pg_current_wal_lsn): the difference of two is the WAL every
    database of the server wrote between them, so only what is measured may run meanwhile."""
    import psycopg

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        return int(conn.execute("select pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])


def updates_of(name: str, table: str) -> tuple[int, int]:
    """(updates, of them heap-only) of `table` in database `name` so far (pg_stat_user_tables; flushed when its
    backends are idle a second or exit). A heap-only (HOT) update changes no indexed column and writes no index."""
    import psycopg

    with psycopg.connect(psycopg_url(name), autocommit=True) as conn:
        row = conn.execute("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = %s",
                           (table,)).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def page_times(user, urls: dict[str, str], requests: int) -> dict:
    """p50/p95/p99 and the queries per request of each console page, requested in this process (Django's test
    client, `user` logged in); the first three requests of each warm caches and imports and are not counted."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    client.force_login(user)
    out = {}
    for name, url in urls.items():
        times, queries = [], set()
        for i in range(requests + 3):
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                response = client.get(url)
                seconds = time.perf_counter() - started
            if response.status_code != 200:
                out[name] = {"url": url, "error": f"HTTP {response.status_code}"}
                break
            if i >= 3:
                times.append(seconds)
                queries.add(len(captured))
        else:
            out[name] = {"url": url, **summary(times), "queries": sorted(queries)}
    return out
