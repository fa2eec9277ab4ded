"""Part 1 and 3: the engine in process, on PostgreSQL.

- the 3-step onboarding saga of seed 001 (create user, provision, send email), succeeding, and failing
  at step 3 so that two compensations run newest-first, driven exactly as the API's fast path drives
  it: `action_propose` → `execution.execute` → (on failure) `execution.unwind`;
- the unwind of a 10-step run whose step 10 fails: from the failure to all nine compensations recorded.
Prints one JSON object on stdout.
"""
from __future__ import annotations

import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import QUICK, django_setup, log, summary, timed

TENANT = "bench-engine"
ACTOR = "agent:bench"


def tenant_with_tools(slug: str = TENANT):
    from bench.noop_tools import POLICY
    from ledger.models import Agent, Tenant
    from ledger.tenancy import agent_create, tenant_create
    from ledger.policy.versions import tool_upsert

    tenant = Tenant.objects.filter(slug=slug).first() or tenant_create(slug=slug, name=slug)
    agent = Agent.objects.filter(tenant=tenant, name="bench").first()
    key = None
    if agent is None:
        agent, key = agent_create(tenant=tenant, name="bench")
    for name in sorted(POLICY, key=lambda n: "compensation" in POLICY[n]):  # twins before the tools that name them
        tool_upsert(tenant=tenant, name=name, spec=POLICY[name], actor="bench")
    return tenant, agent, key


class Saga:
    """Drive runs through the services exactly as tests/helpers.py and the API fast path do: the proposal
    claims the action, the same caller executes it (`sole_owner`: the lease is its own), and a failure
    is unwound by the caller."""

    def __init__(self, tenant, agent):
        from ledger.engine import execution
        from ledger.engine.proposal import action_propose
        from ledger.engine.runs import run_complete, run_open

        self.tenant, self.agent = tenant, agent
        self.execution, self.propose, self.run_open, self.run_complete = execution, action_propose, run_open, run_complete

    def open(self, goal: str):
        return self.run_open(tenant=self.tenant, agent=self.agent, goal=goal, actor=ACTOR)

    def act(self, run, tool: str, args: dict):
        """Propose and execute; returns (action, failed). Unwinding is left to the caller."""
        proposal = self.propose(run=run, tool_name=tool, args=args, actor=ACTOR)
        action = self.execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True,
                                        claimed=proposal.action)
        return action, action.status != "succeeded"

    def onboard(self, i: int, fail: bool) -> str:
        run = self.open(f"onboard {i}")
        user, _ = self.act(run, "bench.create_user", {"i": i})
        self.act(run, "bench.provision", {"user_id": user.result["id"]})
        _, failed = self.act(run, "bench.send_email", {"to": user.result["id"], "fail": fail})
        if failed:
            return self.execution.unwind(run.pk, tenant_id=run.tenant_id).status  # as the API's inline path
        return self.run_complete(run=run, actor=ACTOR).status

    def ten_steps_then_unwind(self, i: int) -> tuple[float, str]:
        """Nine steps succeed, step 10 fails; time from its failure to the ninth compensation recorded."""
        run = self.open(f"ten steps {i}")
        for n in range(9):
            self.act(run, "bench.step", {"n": n, "run": i})
        proposal = self.propose(run=run, tool_name="bench.step", args={"n": 9, "run": i, "fail": True}, actor=ACTOR)
        self.execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True,  # fails: starts the unwind
                               claimed=proposal.action)
        started = time.perf_counter()
        status = self.execution.unwind(run.pk, tenant_id=run.tenant_id).status
        return time.perf_counter() - started, status


