"""`make bench`: every part on one PostgreSQL, in one run; a table with ratios, bench/results.json and
bench/cost_vs_size.png.

Settings (environment): BENCH_QUICK=1 (a smoke of every part, about a minute; its files go to var/bench-quick/), BENCH_PG (server, default
postgres://postgres@127.0.0.1:5432), BENCH_DB (default unwind_bench, dropped and created afresh),
BENCH_N (sagas per case), BENCH_UNWIND_N, BENCH_API_N, BENCH_API_SECONDS, BENCH_CRASH_TRIALS,
BENCH_SIZES (actions, comma-separated), BENCH_PAGE_REQUESTS, BENCH_OUT (where the files go, default bench/).
Part 6 (MCP against REST, bench/mcp.py) uses BENCH_API_N and BENCH_API_SECONDS too; part 7 (rules and limits,
bench/rules.py) BENCH_RULES_N; part 8 (tracing off and on, bench/tracing.py) BENCH_TRACING_N sagas of each mode in
each of BENCH_TRACING_PROCESSES processes.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.common import BENCH_DB, DBOS_DB, QUICK, ROOT, bench_env, django_setup, log, recreate_database
from bench import years

# A smoke's figures are not a run's: under BENCH_QUICK they go to var/bench-quick/, never over bench/results.json.
OUT = Path(os.environ.get("BENCH_OUT") or (ROOT / "var" / "bench-quick" if QUICK else Path(__file__).resolve().parent))


def setting(name: str, full, quick):
    raw = os.environ.get(name)
    if raw is None:
        return quick if QUICK else full
    return type(full)(raw) if not isinstance(full, list) else [int(x) for x in raw.split(",") if x.strip()]


N = setting("BENCH_N", 300, 20)
UNWIND_N = setting("BENCH_UNWIND_N", 100, 8)
API_N = setting("BENCH_API_N", 300, 20)
API_SECONDS = setting("BENCH_API_SECONDS", 10.0, 1.0)
CRASH_TRIALS = setting("BENCH_CRASH_TRIALS", 5, 1)
SIZES = setting("BENCH_SIZES", [1_000, 100_000, 1_000_000], [1_000, 10_000])
PAGE_REQUESTS = setting("BENCH_PAGE_REQUESTS", 30, 5)
SIZE_SAGAS = 60 if not QUICK else 5
RULES_N = setting("BENCH_RULES_N", 300, 20)
TRACING_N = setting("BENCH_TRACING_N", 400, 20)
TRACING_PROCESSES = setting("BENCH_TRACING_PROCESSES", 3, 1)


def prepare() -> dict:
    import psycopg

    from bench.common import PG_BASE, psycopg_url

    log(f"fresh database {BENCH_DB} (and DBOS's {DBOS_DB}), migrated")
    try:
        recreate_database(BENCH_DB)
    except psycopg.OperationalError as error:
        raise SystemExit(f"make bench needs PostgreSQL at {PG_BASE} (set BENCH_PG): {error}") from None
    recreate_database(DBOS_DB)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=str(ROOT), env=bench_env(),
                   check=True)
    years.copy_of(BENCH_DB)  # part 9's database, migrated: a copy made while nothing is connected to this one

    with psycopg.connect(psycopg_url(BENCH_DB)) as conn:
        version = conn.execute("show server_version").fetchone()[0]
        fsync = conn.execute("show synchronous_commit").fetchone()[0]
    return {"postgresql": version, "synchronous_commit": fsync}


def api_available() -> bool:
    from django.urls import NoReverseMatch, reverse

    try:
        reverse("api:run-actions", args=[1])
        return True
    except NoReverseMatch:
        return False


@contextmanager
def part(results: dict, name: str):
    """Time one part of the run (its seconds go to results.json's environment.part_seconds); a part that raises
    ends the run with its traceback and a non-zero exit, which is what CI's smoke (BENCH_QUICK=1) looks for."""
    started = time.time()
    yield
    results["environment"].setdefault("part_seconds", {})[name] = round(time.time() - started, 1)
    # What the parts so far measured, kept as each ends: a run stopped later (or a part that fails) loses only its own.
    (OUT / "results.partial.json").write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    started = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    env = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": QUICK, "cpus": os.cpu_count(),
           "python": platform.python_version(), "load_before": os.getloadavg()[0]}
    results: dict = {"environment": env, "settings": {
        "sagas_per_case": N, "unwind_runs": UNWIND_N, "api_pairs": API_N, "api_seconds_per_level": API_SECONDS,
        "crash_trials": CRASH_TRIALS, "sizes": SIZES, "page_requests": PAGE_REQUESTS,
        "tracing_sagas_per_mode": TRACING_N, "tracing_processes": TRACING_PROCESSES}}
    with part(results, "prepare"):
        env.update(prepare())
    django_setup(UNWIND_TASKS_SYNC="0")
    from django.db import connection

    env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT), capture_output=True,
                                   text=True, check=False).stdout.strip()
    # Under BENCH_QUICK every part runs end to end on smaller samples: a smoke that fails when a part breaks.
    small = (lambda full, quick: quick if QUICK else full)

    from bench import crash, engine, replay, rules, scale, tracing

    with part(results, "engine"):
        log(f"engine: {N} sagas of each kind, interleaved with DBOS and the floor; {UNWIND_N} ten-step unwinds")
        results["engine"] = engine.measure(N, UNWIND_N, warmup=small(10, 3))
        results["engine"]["python_path"] = engine.python_path(small(100, 10))
        results["engine"]["long_runs"] = engine.long_runs(small((10, 100, 1000), (10, 100)), small(30, 5))
        results["engine"]["replay"] = replay.measure(small(150, 20), warmup=small(10, 3))
        results["engine_breakdown"] = engine.breakdown(small(60, 10))
        results["transactions_per_saga"] = engine.transactions_per_saga(small(100, 10))
    with part(results, "rules"):
        log(f"rules: a proposal with five rules and two limits against one with none, {RULES_N} of each")
        results["rules"] = rules.measure(RULES_N)
    with part(results, "profile"):
        engine.profile(OUT / "profile_saga.txt", small(20, 5))
        results["engine_database"] = engine.profile_database(OUT / "profile_saga_database.txt", small(100, 5))
    connection.close()

    with part(results, "tracing"):
        log(f"tracing: {TRACING_N} ok sagas absent/off/on in turn, in each of {TRACING_PROCESSES} processes")
        results["tracing"] = tracing.measure(TRACING_N, TRACING_PROCESSES)

    tenant, agent, _ = engine.tenant_with_tools()
    if api_available():
        from bench import api, mcp
        from bench.server import Server

        server = Server()  # parts 2 and 6 on one server (gunicorn, 4 sync workers)
        with part(results, "server_start"):
            server.__enter__()
        try:
            with part(results, "api"):
                log(f"api: {API_N} alternating requests, then 1/4/16 agents for {API_SECONDS:g} s each")
                results["api"] = api.measure(tenant, n=API_N, seconds=API_SECONDS, server=server)
            with part(results, "api_production"):
                results["api"]["production"] = api.production(tenant, n=API_N, seconds=API_SECONDS)
            connection.close()
            with part(results, "mcp"):
                log(f"mcp: {API_N} REST/MCP/no-op requests in turn, then 1/4/16 agents, REST and MCP by turns")
                results["mcp"] = mcp.measure(tenant, n=API_N, seconds=API_SECONDS, pairs=small(2, 1), server=server)
        finally:
            server.__exit__(None, None, None)
    else:
        results["api"] = {"not_measured": "the agent API (POST /api/v1/runs/{id}/actions) is not in the URLconf"}
    connection.close()

    with part(results, "crash"):
        log(f"crash: {CRASH_TRIALS} kills after the tool call, recovered by a real worker")
        results["crash"] = crash.measure(tenant, agent, CRASH_TRIALS, warmup=small(1, 0))
    connection.close()

    with part(results, "scale"):
        log(f"scale: console pages at {SIZES} bulk actions")
        results["scale"] = scale.measure(SIZES, PAGE_REQUESTS, SIZE_SAGAS)

    with part(results, "years"):
        log(f"years: {years.settings_from_env()['n']:,} actions loaded in bulk, then size, pages and verify_audit")
        results["years"] = years.measure(fresh=False)

    env["load_after"] = os.getloadavg()[0]
    env["seconds"] = round(time.time() - started)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "results.partial.json").unlink(missing_ok=True)
    plot(results, OUT / "cost_vs_size.png")
    print(table(results))
    log(f"done in {env['seconds']} s ({', '.join(f'{k} {v:g}' for k, v in env['part_seconds'].items())}): "
        f"{OUT / 'results.json'}, {OUT / 'cost_vs_size.png'}")


