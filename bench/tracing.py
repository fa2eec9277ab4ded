"""Part 8: what traces cost (docs/observability.md, "What it costs").

The ok saga of part 1 (three steps on the fast path, in process, PostgreSQL), each of its five calls (open, the
three steps, complete) served as the API serves it: through `TraceMiddleware`, with the agent's `traceparent`.
Three modes, in one process, saga by saga in turn (the order rotating), so that whatever else a shared machine does
hits all three alike:

- `absent`: the calls without the middleware, tracing off: Unwind as if it had no tracing (but for the step's own
  hook, one test of a global, timed on its own in `hooks`);
- `off`: through the middleware, tracing off: what every deployment without `OTEL_*` runs;
- `on`: through the middleware, tracing on: a SERVER span per call, an `execute_tool` span per step, exported by the
  batch processor over OTLP/HTTP to a receiver in another process on loopback (the parent's, tests/otlp_receiver.py).

The child process configures tracing as any process does (`OTEL_EXPORTER_OTLP_ENDPOINT`); `off` and `absent` run
with `tracing._tracer` set to None, the very state of a process without `OTEL_*` (every hook tests that global). The
batch processor's thread exports `on`'s spans while any mode runs, so its share of the cores is reported on its own
(`export_thread_cpu_us_per_step`), besides the per-step times. Differences are of p50s, with a 95 % bootstrap
interval over the sagas' triples and the figure of each child process, to show their spread.

    BENCH_DB=unwind_bench_tracing .venv/bin/python -m bench.tracing [sagas per mode per process] [processes]

(alone, it writes its part of bench/results.json; `make bench` runs it as part 8.)
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import timeit

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BENCH_DB, ROOT, bench_env, log, percentile, recreate_database

STEPS = 3
MODES = ("absent", "off", "on")
TARGET_MS = 0.3  # issue 30: at most 0.3 ms more per step at p50 with tracing on


class ServedSaga:
    """bench.engine.Saga's ok saga, each call served through the middleware (or not, `absent`)."""

    def __init__(self, tenant, agent):
        from django.http import HttpResponse
        from django.test import RequestFactory
        from django.urls import resolve

        from bench.engine import Saga
        from ledger.tracing import TraceMiddleware

        self.saga = Saga(tenant, agent)
        self.resolve = resolve
        self.factory = RequestFactory()
        self.call = None
        self.traced = TraceMiddleware(self._respond)
        self.response = HttpResponse(status=201)

    def _respond(self, request):
        self.result = self.call()
        return self.response

    def serve(self, request, call, through: bool):
        # The route, as Django's handler finds it inside the middleware's call (the same work in every mode): the
        # request span takes its name from it, as in production.
        request.resolver_match = self.resolve(request.path_info)
        if not through:
            return call()
        self.call = call
        self.traced(request)
        return self.result

    def onboard(self, i: int, through: bool) -> str:
        saga = self.saga
        agent_span = f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01"
        request = self.factory.post("/api/v1/runs", HTTP_TRACEPARENT=agent_span)
        run = self.serve(request, lambda: saga.open(f"onboard {i}"), through)
        steps = self.factory.post(f"/api/v1/runs/{run.pk}/actions", HTTP_TRACEPARENT=agent_span)
        user, _ = self.serve(steps, lambda: saga.act(run, "bench.create_user", {"i": i}), through)
        self.serve(steps, lambda: saga.act(run, "bench.provision", {"user_id": user.result["id"]}), through)
        _, failed = self.serve(steps, lambda: saga.act(run, "bench.send_email", {"to": user.result["id"]}), through)
        assert not failed
        done = self.factory.post(f"/api/v1/runs/{run.pk}/complete", HTTP_TRACEPARENT=agent_span)
        return self.serve(done, lambda: saga.run_complete(run=run, actor="agent:bench"), through).status


def export_thread_cpu() -> float:
    """CPU seconds the batch span processor's thread has used so far (Linux: a thread's own CPU clock)."""
    for thread in threading.enumerate():
        if thread.name.startswith("OtelBatchSpan") and thread.ident:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return 0.0