def measure(n: int, unwind_n: int, *, rounds: int = 10, warmup: int = 10) -> dict:
    """Unwind, DBOS and the floor in interleaved rounds, so drift on a shared machine hits all three alike."""
    import subprocess

    from bench.common import BENCH_DB, DBOS_DB, ROOT, psycopg_url
    from bench.counting import counting
    from bench.pgfloor import Floor

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000  # fresh idempotency keys on every run of the benchmark
    for i in range(warmup):
        saga.onboard(base + 900_000 + i, False)
        saga.onboard(base + 950_000 + i, True)
    with counting() as ok_counts:
        assert saga.onboard(base + 800_000, False) == "completed"
    with counting() as fail_counts:
        assert saga.onboard(base + 850_000, True) == "compensated"

    peer = subprocess.Popen([sys.executable, str(ROOT / "bench" / "dbos_saga.py")], cwd=str(ROOT), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, PG_URL=psycopg_url(BENCH_DB), BENCH_DBOS_DB=DBOS_DB))
    assert peer.stdout.readline().strip() == "ready", "DBOS did not start"

    def dbos(case: str, count: int, start: int) -> list[float]:
        peer.stdin.write(f"{case} {count} {start}\n")
        peer.stdin.flush()
        return json.loads(peer.stdout.readline())

    floor = Floor(psycopg_url(BENCH_DB))
    dbos("ok", warmup, base + 900_000)
    dbos("fail", warmup, base + 950_000)
    floor.timed(ok_counts.commits, warmup)
    times = {name: [] for name in ("unwind_ok", "unwind_fail", "dbos_ok", "dbos_fail", "floor_ok", "floor_fail")}
    per_round = max(1, n // rounds)
    for r in range(rounds):
        start = base + r * per_round
        for i in range(start, start + per_round):
            t0 = time.perf_counter()
            assert saga.onboard(i, False) == "completed"
            t1 = time.perf_counter()
            assert saga.onboard(500_000 + i, True) == "compensated"
            times["unwind_ok"].append(t1 - t0)
            times["unwind_fail"].append(time.perf_counter() - t1)
        times["dbos_ok"] += dbos("ok", per_round, start)
        times["dbos_fail"] += dbos("fail", per_round, 500_000 + start)
        times["floor_ok"] += floor.timed(ok_counts.commits, per_round)
        times["floor_fail"] += floor.timed(fail_counts.commits, per_round)
    peer.stdin.write("quit\n")
    peer.stdin.flush()
    peer.wait(timeout=60)
    floor.close()

    unwinds = []
    for i in range(unwind_n):
        seconds, status = saga.ten_steps_then_unwind(base + i)
        assert status == "compensated", status
        unwinds.append(seconds)
    with counting() as unwind_counts:
        saga.ten_steps_then_unwind(base + 999_999)
    result = {name: summary(values) for name, values in times.items()}
    result["unwind_ok"].update(commits=ok_counts.commits, queries=ok_counts.queries)
    result["unwind_fail"].update(commits=fail_counts.commits, queries=fail_counts.queries)
    result["floor_ok"]["commits"] = ok_counts.commits
    result["floor_fail"]["commits"] = fail_counts.commits
    result["unwind9"] = summary(unwinds)
    result["unwind9"].update(ten_step_run_commits=unwind_counts.commits, ten_step_run_queries=unwind_counts.queries)
    return result


def long_runs(sizes: tuple[int, ...], n: int) -> dict:
    """A proposal as the API makes it, by the length of its run: the run and its steps read (`run_for_write`, as
    every POST /runs/{id}/actions does), then proposed and executed; `n` of them, timed, once the run has each of
    `sizes` steps (the steps before are taken untimed). Each proposal decides from, and its call checks, every step
    of the run (ledger/engine/runsteps.py), so this grows with the run: the figure that shows by how much."""
    from ledger.api.selectors import run_for_write

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    stamp = int(time.time() * 1000) % 10**9
    run = saga.open(f"long run {stamp}")
    result, taken = {}, 0
    for size in sizes:
        while taken < size:
            saga.act(run, "bench.step", {"n": taken, "run": stamp})
            taken += 1
        times = []
        for _ in range(n):
            started = time.perf_counter()
            fresh = run_for_write(tenant_ids=[tenant.pk], agent_id=None, run_id=run.pk)
            _, failed = saga.act(fresh, "bench.step", {"n": taken, "run": stamp})
            times.append(time.perf_counter() - started)
            assert not failed
            taken += 1
        result[str(size)] = summary(times)
    return result


def python_path(n: int, *, rounds: int = 5) -> dict:
    """The same sagas with the PostgreSQL functions (ledger/engine/fastpath.py) and on the Python path every database
    can take (UNWIND_FAST_PATH off), alternating in rounds: what the functions change, measured side by side."""
    from django.conf import settings

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 700_000
    times = {name: [] for name in ("functions_ok", "functions_fail", "python_ok", "python_fail")}
    per_round = max(1, n // rounds)
    try:
        for r in range(rounds):
            for fast in (True, False):
                settings.UNWIND_FAST_PATH = fast
                label = "functions" if fast else "python"
                for i in range(per_round):
                    key = base + r * per_round + i + (0 if fast else 100_000)
                    times[f"{label}_ok"].append(timed(saga.onboard, key, False))
                    times[f"{label}_fail"].append(timed(saga.onboard, key + 50_000, True))
    finally:
        settings.UNWIND_FAST_PATH = True
    return {name: summary(values) for name, values in times.items()}


def _dbos_process_transactions(case: str, n: int) -> tuple[int, int]:
    """Transactions DBOS commits in its system database over one process's life, running n sagas, and the WAL bytes
    the server wrote while the sagas ran."""
    import subprocess

    from bench.common import BENCH_DB, DBOS_DB, ROOT, psycopg_url, wal_position, xact_commits

    before, wal = xact_commits(DBOS_DB), 0
    peer = subprocess.Popen([sys.executable, str(ROOT / "bench" / "dbos_saga.py")], cwd=str(ROOT), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, PG_URL=psycopg_url(BENCH_DB), BENCH_DBOS_DB=DBOS_DB))
    assert peer.stdout.readline().strip() == "ready"
    if n:
        wal = wal_position()
        peer.stdin.write(f"{case} {n} {int(time.time() * 1000) * 1000}\n")
        peer.stdin.flush()
        peer.stdout.readline()
        wal = wal_position() - wal  # the sagas' own, not the process's start or end
    peer.stdin.write("quit\n")
    peer.stdin.flush()
    peer.wait(timeout=60)
    time.sleep(1.5)  # exited backends have flushed their statistics
    return xact_commits(DBOS_DB) - before, wal


def transactions_per_saga(n: int = 100) -> dict:
    """Transactions per saga as PostgreSQL counts them (pg_stat_database.xact_commit: every committed
    transaction, read-only ones included, autocommit statements each one), for Unwind and for DBOS; the WAL bytes
    the server wrote a saga (what each commit's flush waits for, besides the flush itself), and how many of
    Unwind's updates of a step were heap-only (a step's status is in the predicates of its due and lease indexes,
    so a move of status writes a new entry in every index of the table)."""
    from django.db import connection

    from bench.common import BENCH_DB, updates_of, wal_position, xact_commits

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 400_000
    out = {}
    for case, fail in (("ok", False), ("fail", True)):
        connection.close()
        time.sleep(1.5)
        before, updates, wal = xact_commits(BENCH_DB), updates_of(BENCH_DB, "ledger_action"), wal_position()
        for i in range(n):
            saga.onboard(base + (50_000 if fail else 0) + i, fail)
        wal = wal_position() - wal
        connection.close()
        time.sleep(1.5)
        out[f"unwind_{case}"] = round((xact_commits(BENCH_DB) - before) / n, 1)
        out[f"unwind_{case}_wal_bytes"] = round(wal / n)
        after = updates_of(BENCH_DB, "ledger_action")
        out[f"unwind_{case}_step_updates"] = round((after[0] - updates[0]) / n, 1)
        out[f"unwind_{case}_step_updates_heap_only"] = round((after[1] - updates[1]) / n, 1)
    launch, _ = _dbos_process_transactions("ok", 0)
    for case in ("ok", "fail"):
        commits, wal = _dbos_process_transactions(case, n)
        out[f"dbos_{case}"] = round((commits - launch) / n, 1)
        out[f"dbos_{case}_wal_bytes"] = round(wal / n)
    return out


def breakdown(n: int) -> dict:
    """Where an ok saga's time goes: inside the database driver (round trips, server work, commits) per
    kind of statement, and the rest (Django ORM building queries and models, the engine's own Python)."""
    from collections import defaultdict

    from django.db import connection

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 600_000
    saga.onboard(base - 1, False)
    spent = defaultdict(lambda: [0, 0.0])

    def wrapper(execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            words = sql.split()
            table = next((w.strip('"') for w in words if w.startswith(('"ledger_', '"django_'))), "")
            key = f"{words[0]} {table.split('.')[0].strip(chr(34))}"
            if "FOR NO KEY UPDATE" in sql or "FOR UPDATE" in sql:
                key += " (lock)"
            spent[key][0] += 1
            spent[key][1] += time.perf_counter() - started

    plain_commit = connection._commit

    def timed_commit():
        started = time.perf_counter()
        try:
            return plain_commit()
        finally:
            spent["COMMIT"][0] += 1
            spent["COMMIT"][1] += time.perf_counter() - started

    connection._commit = timed_commit
    started = time.perf_counter()
    cpu = time.process_time()
    try:
        with connection.execute_wrapper(wrapper):
            for i in range(n):
                saga.onboard(base + i, False)
    finally:
        del connection._commit
    total = (time.perf_counter() - started) / n * 1000
    cpu = (time.process_time() - cpu) / n * 1000
    in_driver = sum(v[1] for v in spent.values()) / n * 1000
    rows = sorted(((k, v[0] / n, v[1] / n * 1000) for k, v in spent.items()), key=lambda r: -r[2])
    return {
        "saga_ms": round(total, 2), "process_cpu_ms": round(cpu, 2), "in_driver_ms": round(in_driver, 2),
        "outside_driver_ms": round(total - in_driver, 2),
        "statements": [{"statement": k, "per_saga": round(c, 1), "ms_per_saga": round(ms, 2)} for k, c, ms in rows],
    }


def profile(path, n: int) -> None:
    """A pyinstrument profile of n ok sagas, as text: what dominates the engine's time."""
    from pyinstrument import Profiler

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 650_000
    saga.onboard(base - 1, False)
    profiler = Profiler(interval=0.0005)
    profiler.start()
    for i in range(n):
        saga.onboard(base + i, False)
    profiler.stop()
    path.write_text(profiler.output_text(unicode=False, color=False, show_all=False))


def profile_database(path, n: int) -> dict:
    """Where PostgreSQL's time goes in n ok and n failing sagas: each engine function's calls and its time a call,
    in all and its own (less the functions it calls), from `pg_stat_user_functions` with `track_functions = all`
    (a superuser's session setting, as the bench's user is; the statistics reach the view when the session's
    transaction ends). A function that is mostly its own time does its work in its statements; the saga's own wall
    time is beside it, so the share the database takes is read off one table. Written to `path` as text and returned
    per function."""
    from django.db import connection

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 700_000
    saga.onboard(base - 1, False)
    saga.onboard(base - 2, True)
    with connection.cursor() as cursor:
        cursor.execute("SET track_functions = 'all'")
        cursor.execute("SELECT pg_stat_reset_single_function_counters(p.oid) FROM pg_proc p"
                       " WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'unwind%%'")
    walls = {}
    for fail in (False, True):
        started = time.perf_counter()
        for i in range(n):
            saga.onboard(base + i + (100_000 if fail else 0), fail)
        walls["failing" if fail else "ok"] = (time.perf_counter() - started) / n * 1000
    connection.close()  # the session's counters reach the statistics when it ends
    time.sleep(1.0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions"
                       " WHERE funcname LIKE 'unwind%%' ORDER BY total_time DESC")
        rows = cursor.fetchall()
    sagas = 2 * n
    functions = {name: {"calls_per_saga": round(calls / sagas, 2), "ms_per_call": round(total / calls, 4),
                        "own_ms_per_call": round(own / calls, 4), "own_ms_per_saga": round(own / sagas, 4)}
                 for name, calls, total, own in rows if calls}
    lines = [f"{n} ok and {n} failing sagas: wall {walls['ok']:.2f} / {walls['failing']:.2f} ms a saga; "
             f"the engine's functions' own time {sum(f['own_ms_per_saga'] for f in functions.values()):.2f} ms a "
             "saga (the two kinds' mean)", "",
             f"{'function':28} {'calls/saga':>10} {'ms/call':>8} {'own ms/call':>12} {'own ms/saga':>12}"]
    lines += [f"{name:28} {f['calls_per_saga']:>10} {f['ms_per_call']:>8.3f} {f['own_ms_per_call']:>12.3f} "
              f"{f['own_ms_per_saga']:>12.3f}" for name, f in functions.items()]
    path.write_text("\n".join(lines) + "\n")
    return {"wall_ms": {k: round(v, 2) for k, v in walls.items()}, "functions": functions}


def unwind_only(n: int, unwind_n: int) -> dict:
    """Unwind's own figures, no peer: for comparing two versions of the engine run by turns."""
    from bench.counting import counting

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000
    for i in range(5):
        saga.onboard(base + 900_000 + i, False)
        saga.onboard(base + 950_000 + i, True)
    ok, fail, unwinds = [], [], []
    for i in range(n):
        ok.append(timed(saga.onboard, base + i, False))
        fail.append(timed(saga.onboard, base + 500_000 + i, True))
    for i in range(unwind_n):
        unwinds.append(saga.ten_steps_then_unwind(base + 300_000 + i)[0])
    counts = {}
    for name, fn in (("ok", lambda: saga.onboard(base + 800_000, False)),
                     ("fail", lambda: saga.onboard(base + 850_000, True)),
                     ("ten_step_unwind", lambda: saga.ten_steps_then_unwind(base + 860_000))):
        with counting() as c:
            fn()
        counts[name] = {"commits": c.commits, "queries": c.queries}
    return {"ok": summary(ok), "fail": summary(fail), "unwind9": summary(unwinds), "counts": counts}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else (60 if QUICK else 300)
    unwind_n = int(args[1]) if len(args) > 1 else (20 if QUICK else 100)
    django_setup(UNWIND_TASKS_SYNC="0")
    if "--unwind-only" in sys.argv:
        print(json.dumps(unwind_only(n, unwind_n)))
        return
    log(f"engine: {n} sagas of each kind, {unwind_n} ten-step unwinds")
    print(json.dumps(measure(n, unwind_n)))


if __name__ == "__main__":
    main()
