"""Part 5: crash recovery with a real worker.

A child process executes a claimed action and is SIGKILLed right after the tool call
(UNWIND_FAILPOINTS=after_tool_call: the effect happened, its outcome is not recorded). A real
`manage.py worker` (django-q2 cluster + sweep clock, default 1 s) is running meanwhile. Timed: from the
kill to the action picked up again (its second attempt starts) and to it `succeeded`. The target is the
action's lease (tool timeout + 1 s, counted from when it was claimed) + 1 s.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.common import ROOT, bench_env, log

TOOL = "bench.crashy"
TIMEOUT = 2.0  # the tool's timeout: its action's lease is timeout + 1 s


def register(tenant) -> None:
    from ledger.policy.versions import tool_upsert

    tool_upsert(tenant=tenant, name=TOOL, actor="bench", spec={
        "executor": {"kind": "python", "path": "bench.noop.noop"}, "risk": "low", "args_schema": {"type": "object"},
        "compensation": {"strategy": "none"}, "timeout": TIMEOUT,
    })


def start_worker() -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=str(ROOT), start_new_session=True,
                              env=bench_env(UNWIND_TASKS_SYNC="0"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return worker


def stop_worker(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


def wait_for(predicate, timeout: float, step: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


def trial(tenant, agent, index: int) -> dict:
    """The child claims the action and executes it as the API's fast path does, and is killed after the call."""
    from ledger.models import Action, Attempt
    from ledger.engine.runs import run_open

    run = run_open(tenant=tenant, agent=agent, goal=f"crash {index}", actor="agent:bench")
    key = f"bench-crash-{run.pk}"
    code = ("import django; django.setup(); from ledger.models import Run; from ledger.engine import execution; "
            "from ledger.engine.proposal import action_propose; "
            f"p = action_propose(run=Run.objects.get(pk={run.pk}), tool_name={TOOL!r}, args={{'run': {run.pk}}}, "
            f"actor='agent:bench', idempotency_key={key!r}); execution.execute(p.action.pk, owner=p.owner, sole_owner=True)")
    dying = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, timeout=120, check=False,
                           env=bench_env(UNWIND_FAILPOINTS="after_tool_call"))
    killed = time.time()
    assert dying.returncode == -signal.SIGKILL, dying.stderr.decode()[-1500:]
    action = Action.objects.get(tenant=tenant, idempotency_key=key)
    lease = (action.lease_expires_at - action.created_at).total_seconds()
    lease_left = action.lease_expires_at.timestamp() - killed

    def picked_up():
        return Attempt.objects.filter(action_id=action.pk, number=2).values_list("started_at", flat=True).first()

    def finished():
        status, at = Action.objects.filter(pk=action.pk).values_list("status", "finished_at").get()
        return at if status == "succeeded" else None

    picked = wait_for(picked_up, 60)
    done = wait_for(finished, 60)
    assert picked and done, Action.objects.get(pk=action.pk).status
    return {
        "lease_s": round(lease, 2), "lease_left_at_kill_s": round(lease_left, 2),
        "picked_up_s": round(picked.timestamp() - killed, 3), "finished_s": round(done.timestamp() - killed, 3),
        "target_s": round(lease + 1, 2),
    }


def measure(tenant, agent, trials: int, warmup: int = 1) -> dict:
    from django_q.models import OrmQ

    register(tenant)
    # The engine part leaves a queued backstop unwind for every run it failed (and settled inline); a
    # fresh worker would first work through hundreds of no-ops. Recovery is timed on an idle queue.
    OrmQ.objects.all().delete()
    worker = start_worker()
    try:
        # Untimed trials first: recovery is timed, not the worker's boot (a smoke skips them).
        for i in range(warmup):
            trial(tenant, agent, -1 - i)
        if worker.poll() is not None:
            raise RuntimeError(worker.stderr.read().decode()[-2000:])
        rows = []
        for i in range(trials):
            rows.append(trial(tenant, agent, i))
            log(f"crash: trial {i + 1}/{trials}: {rows[-1]}")
    finally:
        stop_worker(worker)
    finished = sorted(r["finished_s"] for r in rows)
    return {
        "trials": rows, "finished_p50_s": finished[len(finished) // 2], "finished_max_s": finished[-1],
        "target_s": rows[0]["target_s"], "sweep_interval_s": float(os.environ.get("UNWIND_SWEEP_INTERVAL", "1.0")),
        "untimed_trials": warmup,
    }
