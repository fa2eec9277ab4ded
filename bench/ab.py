"""Two versions of the engine side by side: part 1's 3-step saga (succeeding, and failing at step 3 with two
compensations) timed on each, in interleaved rounds on one machine, so drift hits both alike.

    .venv/bin/python -m bench.ab BEFORE [AFTER] [ROUNDS] [PER_ROUND]

BEFORE and AFTER are git revisions (AFTER defaults to this working tree, uncommitted changes included). Each side
gets a checkout of its own (a git worktree in a temporary folder, removed afterwards) and a PostgreSQL database of
its own (`unwind_ab_<side>` on BENCH_PG, created afresh and migrated by that side's code), and runs in a child
process of its own importing that side's code. Rounds alternate which side goes first; the first round warms up.
Prints each side's p50 and the ratio after / before: what "no regression beyond noise" is judged by (issue 27).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import PG_BASE, ROOT, log, recreate_database

CHILD = """
import json, os, sys, time
sys.path.insert(0, os.environ["AB_ROOT"])
os.chdir(os.environ["AB_ROOT"])
from bench.common import django_setup, timed
django_setup(UNWIND_TASKS_SYNC="0")
from bench.engine import Saga, tenant_with_tools
tenant, agent, _ = tenant_with_tools()
saga = Saga(tenant, agent)
base, count = int(time.time() * 1000) % 10**9 * 1000, 0
print("ready", flush=True)
for line in sys.stdin:
    ok, fail = [], []
    for _ in range(int(line)):
        count += 1
        ok.append(timed(saga.onboard, base + count, False))
        fail.append(timed(saga.onboard, base + 500_000 + count, True))
    print(json.dumps({"ok": ok, "fail": fail}), flush=True)
"""


def side(name: str, root: Path) -> subprocess.Popen:
    database = f"unwind_ab_{name}"
    recreate_database(database)
    env = dict(os.environ, DATABASE_URL=f"{PG_BASE}/{database}", BENCH_DB=database, AB_ROOT=str(root))
    env.setdefault("UNWIND_INSECURE_DEV_KEY", "1")  # a throwaway database: the public development key
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=root, env=env, check=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    if child.stdout.readline().strip() != "ready":
        raise SystemExit(f"the {name} side did not start")
    return child


def compare(roots: dict[str, Path], rounds: int, per_round: int) -> dict:
    children = {name: side(name, root) for name, root in roots.items()}
    times = {name: {"ok": [], "fail": []} for name in roots}
    try:
        for number in range(rounds + 1):
            order = list(roots) if number % 2 == 0 else list(reversed(roots))
            for name in order:
                children[name].stdin.write(f"{per_round}\n")
                children[name].stdin.flush()
                got = json.loads(children[name].stdout.readline())
                if number:  # round 0 warms up
                    for case in got:
                        times[name][case] += got[case]
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)
    result = {}
    for case in ("ok", "fail"):
        before, after = (statistics.median(times[name][case]) * 1000 for name in roots)
        result[case] = {"before_p50_ms": round(before, 3), "after_p50_ms": round(after, 3),
                        "ratio": round(after / before, 3), "n": len(times["after"][case])}
    return result


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    args = list(argv)
    before = args.pop(0)
    after = args.pop(0) if args and not args[0].isdigit() else None
    rounds = int(args[0]) if args else 10
    per_round = int(args[1]) if len(args) > 1 else 100
    with tempfile.TemporaryDirectory(prefix="unwind-ab-") as folder:
        roots = {}
        for name, revision in (("before", before), ("after", after)):
            if revision is None:
                roots[name] = ROOT
                continue
            roots[name] = Path(folder) / name
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(roots[name]), revision], cwd=ROOT,
                           check=True)
        try:
            log(f"A/B: {before} against {after or 'the working tree'}, {rounds} rounds of {per_round} sagas each")
            result = compare(roots, rounds, per_round)
        finally:
            for name, root in roots.items():
                if root != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(root)], cwd=ROOT, check=False)
    for case, figures in result.items():
        print(f"{case}: before {figures['before_p50_ms']:.2f} ms, after {figures['after_p50_ms']:.2f} ms, "
              f"after / before {figures['ratio']:.3f} (n = {figures['n']} each)")


if __name__ == "__main__":
    main(sys.argv[1:])
