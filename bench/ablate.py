"""What each part of the ok saga's database work costs: the replayed calls (bench/replay.py) with one part taken away
at a time, in a database of its own (`unwind_ablate`, dropped and created afresh; never the bench's).

    python -m bench.ablate [sagas per round] [rounds]

Each variant is timed by turns with the floor's sagas of the same number of commits, so that the machine's drift
hits both; the figure is the variant's p50 against the floor's p50 from the same rounds. The statement variants (no
guard, no events) alternate with the full calls in the same rounds; the schema variants (no foreign keys, no check
constraints, only the indexes the functions' own checks use) are cumulative, each after the one above it, and the
last takes the guard and the events away too. It only measures: nothing here is a way to run Unwind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DB = "unwind_ablate"
os.environ["BENCH_DB"] = DB  # before bench.common reads it: every connection here is to this database

from bench.common import ROOT, bench_env, log, psycopg_url, summary

TABLES = ("ledger_action", "ledger_attempt", "ledger_auditevent", "ledger_audithead", "ledger_run", "ledger_checkpoint")
# The action's indexes that no check of the functions reads: they serve the pages, the sweeps and the foreign keys.
SECONDARY = ("action_retry_due", "action_running_lease", "action_tenant_recent", "ledger_action_tool_id_b0f187f1",
             "action_compensates", "action_repeats", "audit_action_tenant", "audit_run_tenant", "ledger_checkpoint_run_id_d77c18d4",
             "ledger_checkpoint_tenant_id_e1432512", "run_recent", "run_status_idle", "run_status_lease",
             "run_tenant_recent", "ledger_run_agent_id_02feb8c8")


def fresh_database() -> None:
    import psycopg

    with psycopg.connect(psycopg_url("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=str(ROOT), env=bench_env(), check=True)


def constraints(conn, kind: str) -> list[tuple[str, str]]:
    return conn.execute("SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE contype = %s"
                        " AND conrelid::regclass::text = ANY (%s)", [kind, list(TABLES)]).fetchall()


def main() -> None:
    per_round = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    fresh_database()
    from bench.common import django_setup

    django_setup(UNWIND_TASKS_SYNC="0")
    import psycopg

    from bench import replay
    from bench.engine import Saga, tenant_with_tools
    from bench.pgfloor import Floor

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000
    for i in range(10):
        saga.onboard(base + i, False)
    for i in range(10):
        saga.onboard(base + 50 + i, True)
    players = {case: replay.Replay(replay.record(saga, base + 100 + fail, fail))
               for case, fail in (("ok", False), ("fail", True))}
    floor = Floor(psycopg_url(DB))

    def called(sql: str) -> bool:
        return sql.startswith("SELECT CASE WHEN")  # a function's call (the failing saga also reads once)

    def unguarded(statements):
        return [("SELECT " + s.split(" THEN ", 1)[1].rsplit(" END", 1)[0] if called(s) else s, p)
                for s, p in statements]

    def eventless(statements):
        return [(s, [*p[:-1], "[]"] if called(s) else p) for s, p in statements]

    def measure(variants: dict) -> dict:
        results = {}
        for case, player in players.items():
            times = {name: [] for name in (*variants, "floor")}
            for _ in range(rounds):
                for name, change in variants.items():
                    for statements in player.prepare(per_round):
                        statements = change(statements)
                        started = time.perf_counter()
                        player.saga(statements)
                        times[name].append(time.perf_counter() - started)
                times["floor"] += floor.timed(player.commits, per_round)
            out = {name: summary(values)["p50"] for name, values in times.items()}
            results[case] = {name: {"p50_ms": p50, "x_floor": round(p50 / out["floor"], 2)}
                             for name, p50 in out.items()}
        return results

    same = lambda statements: statements  # noqa: E731
    for player in players.values():
        for statements in player.prepare(10):
            player.saga(statements)
        floor.timed(player.commits, 10)
    results = {}
    log("ablate: the calls as sent, without the guard, without events")
    results["statements"] = measure({"calls": same, "no guard": unguarded, "no events": eventless,
                                     "no guard, no events": lambda s: eventless(unguarded(s))})
    admin = psycopg.connect(psycopg_url(DB), autocommit=True)
    for label, drop in (
            ("no foreign keys", [f"ALTER TABLE {t} DROP CONSTRAINT {c}" for t, c in constraints(admin, "f")]),
            ("and no check constraints", [f"ALTER TABLE {t} DROP CONSTRAINT {c}" for t, c in constraints(admin, "c")]),
            ("and only the indexes the checks read", [f"DROP INDEX IF EXISTS {i}" for i in SECONDARY])):
        for statement in drop:
            admin.execute(statement)
        for player in players.values():  # the plans the change invalidated are made again
            for statements in player.prepare(10):
                player.saga(statements)
        log(f"ablate: {label}")
        results[label] = measure({"calls": same})
    log("ablate: all of it, and no guard and no events either")
    results["all of it, and no guard and no events"] = measure({"calls": lambda s: eventless(unguarded(s))})
    admin.close()
    for player in players.values():
        player.close()
    floor.close()
    commits = {case: player.commits for case, player in players.items()}
    print(json.dumps({"commits": commits, "per_round": per_round, "rounds": rounds, **results}, indent=1))


if __name__ == "__main__":
    main()
