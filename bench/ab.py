"""Two versions side by side, in interleaved rounds on one machine, so drift hits both alike:

- the engine: part 1's 3-step saga (succeeding, and failing at step 3 with two compensations), in process;
- the API: one proposal over HTTP (POST /api/v1/runs/{id}/actions, a no-op tool, executed inline → 201) against
  a live server of each revision (gunicorn, 4 sync workers, as part 2), alternating with POST /bench/noop (the same
  server's authentication, throttle, parser and renderer, nothing else) so each side's overhead is its own.

    .venv/bin/python -m bench.ab BEFORE [AFTER] [ROUNDS] [PER_ROUND] [--only=engine|api]

BEFORE and AFTER are git revisions (AFTER defaults to this working tree, uncommitted changes included). Each side
gets a copy of its own (`git archive` into a temporary folder, removed afterwards), a PostgreSQL database of its own
(`unwind_ab_<side>`, or `<BENCH_DB>_ab_<side>` when BENCH_DB is set, on BENCH_PG, created afresh and migrated by
that side's code), a child process importing that side's code (the sagas; and the tenant, tools and agent key the
API uses) and, for the API, a gunicorn of that side's code on a free port. The HTTP client is this process (the
standard library's, as part 2), the same for both. Each round runs PER_ROUND sagas of each kind and PER_ROUND
proposals (each after a no-op request) on one side and then the other; rounds alternate which side goes first;
round 0 warms up. Prints each side's p50 and the ratio after / before: what "no regression beyond noise" is
judged by (issue 27; the API since issue 40), each round's own ratio (how many rounds were lower shows whether a
small difference is more than the machine's drift), and the server's CPU per proposal read from /proc.
"""
from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench.common import BENCH_DB, PG_BASE, ROOT, log, recreate_database

CHILD = """
import json, os, sys, time
sys.path.insert(0, os.environ["AB_ROOT"])
os.chdir(os.environ["AB_ROOT"])
from bench.common import django_setup, timed
django_setup(UNWIND_TASKS_SYNC="0")
from bench.engine import Saga, tenant_with_tools
try:
    from ledger.tenancy import agent_create
except ImportError:  # trees before the services package moved (62bbf33 and older)
    from ledger.services.tenancy import agent_create
tenant, agent, _ = tenant_with_tools()
saga = Saga(tenant, agent)
base, count = int(time.time() * 1000) % 10**9 * 1000, 0
print(json.dumps({"ready": True, "api_key": agent_create(tenant=tenant, name="bench-ab-api")[1]}), flush=True)
for line in sys.stdin:
    ok, fail = [], []
    for _ in range(int(line)):
        count += 1
        ok.append(timed(saga.onboard, base + count, False))
        fail.append(timed(saga.onboard, base + 500_000 + count, True))
    print(json.dumps({"ok": ok, "fail": fail}), flush=True)
"""
PARTS = ("engine", "api")
# The venv's editable install of Unwind (setuptools' finder) answers for any module of ours the path does not hold:
# an older tree lacking `approvals/templatetags` would import this tree's. Each side's processes drop that finder
# first thing (sitecustomize runs after the .pth files), so a side imports its own code and nothing else.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
"""


def side_path(root: Path) -> str:
    """PYTHONPATH for a side: a folder beside its checkout holding the sitecustomize above, then the checkout."""
    if root == ROOT:  # the working tree is what the editable install points at
        return str(root)
    site = root.parent / f".{root.name}-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return f"{site}{os.pathsep}{root}"


def database_of(name: str) -> str:
    return f"unwind_ab_{name}" if BENCH_DB == "unwind_bench" else f"{BENCH_DB}_ab_{name}"


def side(name: str, root: Path) -> tuple[subprocess.Popen, str]:
    """The side's child, started on a fresh database migrated by the side's code; (child, the API's agent key)."""
    database = database_of(name)
    recreate_database(database)
    env = dict(os.environ, DATABASE_URL=f"{PG_BASE}/{database}", BENCH_DB=database, AB_ROOT=str(root),
               PYTHONPATH=side_path(root))
    env.setdefault("UNWIND_INSECURE_DEV_KEY", "1")  # a throwaway database: the public development key
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=root, env=env, check=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd=root)
    line = child.stdout.readline()
    try:
        started = json.loads(line)
    except ValueError:
        raise SystemExit(f"the {name} side did not start: {line!r}") from None
    return child, started["api_key"]


