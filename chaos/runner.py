"""One chaos phase, in its own process: a fresh database, a web server, workers, scripted faults, load under
random faults and kills, a drain without faults, and the verdict on every run.

The phase process configures Django for its own database and broker before importing any model, which is
why each broker runs in a process of its own (see `chaos.__main__`).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent

WORKER_FAILPOINTS = "before_tool_call:0.04,after_tool_call:0.04,mid_unwind:0.08"
WEB_FAILPOINTS = "before_tool_call:0.004,after_tool_call:0.004,mid_unwind:0.01"


def configure(*, database_url: str, broker: str, redis_url: str, queue: str) -> None:
    """Point this process's Django at the phase's database and broker, then set it up."""
    os.environ["DATABASE_URL"] = database_url
    os.environ["UNWIND_TASKS_SYNC"] = "0"
    os.environ["UNWIND_QUEUE_NAME"] = queue
    os.environ.pop("UNWIND_FAILPOINTS", None)
    if broker == "redis":
        os.environ["UNWIND_REDIS_URL"] = redis_url
    else:
        os.environ.pop("UNWIND_REDIS_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    # Throwaway chaos databases: the public development key, asked for by name; the web servers and workers
    # started later inherit it with the rest of this environment.
    os.environ.setdefault("UNWIND_INSECURE_DEV_KEY", "1")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def recreate_database(database_url: str) -> None:
    """Drop and create the phase's database (PostgreSQL), or delete its file (SQLite)."""
    from config.env import database_from_url

    parsed = urlparse(database_url)
    if parsed.scheme == "sqlite":
        path = Path(database_from_url("DATABASE_URL", database_url, base_dir=ROOT)["NAME"])
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    import psycopg
    from psycopg import sql

    name = unquote(parsed.path.lstrip("/"))
    with psycopg.connect(host=parsed.hostname or "127.0.0.1", port=parsed.port or 5432, user=unquote(parsed.username or ""),
                         password=unquote(parsed.password or "") or None, dbname="postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def settled(tenant_ids: list[int]) -> bool:
    """Nothing left for the workers: no step in flight or due, no run unwinding or waiting for a person, and no
    run still open. The agents have all stopped by now, so an open run is one whose agent died mid-saga: its idle
    deadline (the agents open runs with `IDLE_TIMEOUT`) must unwind it, as it would for an agent that walks away."""
    from ledger.models import Action, Run
    from ledger.models import ActionStatus as A
    from ledger.models import RunStatus as R

    busy = [A.PLANNED, A.APPROVED, A.RUNNING, A.RETRY_SCHEDULED]
    return not (Action.objects.filter(tenant_id__in=tenant_ids, status__in=busy).exists()
                or Run.objects.filter(tenant_id__in=tenant_ids,
                                      status__in=[R.RUNNING, R.UNWINDING, R.AWAITING_APPROVAL]).exists())


def drain(tenant_ids: list[int], timeout: float, *, tick=None) -> tuple[bool, float]:
    """Wait until nothing is left for the workers; `tick()` runs each second (a person deciding, say)."""
    from django.db import close_old_connections

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        close_old_connections()
        try:
            if tick is not None:
                tick()
            if settled(tenant_ids):
                return True, round(time.monotonic() - started, 1)
        except Exception:  # noqa: BLE001 - a dropped connection during the drain: ask again
            close_old_connections()
        time.sleep(1.0)
    return False, round(time.monotonic() - started, 1)


class Approver:
    """The person who approves compensations waiting for one: the refund of a charge that landed after its run
    was cancelled needs a person (payments.refund is approval: manual), whatever the tenant's threshold."""

    def __init__(self, base_url: str, username: str, password: str, tenant_ids: list[int]):
        self.base_url = base_url
        self.auth = (username, password)
        self.tenant_ids = tenant_ids
        self.approved = 0

    def __call__(self) -> None:
        import requests

        from approvals.models import ApprovalRequest

        pending = ApprovalRequest.objects.filter(tenant_id__in=self.tenant_ids, status="pending", is_compensation=True)
        for pk in pending.values_list("pk", flat=True):
            response = requests.post(f"{self.base_url}/api/v1/approvals/{pk}/approve", auth=self.auth, timeout=30,
                                     json={"reason": "the charge landed after the cancel: refund it"})
            self.approved += response.status_code == 200


def run_phase(*, broker: str, database_url: str, redis_url: str, load_seconds: float, agents: int, workers: int,
              web_processes: int, seed: int, drain_timeout: float, log_dir: Path) -> dict:
    queue = f"unwind-chaos-{broker}-{os.getpid()}"
    private_database = None
    if database_url.startswith("private"):
        from chaos.processes import PrivatePostgres

        private_database = PrivatePostgres()  # the phase's own server, which the database scenarios restart and stall
        private_database.start()
        database_url = private_database.url(f"unwind_chaos_{broker}")
    recreate_database(database_url)
    private_redis = None
    if broker == "redis" and redis_url == "private":
        from chaos.processes import PrivateRedis

        private_redis = PrivateRedis()  # the phase's own broker, which the broker_lost scenario stops and starts
        private_redis.start()
        redis_url = private_redis.url
    configure(database_url=database_url, broker=broker, redis_url=redis_url, queue=queue)

    from django.core.management import call_command
    from django.db import connection

    from chaos.agents import Agent, Canceller, Knobs, Recorder
    from chaos.checks import Checker
    from chaos.mayhem import Havoc, ToolFaults, calm
    from chaos.processes import WebServer, WorkerPool, free_port
    from chaos.scenarios import Scenarios
    from chaos.world import PASSWORD, cast_create

    call_command("migrate", verbosity=0)
    cast = cast_create()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    os.environ["UNWIND_TOOL_BASE_URL"] = base_url
    from django.conf import settings

    settings.UNWIND_TOOL_BASE_URL = base_url
    settings.UNWIND_LEASE_SECONDS = 10.0  # as the web and workers have it: the scenarios claim steps here too
    env = dict(os.environ, DATABASE_URL=database_url, UNWIND_TOOL_BASE_URL=base_url, UNWIND_BASE_URL=base_url,
               UNWIND_SANDBOX="1", UNWIND_TASKS_SYNC="0", UNWIND_SWEEP_INTERVAL="0.5", UNWIND_WORKERS="2",
               UNWIND_LEASE_SECONDS="10",
               UNWIND_INLINE_WAIT="2", UNWIND_THROTTLE_RATE="1000000/min", UNWIND_QUEUE_NAME=queue,
               EMAIL_BACKEND="django.core.mail.backends.dummy.EmailBackend", LOG_LEVEL="WARNING",
               PYTHONPATH=str(ROOT), DJANGO_SETTINGS_MODULE="config.settings")
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("*.log"):
        old.unlink()
    web = WebServer(env=env, log=log_dir / "web.log", workers=web_processes, port=port)
    pool = WorkerPool(count=workers, env=env, log_dir=log_dir)
    recorder = Recorder()
    result: dict = {"broker": broker, "database": connection.vendor + (" (private)" if private_database else ""), "workers": workers, "web_processes": web_processes,
                    "agents": agents, "load_seconds": load_seconds}
    try:
        web.start()
        pool.start()
        say(f"[{broker}] web {base_url} ({web_processes} processes), {workers} workers; scripted scenarios")
        result["scenarios"] = Scenarios(web=web, workers=pool, cast=cast, recorder=recorder,
                                        broker=private_redis, database=private_database).all()
        for scenario in result["scenarios"]:
            say(f"[{broker}]   {'ok  ' if scenario['ok'] else 'FAIL'} {scenario['name']}: {scenario['detail']}")

        say(f"[{broker}] load: {agents} agents for {load_seconds:g}s with faults, kills and failpoints")
        web.stop()
        web.start(failpoints=WEB_FAILPOINTS)
        pool.restart_all(failpoints=WORKER_FAILPOINTS)
        stop = threading.Event()
        crowd = [Agent(f"agent-{n}", base_url=base_url, key=cast.key, recorder=recorder, stop=stop, knobs=Knobs(),
                       seed=seed * 1000 + n) for n in range(agents)]
        canceller = Canceller(base_url=base_url, key=cast.key, recorder=recorder, stop=stop, seed=seed + 1)
        faults = ToolFaults(base_url=base_url, stop=stop, seed=seed + 2)
        havoc = Havoc(web=web, workers=pool, stop=stop, seed=seed + 3)
        started = time.monotonic()
        for thread in (*crowd, canceller, faults, havoc):
            thread.start()
        time.sleep(load_seconds)
        stop.set()
        for thread in (canceller, faults, havoc):
            thread.join(timeout=30)
        say(f"[{broker}] load over; waiting for the agents to finish their runs")
        for agent in crowd:
            agent.join(timeout=max(1.0, 240 - (time.monotonic() - started - load_seconds)))
        busy_seconds = time.monotonic() - started

        say(f"[{broker}] faults off; workers and web restarted clean; draining")
        calm(base_url)
        web.stop()
        web.start()
        pool.restart_all()
        approver = Approver(base_url, cast.approver, PASSWORD, cast.tenant_ids)
        drained, drain_seconds = drain(cast.tenant_ids, drain_timeout, tick=approver)

        from django.db import connections
        connections.close_all()
        seen = {view.run_id: set(view.actions) for view in recorder.runs.values()}
        anomalies = {view.run_id: list(view.anomalies) for view in recorder.runs.values() if view.anomalies}
        verdict = Checker(cast.tenant_ids, seen=seen, anomalies=anomalies).report()
        ended = sum(1 for view in recorder.runs.values() if view.ended and view.saga != "scenario")
        process_faults = {
            "worker_kill (kill -9 of a worker tree)": pool.kills,
            "failpoint_kill in workers": pool.failpoint_kills(),
            "failpoint_kill in web": max(0, web.sigkilled_workers() - web.kills),
            "web_kill (kill -9 of a web process)": web.kills,
            "db_connection_drop": havoc.done["db_connection_drop"],
            "duplicate_delivery (execute task x2)": havoc.done["duplicate_delivery"] + recorder.counters["duplicate_delivery"],
            "duplicate_delivery (unwind task x2)": havoc.done["duplicate_unwind_delivery"],
            "concurrent_duplicate_requests": recorder.counters["concurrent_duplicate_requests"],
            "reordered_json_resend": recorder.counters["reordered_resends"],
            "cancelled_mid_flow": recorder.counters["cancelled_mid_flow"],
            "agent_abort (agent cancels)": recorder.counters["agent_abort"],
            "open_answer_lost (agent looked its run up)": recorder.counters["open_answer_lost"],
        }
        result.update(verdict)
        result["left_running"] = left_running(cast.tenant_ids)
        result["faults"] = {**{f"tool: {k}": v for k, v in verdict["tool_faults"].items()},
                            **{k: v for k, v in process_faults.items() if v}}
        result["faults_injected"] = sum(result["faults"].values())
        result["fault_rules_posted"] = dict(faults.posted)
        result["drained"] = drained
        result["drain_seconds"] = drain_seconds
        result["throughput_runs_per_s"] = round(ended / busy_seconds, 2) if busy_seconds else 0
        result["throughput_steps_per_s"] = round(recorder.latency()["steps"] / busy_seconds, 2) if busy_seconds else 0
        result["latency"] = recorder.latency()
        result["harness"] = {
            "agent_errors": [e for agent in crowd for e in agent.errors][:20],
            "havoc_errors": havoc.errors[:20],
            "agents_still_running": sum(1 for agent in crowd if agent.is_alive()),
            "agent_counters": dict(recorder.counters),
            "worker_restarts_after_exit": havoc.done["worker_restarted_after_exit"],
            "compensations_approved_in_the_drain": approver.approved,
        }
        result["passed"] = passed(result)
        return result
    finally:
        pool.stop()
        web.stop()
        if private_redis is not None:
            private_redis.remove()
        elif broker == "redis":
            _forget_queue(redis_url, queue)
        if private_database is not None:
            from django.db import connections

            connections.close_all()
            private_database.stop()


def passed(result: dict) -> bool:
    return (result["integrity_pct"] == 100.0 and result["duplicate_effects"] == 0 and result["lost_entries"] == 0
            and result["never_sent_items"] == 0 and result["left_running"] == 0
            and result["audit_ok"] and result["drained"] and not result["wrong_answers"]
            and all(s["ok"] for s in result["scenarios"]))


def left_running(tenant_ids: list[int]) -> int:
    """Runs still running or unwinding once the drain is over (the agents stopped, the faults cleared)."""
    from ledger.models import Run
    from ledger.models import RunStatus as R

    return Run.objects.filter(tenant_id__in=tenant_ids, status__in=[R.RUNNING, R.UNWINDING]).count()


def _forget_queue(redis_url: str, queue: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"django_q:{queue}:*"):
        client.delete(key)


def say(line: str) -> None:
    print(line, flush=True)


def phase_main(args) -> int:
    result = run_phase(broker=args.phase, database_url=args.database_url, redis_url=args.redis_url,
                       load_seconds=args.load_seconds, agents=args.agents, workers=args.workers,
                       web_processes=args.web_processes, seed=args.seed, drain_timeout=args.drain_timeout,
                       log_dir=Path(args.log_dir))
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0
