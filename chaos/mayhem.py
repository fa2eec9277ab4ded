"""What goes wrong during the load: tool faults in the sandbox, and kills, drops and duplicate deliveries.

Two threads: `ToolFaults` posts failure rules to the chaos tenant's sandbox (POST /sandbox/faults, as its
operator); `Havoc` SIGKILLs
worker trees and web processes, drops database connections and delivers queued work twice. Both stop
when told; `calm()` then clears every rule so the drain runs without faults.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

import requests
from django.db import connection, connections
from django.db.models import F
from django_q.tasks import async_task

from chaos.processes import WebServer, WorkerPool
from chaos.world import FORWARD_TOOLS, GATED, TENANT, sandbox_control
from ledger.executors.call import ToolError
from ledger.models import Attempt, ActionStatus, Run, RunStatus

# Compensations that can be made to fail (payments.refund needs a person and never runs unattended).
FLAKY_COMPENSATIONS = ["hr.delete_user", "licenses.revoke", "travel.cancel_flight", "travel.cancel_hotel"]

# A tool that acts and then answers an error can only answer one that the tool contract leaves open (a 500,
# a 502, a 504): a 503, a 429 or a 4xx tells Unwind the request was not carried out (ToolError.maybe_applied),
# and a tool that acts and says so anyway breaks the contract rather than tests Unwind. Read off the
# engine's own rule, so the harness cannot drift from it again (it once injected "acted, then 503").
MAY_HAVE_ACTED = [status for status in (500, 502, 503, 504) if ToolError("", transient=True, status=status).maybe_applied]

TOOL_FAULTS = {  # kind -> weight
    "burst_429": 2, "http_5xx": 3, "timeout": 2, "latency": 3, "error_after_effect": 2,
    "compensation_fails_then_succeeds": 2, "compensation_never_succeeds": 1,
}


def tool_fault(kind: str, rng: random.Random) -> dict:
    """One failure rule of the given kind, on a random tool."""
    tool = rng.choice(FORWARD_TOOLS)
    if kind == "burst_429":
        return {"tool": tool, "mode": "status", "status": 429, "times": rng.randint(3, 6)}
    if kind == "http_5xx":
        return {"tool": tool, "mode": "status", "status": rng.choice([500, 502, 503]), "times": rng.randint(1, 2)}
    if kind == "timeout":
        # Up to longer than the tool's 10 s timeout: then Unwind gives up first, and the sandbox applies nothing.
        return {"tool": tool, "mode": "timeout", "seconds": rng.choice([0.5, 1.5, 3.0, 11.0])}
    if kind == "latency":
        return {"tool": tool, "mode": "latency", "ms": rng.randint(200, 2500), "times": rng.randint(1, 3)}
    if kind == "error_after_effect":
        return {"tool": tool, "mode": "error_after_effect", "status": rng.choice(MAY_HAVE_ACTED),
                "times": rng.randint(1, 3)}
    compensation = rng.choice(FLAKY_COMPENSATIONS)
    if kind == "compensation_fails_then_succeeds":
        return {"tool": compensation, "mode": "status", "status": 503, "times": rng.randint(2, 4)}
    if kind == "compensation_never_succeeds":
        return {"tool": compensation, "mode": "status", "status": rng.choice([400, 409]), "times": 1}
    raise ValueError(kind)


class ToolFaults(threading.Thread):
    def __init__(self, *, base_url: str, stop: threading.Event, seed: int, every: tuple[float, float] = (0.6, 1.8)):
        super().__init__(name="tool-faults", daemon=True)
        self.base_url = base_url
        self.stop_event = stop
        self.rng = random.Random(seed)
        self.every = every
        self.posted: Counter = Counter()

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(*self.every)):
            kind = self.rng.choices(list(TOOL_FAULTS), weights=list(TOOL_FAULTS.values()))[0]
            try:
                sandbox_control("POST", self.base_url, "faults", json=tool_fault(kind, self.rng)).raise_for_status()
                self.posted[kind] += 1
            except requests.RequestException:
                pass  # the web process that would have taken it was killed: no rule, nothing to count


def calm(base_url: str) -> None:
    """Clear every fault rule of both tenants (retrying through a restarting server)."""
    for attempt in range(30):
        try:
            for tenant in (TENANT, GATED):
                sandbox_control("POST", base_url, "faults/clear", tenant=tenant).raise_for_status()
            return
        except requests.RequestException:
            time.sleep(0.5)
    raise RuntimeError("could not clear the sandbox's fault rules")


HAVOC = {"worker_kill": 3, "web_kill": 1, "db_connection_drop": 2, "duplicate_delivery": 3}


class Havoc(threading.Thread):
    """kill -9 of worker trees (restarted after a pause) and of web processes, dropped database
    connections (PostgreSQL), and queued tasks delivered twice."""

    def __init__(self, *, web: WebServer, workers: WorkerPool, stop: threading.Event, seed: int,
                 every: tuple[float, float] = (2.0, 6.0)):
        super().__init__(name="havoc", daemon=True)
        self.web = web
        self.workers = workers
        self.stop_event = stop
        self.rng = random.Random(seed)
        self.every = every
        self.done: Counter = Counter()
        self.restarts: list[tuple[float, object]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            while not self.stop_event.wait(self.rng.uniform(*self.every)):
                self.restart_due()
                kinds = [k for k in HAVOC if k != "db_connection_drop" or connection.vendor == "postgresql"]
                kind = self.rng.choices(kinds, weights=[HAVOC[k] for k in kinds])[0]
                try:
                    getattr(self, kind)()
                except Exception as exc:  # noqa: BLE001 - havoc must not stop itself; its failures are reported
                    self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                finally:
                    connections.close_all()
        finally:
            self.restart_due(everything=True)

    def restart_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        for due, child in list(self.restarts):
            if everything or due <= now:
                if not child.alive:
                    child.start()
                self.restarts.remove((due, child))
        # A worker that died by itself (e.g. its cluster lost the database) comes back too.
        pending = {id(child) for _, child in self.restarts}
        for child in self.workers.children:
            if not child.alive and id(child) not in pending:
                child.start()
                self.done["worker_restarted_after_exit"] += 1

    def worker_kill(self) -> None:
        child = self.workers.kill_one(self.rng)
        if child is not None:
            self.done["worker_kill"] += 1
            self.restarts.append((time.monotonic() + self.rng.uniform(0.5, 4.0), child))

    def web_kill(self) -> None:
        if self.web.kill_a_worker(self.rng):
            self.done["web_kill"] += 1

    def db_connection_drop(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND state IN ('active', 'idle in transaction') ORDER BY random() LIMIT 1")
            row = cursor.fetchone()
        if row and row[0]:
            self.done["db_connection_drop"] += 1

    def duplicate_delivery(self) -> None:
        """Deliver the work in flight twice more: the execute task of a running action, carrying the owner its
        claim handed out (recorded on the attempt), and the unwind of an unwinding run (django-q2 delivers at
        least once). A step claimed by the API's fast path or the unwinder was never queued; its delivery is
        a stray one, and must be refused."""
        running = list(Attempt.objects.filter(action__status=ActionStatus.RUNNING, finished_at__isnull=True,
                                              number=F("action__attempts")).values_list("action_id", "worker")[:50])
        if running:
            action_id, owner = self.rng.choice(running)
            for _ in range(2):
                async_task("ledger.tasks.execute_action", action_id, owner, group="execute_action")
            self.done["duplicate_delivery"] += 1
        unwinding = list(Run.objects.filter(status=RunStatus.UNWINDING).values_list("pk", flat=True)[:50])
        if unwinding:
            run_id = self.rng.choice(unwinding)
            for _ in range(2):
                async_task("ledger.tasks.unwind_run", run_id, group="unwind_run")
            self.done["duplicate_unwind_delivery"] += 1