def sagas(child: subprocess.Popen, count: int) -> dict[str, list[float]]:
    child.stdin.write(f"{count}\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def proposals(agent, server_pid: int, count: int) -> dict:
    """`count` proposals over HTTP, each after a no-op request; the seconds of each, and the server's CPU."""
    from bench.api import _cpu_by_process, cpu_split

    actions, noops = [], []
    cpu_before = _cpu_by_process()
    for _ in range(count):
        noops.append(agent.noop())
        actions.append(agent.act())
    cpu = cpu_split(cpu_before, _cpu_by_process(), server_pid)["server"]
    return {"action": actions, "noop": noops, "server_cpu": cpu}


def compare(roots: dict[str, Path], rounds: int, per_round: int, parts=PARTS) -> dict:
    from contextlib import ExitStack

    from bench.api import Agent
    from bench.server import Server

    times = {name: {"ok": [], "fail": [], "action": [], "noop": [], "server_cpu": 0.0} for name in roots}
    by_round: list[dict] = []  # each measured round's values, by side: its own after / before, to show the spread
    with ExitStack() as stack:
        children, servers, agents = {}, {}, {}
        for name, root in roots.items():
            children[name], key = side(name, root)
            stack.callback(_stop, children[name])
            if "api" in parts:
                servers[name] = stack.enter_context(Server(root=root, database_url=f"{PG_BASE}/{database_of(name)}",
                                                            env={"PYTHONPATH": side_path(root)}))
                agents[name] = Agent(servers[name].url, key, f"ab-{name}")
        for number in range(rounds + 1):
            order = list(roots) if number % 2 == 0 else list(reversed(roots))
            for name in order:
                got = sagas(children[name], per_round) if "engine" in parts else {}
                if "api" in parts:
                    got.update(proposals(agents[name], servers[name].process.pid, per_round))
                if number:  # round 0 warms up
                    if name == order[0]:
                        by_round.append({})
                    by_round[-1][name] = got
                    for case, values in got.items():
                        times[name][case] += values
    result = {}
    for case in ("ok", "fail", "action", "noop"):
        if not times["after"][case]:
            continue
        before, after = (statistics.median(times[name][case]) * 1000 for name in roots)
        result[case] = {"before_p50_ms": round(before, 3), "after_p50_ms": round(after, 3),
                        "ratio": round(after / before, 3), "n": len(times["after"][case]),
                        "rounds": [round(statistics.median(r["after"][case]) / statistics.median(r["before"][case]), 3)
                                   for r in by_round]}
    if "action" in result:
        result["api_overhead"] = {
            name: round(result["action"][f"{name}_p50_ms"] - result["noop"][f"{name}_p50_ms"], 3) for name in roots}
        cpu = {name: times[name]["server_cpu"] * 1000 / len(times[name]["action"]) for name in roots}
        # The server's CPU per proposal (its no-op request included: both sides alike), from /proc.
        result["server_cpu_ms"] = {"before": round(cpu["before"], 3), "after": round(cpu["after"], 3),
                                   "ratio": round(cpu["after"] / cpu["before"], 3) if cpu["before"] else None}
    return result


def _stop(child: subprocess.Popen) -> None:
    try:
        child.stdin.close()
        child.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        child.kill()
        child.wait(timeout=10)


def checkout(revision: str, folder: Path) -> Path:
    """The revision's files (`git archive`): no worktree registered in the repository, nothing left behind."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", revision], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


LABELS = {"ok": "engine, saga succeeds", "fail": "engine, saga fails (2 compensations)",
          "action": "API, proposal over HTTP → 201", "noop": "API, no-op endpoint (same server)"}


def report(result: dict) -> str:
    lines = [f"{LABELS[case]}: before {f['before_p50_ms']:.2f} ms, after {f['after_p50_ms']:.2f} ms, "
             f"after / before {f['ratio']:.3f} (n = {f['n']} each; by round {', '.join(map(str, f['rounds']))}: "
             f"lower in {sum(r < 1 for r in f['rounds'])} of {len(f['rounds'])})"
             for case, f in result.items() if case in LABELS]
    if "api_overhead" in result:
        o, c = result["api_overhead"], result["server_cpu_ms"]
        lines.append(f"API overhead (proposal − no-op, p50): before {o['before']:.2f} ms, after {o['after']:.2f} ms")
        lines.append(f"server CPU per proposal (and its no-op): before {c['before']:.2f} ms, after {c['after']:.2f} ms, "
                     f"after / before {c['ratio']}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    only = [a.split("=", 1)[1] for a in argv if a.startswith("--only=")]
    args = [a for a in argv if not a.startswith("--")]
    if not args or any(part not in PARTS for part in only):
        raise SystemExit(__doc__)
    parts = tuple(only) or PARTS
    before = args.pop(0)
    after = args.pop(0) if args and not args[0].isdigit() else None
    rounds = int(args[0]) if args else 10
    per_round = int(args[1]) if len(args) > 1 else 100
    with tempfile.TemporaryDirectory(prefix="unwind-ab-") as folder:
        roots = {name: ROOT if revision is None else checkout(revision, Path(folder) / name)
                 for name, revision in (("before", before), ("after", after))}
        log(f"A/B ({', '.join(parts)}): {before} against {after or 'the working tree'}, {rounds} rounds of "
            f"{per_round} each")
        result = compare(roots, rounds, per_round, parts)
    print(report(result))
    out = os.environ.get("BENCH_AB_OUT")
    if out:
        Path(out).write_text(json.dumps({"before": before, "after": after or "working tree", "rounds": rounds,
                                         "per_round": per_round, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