# --- the table -----------------------------------------------------------------------------------------

def _ms(row: dict, key: str = "p50") -> str:
    return f"{row[key]:.1f} ms"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table(r: dict) -> str:
    e, env = r["engine"], r["environment"]
    lines = []
    add = lines.append
    add(f"Unwind benchmarks — PostgreSQL {env['postgresql']} (synchronous_commit={env['synchronous_commit']}), "
        f"{env['cpus']} CPUs, load {env['load_before']:.1f}→{env['load_after']:.1f}, commit {env['commit']}"
        f"{', QUICK' if env['quick'] else ''}")
    add("")
    w = "{:<44} {:>22} {:>16} {:>16} {:>9} {:>9}"
    add(w.format("1. engine, 3-step saga (p50 / p99)", "Unwind", "DBOS", "floor", "U/DBOS", "U/floor"))
    for case, label in (("ok", "succeeds"), ("fail", "fails at step 3, 2 compensations")):
        u, d, f = e[f"unwind_{case}"], e[f"dbos_{case}"], e[f"floor_{case}"]
        add(w.format(f"   {label}", f"{u['p50']:.1f} / {u['p99']:.1f} ms", f"{d['p50']:.1f} / {d['p99']:.1f} ms",
                     f"{f['p50']:.2f} ms ({f['commits']}c)", f"{u['p50'] / d['p50']:.2f}", f"{u['p50'] / f['p50']:.1f}"))
        add(w.format("", f"{u['commits']} commits, {u['queries']} queries", "", "", "", ""))
    for case in ("ok", "fail"):
        u, d, f = e[f"unwind_{case}"]["p50"], e[f"dbos_{case}"]["p50"], e[f"floor_{case}"]["p50"]
        add(f"   target ({'succeeds' if case == 'ok' else 'fails'}): p50 ≤ DBOS → {verdict(u <= d)}; "
            f"aiming at ≤ 1/3 of DBOS → {verdict(u <= d / 3)}; ≤ 3× the floor → {verdict(u <= 3 * f)}")
    py = e.get("python_path")
    if py:
        add(f"   the same sagas on the Python path (UNWIND_FAST_PATH=0, alternating with the functions): succeeds "
            f"{py['python_ok']['p50']:.1f} ms against {py['functions_ok']['p50']:.1f} ms, fails "
            f"{py['python_fail']['p50']:.1f} ms against {py['functions_fail']['p50']:.1f} ms")
    for case, label in (("ok", "ok"), ("fail", "failing")):
        rp = (e.get("replay") or {}).get(case)
        if rp:
            db, fl, en = rp["replay"]["p50"], rp["floor"]["p50"], rp["engine"]["p50"]
            add(f"   the {label} saga's {rp['statements']} statements alone, from a client that only sends them "
                f"(bench/replay.py; by turns with the floor and the engine): {db:.1f} ms = {db / fl:.1f}× the floor's "
                f"{fl:.2f} ms; the engine {en:.1f} ms = {en / fl:.1f}×, its process's share {en - db:.1f} ms")
    tx = r.get("transactions_per_saga")
    if tx:
        add(f"   transactions per saga as PostgreSQL counts them (reads included): Unwind {tx['unwind_ok']:g} ok / "
            f"{tx['unwind_fail']:g} failing, DBOS {tx['dbos_ok']:g} / {tx['dbos_fail']:g}")
        if "unwind_ok_wal_bytes" in tx:
            add(f"   WAL a saga: Unwind {tx['unwind_ok_wal_bytes'] / 1000:.1f} / {tx['unwind_fail_wal_bytes'] / 1000:.1f} KB "
                f"(ok / failing), DBOS {tx['dbos_ok_wal_bytes'] / 1000:.1f} / {tx['dbos_fail_wal_bytes'] / 1000:.1f} KB; "
                f"Unwind's updates of a step heap-only: {tx['unwind_ok_step_updates_heap_only']:g} of "
                f"{tx['unwind_ok_step_updates']:g} (ok), {tx['unwind_fail_step_updates_heap_only']:g} of "
                f"{tx['unwind_fail_step_updates']:g} (failing)")
    b = r.get("engine_breakdown")
    if b:
        top = ", ".join(f"{s['statement']} {s['ms_per_saga']:.1f}" for s in b["statements"][:4])
        add(f"   where an ok saga's {b['saga_ms']:.1f} ms go: {b['in_driver_ms']:.1f} ms in the driver "
            f"({top}), {b['outside_driver_ms']:.1f} ms outside; process CPU {b['process_cpu_ms']:.1f} ms")
    pg = r.get("engine_database")
    if pg:
        top = ", ".join(f"{name} {f['own_ms_per_saga']:.2f}" for name, f in sorted(
            pg["functions"].items(), key=lambda kv: -kv[1]["own_ms_per_saga"])[:4])
        add(f"   inside PostgreSQL, the functions' own time a saga (ok and failing, mean): "
            f"{sum(f['own_ms_per_saga'] for f in pg['functions'].values()):.2f} ms ({top}; "
            "bench/profile_saga_database.txt)")
    add("")
    api = r["api"]
    if "not_measured" in api:
        add(f"2. API: not measured — {api['not_measured']}")
    else:
        o = api["overhead"]
        add(f"2. API ({api['server']}), per action p50: propose→executed→201 {_ms(o['action'])}, "
            f"no-op endpoint {_ms(o['noop'])}: overhead {o['overhead_p50_ms']:.1f} ms "
            f"(target ≤ 5 ms → {verdict(o['overhead_p50_ms'] <= 5)})")
        add("   throughput: " + "; ".join(f"{t['agents']} agent{'s' if t['agents'] > 1 else ''} "
                                        f"{t['actions_per_s']:.1f} actions/s (p50 {t['p50']:.0f} ms)"
                                        for t in api["throughput"]))
        top = api["throughput"][-1]
        if "cpu_ms_per_action" in top:
            cpu = top["cpu_ms_per_action"]
            add(f"   at {top['agents']} agents: {verdict(top['actions_per_s'] >= 300)} (target ≥ 300 actions/s); "
                f"process CPU per action {sum(cpu.values()):.2f} ms (server {cpu['server']:.2f}, PostgreSQL "
                f"{cpu['postgresql']:.2f}, load generator {cpu['load_generator']:.2f}), {top['cpu_busy']:.2f} of "
                f"{r['environment']['cpus']} CPUs busy")
        prod = api.get("production")
        if prod:
            o, top = prod["overhead"], prod["throughput"][-1]
            cpu = top.get("cpu_ms_per_action", {})
            add(f"   on docs/production.md's command ({prod['server']}): propose→201 {_ms(o['action'])}, no-op "
                f"{_ms(o['noop'])}, overhead {o['overhead_p50_ms']:.1f} ms; {top['agents']} agents "
                f"{top['actions_per_s']:.1f} actions/s" + (f", server CPU {cpu['server']:.2f} ms an action" if cpu else ""))
    add("")
    u9 = e["unwind9"]
    add(f"3. unwind: failure of step 10 → nine compensations recorded, p50 {_ms(u9)} (p99 {u9['p99']:.1f} ms), "
        f"target ≤ 20 ms → {verdict(u9['p50'] <= 20)}")
    long = e.get("long_runs")
    if long:
        add("   a proposal as the API makes it (its run and steps read, proposed, executed), p50 by the run's length: "
            + ", ".join(f"{size} steps {_ms(row)}" for size, row in long.items())
            + " (each reads and checks every step of its run)")
    add("")
    s = r["scale"]
    add(f"4. console, p95 per request (queries), bulk rows in tenant {s['tenant']} (its audit chain does not verify)")
    pages = list(s["rows"][0]["pages"])
    add("   {:<14}".format("actions") + "".join(f"{p:>24}" for p in pages) + f"{'engine saga p50':>18}")
    for row in s["rows"]:
        cells = []
        for p in pages:
            page = row["pages"].get(p, {})
            cells.append(f"{page['p95']:.1f} ms ({'/'.join(map(str, page['queries']))}q)" if "p95" in page
                         else page.get("error", "-"))
        add("   {:<14}".format(f"{row['actions_in_db']:,}") + "".join(f"{c:>24}" for c in cells)
            + f"{row['engine_saga_ok']['p50']:>15.1f} ms")
    last = s["rows"][-1]
    constant = all(len({q for row in s["rows"] for q in row["pages"].get(p, {}).get("queries", [])}) == 1 for p in pages)
    fast = all(last["pages"].get(p, {}).get("p95", 1e9) <= 150 for p in pages)
    add(f"   target at {last['actions_in_db']:,} actions: p95 ≤ 150 ms → {verdict(fast)}; "
        f"constant queries → {verdict(constant)}")
    add("")
    c = r["crash"]
    add(f"5. crash recovery (kill after the tool call → picked up → succeeded): p50 {c['finished_p50_s']:.2f} s, "
        f"max {c['finished_max_s']:.2f} s; target lease {c['target_s'] - 1:.0f} s + 1 s = {c['target_s']:.1f} s → "
        f"p50 {verdict(c['finished_p50_s'] <= c['target_s'])}, max {verdict(c['finished_max_s'] <= c['target_s'])}"
        + (" (no untimed trial first: the first includes the worker's boot)" if c.get("untimed_trials") == 0 else ""))
    if "mcp" in r:
        from bench import mcp

        add("")
        lines.extend(mcp.lines(r["mcp"]))
    if "rules" in r:
        from bench import rules

        add("")
        lines.extend(rules.lines(r["rules"]))
    if "tracing" in r:
        from bench import tracing

        add("")
        lines.extend(tracing.lines(r["tracing"]))
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------------------

def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["scale"]["rows"]
    sizes = [row["actions_in_db"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for page in rows[0]["pages"]:
        values = [row["pages"].get(page, {}).get("p95") for row in rows]
        if all(v is not None for v in values):
            left.plot(sizes, values, marker="o", label=f"{page} p95")
    left.plot(sizes, [row["engine_saga_ok"]["p50"] for row in rows], marker="s", linestyle="--",
              label="engine 3-step saga p50")
    left.axhline(150, color="grey", linewidth=0.8, linestyle=":", label="page target 150 ms")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("actions in the database")
    left.set_ylabel("ms")
    left.set_title("Cost against table size")
    left.legend(fontsize=8)
    for page in rows[0]["pages"]:
        values = [max(row["pages"].get(page, {}).get("queries", [0])) for row in rows]
        right.plot(sizes, values, marker="o", label=page)
    right.set_xscale("log")
    right.set_xlabel("actions in the database")
    right.set_ylabel("queries per request")
    right.set_ylim(bottom=0)
    right.set_title("Queries per page")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