def child(n: int) -> None:
    """In a child process with OTEL_EXPORTER_OTLP_ENDPOINT set: warm up, then `n` sagas of each mode in turn."""
    from bench.common import django_setup

    django_setup()
    from opentelemetry import trace

    from bench.engine import tenant_with_tools
    from ledger import tracing

    tracer = tracing._tracer
    assert tracer is not None, "tracing is not on in the child: OTEL_EXPORTER_OTLP_ENDPOINT?"
    tenant, agent, _ = tenant_with_tools()
    saga = ServedSaga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + os.getpid() % 1000 * 100_000

    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}

    def one(mode: str, i: int) -> float:
        tracing._tracer = tracer if mode == "on" else None
        c0, t0 = time.thread_time(), time.perf_counter()
        assert saga.onboard(i, mode != "absent") == "completed"
        took = time.perf_counter() - t0
        cpu[mode].append(time.thread_time() - c0)
        return took

    for i in range(10):
        for mode in MODES:
            one(mode, base + 90_000 + i * 3 + MODES.index(mode))
    trace.get_tracer_provider().force_flush()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        cpu[mode].clear()
    cpu0 = export_thread_cpu()
    for i in range(n):
        order = MODES[i % 3:] + MODES[:i % 3]
        for mode in order:
            times[mode].append(one(mode, base + i * 3 + MODES.index(mode)))
    trace.get_tracer_provider().force_flush()
    exported = export_thread_cpu() - cpu0
    tracing._tracer = tracer
    in_flow = hooks_in_flow(saga, base + 3 * n + 100, max(10, n // 4))
    print(json.dumps({"times": times, "thread_cpu": cpu, "export_cpu_s": exported, "hooks": hook_costs(tracer),
                      "in_flow": in_flow,
                      "spans_expected": (n + 10 + in_flow["sagas"]) * 8 + 2 * HOOK_RUNS * HOOK_REPEATS}), flush=True)


def hooks_in_flow(saga: "ServedSaga", start: int, n: int) -> dict:
    """What each hook costs the serving thread inside the saga (time.thread_time around it, tracing on), after the
    timed sagas and apart from them: the middleware's own work (its span, the context it reads, the name it
    sets; the call it wraps excluded), the step hook (the `execute_tool` span) and the carrier a proposal
    stores. `hook_costs` times the same hooks in a loop of their own, where they cost a fraction of this."""
    from ledger import tracing

    spent = {"middleware": 0.0, "wrapped": 0.0, "step": 0.0, "carrier": 0.0}
    respond, enter, leave, carrier = saga._respond, tracing._Step.__enter__, tracing._Step.__exit__, \
        tracing.current_carrier

    def timed(key, function):
        def run(*args):
            started = time.thread_time()
            try:
                return function(*args)
            finally:
                spent[key] += time.thread_time() - started
        return run

    middleware = saga.traced
    middleware.get_response = timed("wrapped", respond)
    saga.traced = timed("middleware", middleware)
    tracing._Step.__enter__, tracing._Step.__exit__ = timed("step", enter), timed("step", leave)
    tracing.current_carrier = timed("carrier", carrier)
    try:
        for i in range(n):
            assert saga.onboard(start + i, True) == "completed"
    finally:
        saga.traced, middleware.get_response = middleware, respond
        tracing._Step.__enter__, tracing._Step.__exit__, tracing.current_carrier = enter, leave, carrier
    spent["middleware"] -= spent.pop("wrapped")  # its own work: the call it wraps is the engine's
    return {"sagas": n, **{f"{key}_us_per_saga": round(value / n * 1e6, 1) for key, value in spent.items()}}


HOOK_RUNS, HOOK_REPEATS = 300, 5  # on: 300 spans a repeat, within the batch processor's queue (2048)


def hook_costs(tracer) -> dict:
    """What the hooks cost in the request's own thread, on a step the saga executed, with the agent's context (the
    fastest of 5 repeats): off, the step hook and the middleware each test a global; on, each starts and ends a
    span (queued for the exporter's thread)."""
    from django.http import HttpResponse
    from django.test import RequestFactory
    from django.urls import resolve
    from opentelemetry import trace

    from ledger import tracing
    from ledger.models import Action

    agent_span = f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01"
    action = Action.objects.select_related("tool").filter(kind="forward").order_by("-pk").first()
    action.trace_context = {"traceparent": agent_span}
    request = RequestFactory().post(f"/api/v1/runs/{action.run_id}/actions", HTTP_TRACEPARENT=agent_span)
    request.resolver_match = resolve(request.path_info)  # as Django's handler leaves it (ServedSaga.serve)
    response = HttpResponse(status=201)
    middleware = tracing.TraceMiddleware(lambda r: response)

    def step():
        with tracing.step(action) as attempt:
            attempt.ended(action)

    def best(fn, runs: int) -> float:
        fastest = float("inf")
        for _ in range(HOOK_REPEATS):
            trace.get_tracer_provider().force_flush()
            fastest = min(fastest, timeit.timeit(fn, number=runs))
        return fastest / runs * 1e9

    tracing._tracer = None
    off = {"step_hook_off_ns": best(step, 100_000), "middleware_off_ns": best(lambda: middleware(request), 100_000)}
    tracing._tracer = tracer
    on = {"step_hook_on_us": best(step, HOOK_RUNS) / 1000,
          "middleware_on_us": best(lambda: middleware(request), HOOK_RUNS) / 1000}
    trace.get_tracer_provider().force_flush()
    return {k: round(v, 2) for k, v in {**off, **on}.items()}


def p50_step_ms(seconds: list[float]) -> float:
    return percentile(seconds, 50) / STEPS * 1000


def interval(times: dict[str, list[float]], a: str, b: str, rounds: int = 1000) -> tuple[float, float]:
    """95 % bootstrap interval of p50(a) - p50(b) per step, resampling the sagas' triples (a triple's sagas ran
    back to back, so a resample keeps what they shared)."""
    rng = random.Random(30)
    n = len(times[a])
    diffs = []
    for _ in range(rounds):
        picks = [rng.randrange(n) for _ in range(n)]
        diffs.append(p50_step_ms([times[a][k] for k in picks]) - p50_step_ms([times[b][k] for k in picks]))
    diffs.sort()
    return round(diffs[int(0.025 * rounds)], 3), round(diffs[int(0.975 * rounds) - 1], 3)


def measure(n: int, processes: int) -> dict:
    """`processes` child processes in turn, each timing `n` sagas of each mode; the receiver is in this process."""
    from tests.otlp_receiver import OtlpReceiver

    environment = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                   "load_before": round(os.getloadavg()[0], 2)}
    receiver = OtlpReceiver()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    per_process, hooks, in_flow, export_cpu, expected = [], [], [], 0.0, 0
    try:
        for p in range(processes):
            env = bench_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="unwind-bench")
            done = subprocess.run([sys.executable, "-m", "bench.tracing", "--child", str(n)], cwd=str(ROOT), env=env,
                                  check=True, capture_output=True, text=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            for mode in MODES:
                times[mode] += measured["times"][mode]
                cpu[mode] += measured["thread_cpu"][mode]
            by_mode = {mode: p50_step_ms(measured["times"][mode]) for mode in MODES}
            per_process.append({"on_minus_off_ms": round(by_mode["on"] - by_mode["off"], 3),
                                "off_minus_absent_ms": round(by_mode["off"] - by_mode["absent"], 3)})
            hooks.append(measured["hooks"])
            in_flow.append(measured["in_flow"])
            export_cpu += measured["export_cpu_s"]
            expected += measured["spans_expected"]
            log(f"tracing: process {p + 1}/{processes}, {n} sagas of each mode: {per_process[-1]}")
        deadline = time.time() + 10
        while len(receiver.spans) < expected and time.time() < deadline:
            time.sleep(0.1)
        received = len(receiver.spans)
    finally:
        receiver.close()
    environment["load_after"] = round(os.getloadavg()[0], 2)
    result: dict = {"environment": environment, "sagas_per_mode": len(times["on"]), "processes": processes}
    for mode in MODES:
        per_step = [t / STEPS * 1000 for t in times[mode]]
        result[mode] = {"per_step_p50_ms": round(percentile(per_step, 50), 3),
                        "per_step_p90_ms": round(percentile(per_step, 90), 3)}
    # Same-run ratios of the p50s: comparable across runs on a machine whose speed moves.
    result["on_over_off_p50"] = round(result["on"]["per_step_p50_ms"] / result["off"]["per_step_p50_ms"], 4)
    result["off_over_absent_p50"] = round(result["off"]["per_step_p50_ms"] / result["absent"]["per_step_p50_ms"], 4)
    on_off = round(result["on"]["per_step_p50_ms"] - result["off"]["per_step_p50_ms"], 3)
    off_absent = round(result["off"]["per_step_p50_ms"] - result["absent"]["per_step_p50_ms"], 3)
    result["on_minus_off_per_step_p50_ms"] = {"value": on_off, "interval95": interval(times, "on", "off"),
                                              "per_process": [p["on_minus_off_ms"] for p in per_process]}
    result["off_minus_absent_per_step_p50_ms"] = {"value": off_absent, "interval95": interval(times, "off", "absent"),
                                                  "per_process": [p["off_minus_absent_ms"] for p in per_process]}
    # The same differences in the CPU time of the thread that serves the calls (time.thread_time per saga): what
    # the machine's other work does not change much, unlike the wall clock.
    result["thread_cpu_per_step_p50_ms"] = {mode: round(p50_step_ms(cpu[mode]), 3) for mode in MODES}
    result["thread_cpu_on_minus_off_ms"] = {"value": round(p50_step_ms(cpu["on"]) - p50_step_ms(cpu["off"]), 3),
                                            "interval95": interval(cpu, "on", "off")}
    result["thread_cpu_off_minus_absent_ms"] = {"value": round(p50_step_ms(cpu["off"]) - p50_step_ms(cpu["absent"]), 3),
                                                "interval95": interval(cpu, "off", "absent")}
    # The exporter's thread: its CPU over the timed sagas, per traced step (it runs beside the steps, not in them).
    result["export_thread_cpu_us_per_step"] = round(export_cpu / (len(times["on"]) * STEPS) * 1e6, 1)
    result["hooks"] = {key: min(h[key] for h in hooks) for key in hooks[0]}
    # Each hook inside the saga, per saga (five calls through the middleware, three steps, three proposals): the
    # mean of the processes' means.
    result["hooks_in_flow"] = {key: round(sum(f[key] for f in in_flow) / len(in_flow), 1) for key in in_flow[0]
                               if key != "sagas"} | {"sagas": sum(f["sagas"] for f in in_flow)}
    result["spans"] = {"expected": expected, "received": received}
    low, high = result["on_minus_off_per_step_p50_ms"]["interval95"]
    result["target_on_ms"] = TARGET_MS
    # Met when the whole interval is within the target, not met when it is all beyond it; else this run cannot say.
    result["on_verdict"] = "met" if high <= TARGET_MS else "NOT met" if low > TARGET_MS else "not settled"
    # Off: no cost this run could measure, when its interval holds 0 and is narrow enough to have seen a cost the
    # size of the budget for tracing on; a cost when it is all above 0; else this run cannot say.
    low_off, high_off = result["off_minus_absent_per_step_p50_ms"]["interval95"]
    result["off_verdict"] = "NOT met" if low_off > 0 else "met" if high_off - low_off <= 2 * TARGET_MS else \
        "not settled"
    return result


def lines(r: dict) -> list[str]:
    """The benchmark table's part 8."""
    on, off = r["on_minus_off_per_step_p50_ms"], r["off_minus_absent_per_step_p50_ms"]
    h, c, env = r["hooks"], r["thread_cpu_per_step_p50_ms"], r["environment"]
    cpu_on, cpu_off = r["thread_cpu_on_minus_off_ms"], r["thread_cpu_off_minus_absent_ms"]
    return [
        f"8. tracing, the ok saga's calls through the middleware, {r['sagas_per_mode']} sagas per mode in turn "
        f"({r['processes']} processes, load {env['load_before']:.1f}→{env['load_after']:.1f}), per step p50 / p90: "
        f"absent {r['absent']['per_step_p50_ms']:.2f} / {r['absent']['per_step_p90_ms']:.2f} ms, "
        f"off {r['off']['per_step_p50_ms']:.2f} / {r['off']['per_step_p90_ms']:.2f} ms, "
        f"on {r['on']['per_step_p50_ms']:.2f} / {r['on']['per_step_p90_ms']:.2f} ms; p50 ratios on/off "
        f"{r['on']['per_step_p50_ms'] / r['off']['per_step_p50_ms']:.3f}, "
        f"off/absent {r['off']['per_step_p50_ms'] / r['absent']['per_step_p50_ms']:.3f}",
        f"   on − off {on['value']:+.3f} ms (95 % {on['interval95'][0]:+.3f}..{on['interval95'][1]:+.3f}, per process "
        f"{', '.join(f'{v:+.3f}' for v in on['per_process'])}): target ≤ +{r['target_on_ms']} ms → "
        f"{r['on_verdict']}",
        f"   off − absent {off['value']:+.3f} ms (95 % {off['interval95'][0]:+.3f}..{off['interval95'][1]:+.3f}, per "
        f"process {', '.join(f'{v:+.3f}' for v in off['per_process'])}): "
        f"no measurable cost (at ±{r['target_on_ms']} ms) → {r['off_verdict']}",
        f"   the serving thread's CPU per step p50: absent {c['absent']:.3f}, off {c['off']:.3f}, on {c['on']:.3f} ms: "
        f"on − off {cpu_on['value']:+.3f} ms (95 % {cpu_on['interval95'][0]:+.3f}..{cpu_on['interval95'][1]:+.3f}), "
        f"off − absent {cpu_off['value']:+.3f} ms "
        f"(95 % {cpu_off['interval95'][0]:+.3f}..{cpu_off['interval95'][1]:+.3f})",
        f"   in the request's thread: step hook on {h['step_hook_on_us']:.1f} µs, off {h['step_hook_off_ns']:.0f} ns; "
        f"middleware on {h['middleware_on_us']:.1f} µs, off {h['middleware_off_ns']:.0f} ns; exporter thread "
        f"{r['export_thread_cpu_us_per_step']:.0f} µs CPU per traced step; spans {r['spans']['received']}/"
        f"{r['spans']['expected']} received",
    ] + ([] if "hooks_in_flow" not in r else [in_flow_line(r["hooks_in_flow"])])


def in_flow_line(f: dict) -> str:
    """`hooks_in_flow` per call, step and proposal (a saga: five calls, three steps, three proposals)."""
    mw, step, carrier = f["middleware_us_per_saga"], f["step_us_per_saga"], f["carrier_us_per_saga"]
    return (f"   the same hooks inside the saga (thread CPU, {f['sagas']} sagas): the middleware's own work "
            f"{mw / 5:.0f} µs a call, the step hook {step / STEPS:.0f} µs a step, the carrier a proposal stores "
            f"{carrier / STEPS:.0f} µs: {(mw + step + carrier) / STEPS / 1000:.3f} ms a step")


def main() -> None:
    """This part alone, on a fresh BENCH_DB: its figures replace the `tracing` part of bench/results.json (with the
    commit and the machine's load they were measured on), the rest of the file as the last `make bench` left it."""
    from bench.run import OUT

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    log(f"fresh database {BENCH_DB}, migrated")
    recreate_database(BENCH_DB)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=str(ROOT), env=bench_env(),
                   check=True)
    result = measure(n, processes)
    result["environment"]["alone"] = True
    result["environment"]["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT),
                                                     capture_output=True, text=True, check=False).stdout.strip()
    path = OUT / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["tracing"] = result
    path.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines(result)))
    log(f"written: the tracing part of {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        main()
