"""What traces cost: the ok saga (3 steps, fast path, in process on PostgreSQL) with tracing off, and on with an
OTLP/HTTP receiver on loopback (docs/observability.md). Each mode runs in its own process (the SDK is set up once
per process); the modes alternate over rounds so that drift on a shared machine hits both alike.

    BENCH_DB=unwind_bench_tracing .venv/bin/python -m bench.tracing [sagas per round] [rounds]

Prints one JSON object: per-step p50/p90 in ms for each mode, and what the `execute_tool` hook costs in the
step's own thread (the fastest round: the least disturbed by the rest of the machine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import timeit

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BENCH_DB, ROOT, bench_env, log, percentile, recreate_database

STEPS = 3


def one_mode(n: int) -> None:
    """In a child process: warm up, then time `n` ok sagas; prints the seconds of each as JSON."""
    from bench.common import django_setup

    django_setup()
    from bench.engine import Saga, tenant_with_tools

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + os.getpid() % 1000 * 100_000
    for i in range(20):
        assert saga.onboard(base + 90_000 + i, False) == "completed"
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        assert saga.onboard(base + i, False) == "completed"
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "hook_ns": hook_cost()}), flush=True)


def hook_cost() -> float:
    """Nanoseconds one `with tracing.step(action):` costs in this thread, on a step the saga executed: with tracing
    off, the test of a global; on, starting and ending the span (its export happens in the processor's thread)."""
    from ledger import tracing
    from ledger.models import Action

    action = Action.objects.select_related("tool").filter(kind="forward").order_by("-pk").first()
    action.trace_context = None

    def hook():
        with tracing.step(action):
            pass
    runs = 2_000 if tracing.enabled() else 200_000
    return timeit.timeit(hook, number=runs) / runs * 1e9


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    from tests.otlp_receiver import OtlpReceiver

    log(f"fresh database {BENCH_DB}, migrated")
    recreate_database(BENCH_DB)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=str(ROOT), env=bench_env(),
                   check=True)
    receiver = OtlpReceiver()
    modes = {"off": {}, "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    hooks: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode, extra in (modes.items() if r % 2 == 0 else reversed(modes.items())):
            env = {k: v for k, v in bench_env(**extra).items() if mode == "on" or not k.startswith("OTEL_")}
            child = subprocess.run([sys.executable, "-m", "bench.tracing", "--child", str(n)], cwd=str(ROOT),
                                   env=env, check=True, capture_output=True, text=True)
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            times[mode] += measured["times"]
            hooks[mode].append(measured["hook_ns"])
            log(f"round {r + 1}/{rounds} {mode}: {n} sagas")
    receiver.close()
    result = {}
    for mode, values in times.items():
        per_step = [v / STEPS * 1000 for v in values]
        result[mode] = {"sagas": len(values), "per_step_p50_ms": round(percentile(per_step, 50), 3),
                        "per_step_p90_ms": round(percentile(per_step, 90), 3),
                        "execute_tool_hook_us": round(min(hooks[mode]) / 1000, 2)}
    result["on_minus_off_per_step_p50_ms"] = round(result["on"]["per_step_p50_ms"] - result["off"]["per_step_p50_ms"],
                                                   3)
    result["spans_received"] = len(receiver.spans)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        one_mode(int(sys.argv[2]))
    else:
        main()
