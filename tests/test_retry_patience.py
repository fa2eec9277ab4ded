"""Issue 39, finding 10: a tool that is down for a moment does not hand a person work the engine would have done.

An undo whose tool refuses connections, and a step whose call never left, are tried again with a backoff that grows
from UNWIND_PATIENT_BACKOFF (doubling, jittered, capped at UNWIND_MAX_BACKOFF) for UNWIND_RETRY_PATIENCE seconds,
past the tool's own `retry.max_attempts`, before a person is asked; when the tool is back within that time the run
ends as if nothing happened. The agent talks to a live Unwind over HTTP; the tools are real HTTP servers on loopback,
the one that is down a port nobody listens on until the test starts one there. The sweep runs here, as a worker's
clock would (tests/test_g05_crash_safety.py does the same), at its short interval.

And a worker whose database connection was ended between two tasks (a PostgreSQL restart, a pooler, an
administrator's pg_terminate_backend) runs the second task at once, on a new connection, instead of dying on its first
statement and leaving its step to wait out a lease.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.db import connection
from django_q.conf import Conf

from approvals.models import ApprovalRequest
from ledger.engine import attempts
from ledger.engine.sweep import sweep
from ledger.executors.call import ToolError
from ledger.models import Action, ActionKind, Run
from recovery.models import RecoveryItem
from sandbox.selectors import call_list
from tests.conftest import needs_postgres
from tests.helpers import acme
from tests.quick_server import QUICK_SHUTDOWN
from tests.test_args_as_sent import put_tool
from tests.test_g05_crash_safety import ROOT, database_url, process_env, wait_until

SCHEMA = {"type": "object", "properties": {"ref": {"type": "string"}}}


class Tool:
    """A loopback HTTP tool on a port of its own that can be down (nothing listens: connections are refused) or up
    (each POST is answered 200 and its body kept)."""

    def __init__(self):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()  # nobody listens there now: a connection is refused
        self.origin = f"http://127.0.0.1:{self.port}"
        self.bodies: list[bytes] = []
        self.server: ThreadingHTTPServer | None = None

    def up(self) -> None:
        tool = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                tool.bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                answer = json.dumps({"ok": True, "n": len(tool.bodies)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def down(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture
def patient(http_tools, settings):
    """`rec.send` (up) whose undo is `rec.undo` (at first down), both HTTP tools allowed by origin; the waits short."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    settings.UNWIND_PATIENT_BACKOFF = 0.3
    settings.UNWIND_MAX_BACKOFF = 1.2
    settings.UNWIND_RETRY_PATIENCE = 60
    send, undo = Tool(), Tool()
    send.up()
    settings.UNWIND_TOOL_ORIGINS = [send.origin, undo.origin]
    put_tool(http_tools, "rec.undo", {"endpoint": f"{undo.origin}/undo", "args_schema": SCHEMA, "compensation": "none",
                                      "retry": {"max_attempts": 2, "backoff": 0.05}})
    put_tool(http_tools, "rec.send", {"endpoint": f"{send.origin}/send", "args_schema": SCHEMA,
                                      "retry": {"max_attempts": 2, "backoff": 0.05},
                                      "compensation": {"strategy": "twin", "tool": "rec.undo",
                                                       "args": {"ref": "$args.ref"}}})
    http_tools.send, http_tools.undo = send, undo
    http_tools.agent = requests.Session()
    http_tools.agent.headers["Authorization"] = f"Bearer {http_tools.key}"
    yield http_tools
    send.down()
    undo.down()


def open_run(world) -> int:
    answer = world.agent.post(f"{world.live_server.url}/api/v1/runs", json={"goal": "patience"}, timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def propose(world, run_id: int, args: dict) -> dict:
    answer = world.agent.post(f"{world.live_server.url}/api/v1/runs/{run_id}/actions",
                              json={"tool": "rec.send", "args": args}, timeout=60)
    assert answer.status_code in (200, 201, 202), answer.text
    return answer.json()


def cancel(world, run_id: int) -> None:
    answer = world.agent.post(f"{world.live_server.url}/api/v1/runs/{run_id}/cancel", json={"reason": "stop"},
                              timeout=60)
    assert answer.status_code == 200, answer.text


def sweeping(seconds: float, until=lambda: False) -> bool:
    """Sweep as a worker's clock would for up to `seconds`, stopping early once `until()`; whether it did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sweep()
        if until():
            return True
        time.sleep(0.05)
    return until()


def starts(action: Action) -> list[float]:
    return [started.timestamp() for started in action.attempt_set.order_by("number").values_list("started_at", flat=True)]


def test_an_undo_whose_tool_refuses_connections_waits_for_it_and_runs_once_it_is_back(patient):
    run_id = open_run(patient)
    assert propose(patient, run_id, {"ref": "r-1"})["status"] == "succeeded"
    cancel(patient, run_id)  # the unwind starts in the request: its undo's connection is refused
    undo = Action.objects.get(run_id=run_id, kind=ActionKind.COMPENSATION)
    assert sweeping(5.0, lambda: Action.objects.get(pk=undo.pk).attempts >= 5)
    undo.refresh_from_db()
    # Past the tool's own 2 attempts, and still nobody is asked: the run waits for its undo.
    assert undo.status in ("retry_scheduled", "running") and undo.error_class == "not_sent", undo.status
    assert Run.objects.get(pk=run_id).status == "unwinding" and not RecoveryItem.objects.filter(run_id=run_id).exists()
    gaps = [b - a for a, b in zip(starts(undo), starts(undo)[1:])]
    # Each wait is at least half its step of 0.3 s doubling (full jitter), capped at 1.2 s: it grows, then stays.
    for number, gap in enumerate(gaps, start=1):
        assert gap >= min(1.2, 0.3 * 2 ** (number - 1)) / 2 - 0.02, gaps
    # The lower bounds above say it grows; no upper bound is asserted: on a loaded machine the sweep that sends a
    # due retry comes late (a first gap of 0.68 s was seen in CI), which says nothing about the backoff.
    assert max(gaps[2:]) >= 0.6, gaps
    patient.undo.up()  # the tool is back
    assert sweeping(10.0, lambda: Run.objects.get(pk=run_id).status == "compensated"), Run.objects.get(pk=run_id).status
    assert patient.undo.bodies == [b'{"ref":"r-1"}']  # undone once, with the args its plan recorded
    assert not RecoveryItem.objects.filter(run_id=run_id).exists()


def test_an_undo_whose_tool_stays_down_goes_to_a_person_once_the_patience_is_spent(patient, settings):
    settings.UNWIND_RETRY_PATIENCE = 3
    run_id = open_run(patient)
    propose(patient, run_id, {"ref": "r-2"})
    cancel(patient, run_id)
    undo = Action.objects.get(run_id=run_id, kind=ActionKind.COMPENSATION)
    due = {}  # attempt number → when the attempt after it was scheduled, as the ledger said between two sweeps

    def settled_watching_due() -> bool:
        row = Action.objects.values("status", "attempts", "next_attempt_at").get(pk=undo.pk)
        if row["status"] == "retry_scheduled":
            due[row["attempts"]] = row["next_attempt_at"].timestamp()
        return Run.objects.get(pk=run_id).status == "needs_attention"

    assert sweeping(10.0, settled_watching_due)
    undo.refresh_from_db()
    times = starts(undo)
    assert undo.status == "failed" and undo.attempts > 2, (undo.status, undo.attempts)
    # The last attempt was due within the 3 s, and no later one would have been. It begins when a sweep picks it up,
    # after its due time (on a loaded CI machine a second or more later), so the bound is on when it was due.
    last_due = due.get(undo.attempts - 1)
    assert last_due is not None, (due, undo.attempts)
    assert last_due - times[0] <= 3.0 + 0.05 and times[-1] - times[0] >= 3.0 - 1.2 - 0.3, (times, due)
    item = RecoveryItem.objects.get(run_id=run_id, status="open")
    assert item.reason == "compensation_failed"
    # Not put before a person early: at least 1.5 s after the first attempt, read from the ledger's own times (a wall
    # clock polled by this test, which a loaded machine starts late, once saw it "within 1.5 s" of its sweeping).
    assert item.created_at.timestamp() - times[0] >= 1.5, (item.created_at, times)
    assert patient.undo.bodies == []


def test_a_step_whose_call_never_left_is_sent_once_its_tool_is_back(patient):
    """A forward step's connection refused: nothing happened, so it is tried again past its 2 attempts, and the agent
    is answered 202 (it waits) instead of its run being unwound in a second."""
    patient.send.down()
    run_id = open_run(patient)
    first = propose(patient, run_id, {"ref": "r-3"})
    assert first["status"] == "retry_scheduled" and first["error"]["error_class"] == "not_sent", first
    assert sweeping(4.0, lambda: Action.objects.get(pk=first["id"]).attempts >= 4)
    assert Action.objects.get(pk=first["id"]).status in ("retry_scheduled", "running")
    assert Run.objects.get(pk=run_id).status == "running"
    patient.send.up()
    assert sweeping(10.0, lambda: Action.objects.get(pk=first["id"]).status == "succeeded")
    assert patient.send.bodies == [b'{"ref":"r-3"}'] and Run.objects.get(pk=run_id).status == "running"


def test_only_undos_and_calls_that_never_left_are_waited_for(tools, settings):
    """The schedule itself: a 503 to a forward step keeps its tool's own backoff and attempts; an undo's or a refused
    connection's grows from UNWIND_PATIENT_BACKOFF, doubling, jittered, never past UNWIND_MAX_BACKOFF."""
    settings.UNWIND_PATIENT_BACKOFF, settings.UNWIND_MAX_BACKOFF, settings.UNWIND_RETRY_PATIENCE = 5.0, 60.0, 900
    step = Action(kind=ActionKind.FORWARD, tool=tools.acme.tools.get(name="hr.create_user", is_current=True))
    undo = Action(kind=ActionKind.COMPENSATION, tool=step.tool)
    busy = ToolError("answered 503", transient=True, status=503)
    refused = ToolError("could not be reached", transient=True, not_sent=True)
    wrong = ToolError("answered 400", transient=False, status=400, refused=True)
    assert not attempts.patient(step, busy) and not attempts.patient(undo, wrong)
    assert attempts.patient(step, refused) and attempts.patient(undo, busy)
    settings.UNWIND_RETRY_PATIENCE = 0  # off: every failure counts against the tool's attempts alone
    assert not attempts.patient(step, refused) and not attempts.patient(undo, busy)
    settings.UNWIND_RETRY_PATIENCE = 900
    for number, (low, high) in enumerate([(2.5, 5), (5, 10), (10, 20), (20, 40), (30, 60), (30, 60)], start=1):
        step.attempts = undo.attempts = number
        delays = [attempts.retry_delay(undo, busy) for _ in range(200)] + [attempts.retry_delay(step, refused)
                                                                          for _ in range(200)]
        assert low <= min(delays) and max(delays) <= high and max(delays) - min(delays) > (high - low) / 3
        assert attempts.retry_delay(step, busy) <= 0.2 * 2 ** number  # the tool's own backoff (0.2 s, doubling)


# --- a worker's connection ended between two tasks ----------------------------------------------------------------

END_THE_WORKERS_CONNECTIONS = (
    # Every connection to the test database but this process's own and django-q2's broker and result keeping (their
    # pusher and monitor are not the engine's tasks): the worker's task process and its sweep clock.
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
    " AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND query NOT LIKE '%%django_q%%'"
)


@needs_postgres
@pytest.mark.slow
def test_a_task_after_the_workers_connection_was_ended_runs_at_once(http_tools, settings, monkeypatch):
    """Two approved charges, each run by a real worker (one task process, connections kept 60 s as in production);
    between the two, its connection is ended on the server's side. The second charge is sent at once, not a lease
    (here 60 s) later."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    settings.UNWIND_LEASE_SECONDS = 60
    monkeypatch.setattr(Conf, "SYNC", False)  # the live server queues the work for the worker
    agent = requests.Session()
    agent.headers["Authorization"] = f"Bearer {http_tools.key}"
    base = http_tools.live_server.url
    charges = []
    for amount in (4100, 4200):
        run = agent.post(f"{base}/api/v1/runs", json={"goal": "charge", "on_behalf_of": "carol@example.com"}, timeout=30)
        charge = agent.post(f"{base}/api/v1/runs/{run.json()['id']}/actions", timeout=30,
                            json={"tool": "payments.charge", "args": {"customer": "carol", "amount_cents": amount}})
        assert charge.json()["status"] == "awaiting_approval", charge.text
        charges.append(charge.json()["id"])

    def approve(action_id: int) -> None:
        request = ApprovalRequest.objects.get(action_id=action_id)
        decided = requests.post(f"{base}/api/v1/approvals/{request.pk}/approve", json={}, auth=("alice", "pw-alice"),
                                timeout=30)
        assert decided.status_code == 200, decided.text

    def succeeded(action_id: int) -> bool:
        return Action.objects.get(pk=action_id).status == "succeeded"

    worker = subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE,
                              env=process_env(http_tools.live_server, UNWIND_WORKERS="1",
                                              DATABASE_URL=database_url() + "?conn_max_age=60"))
    try:
        approve(charges[0])
        assert wait_until(lambda: succeeded(charges[0]), 60)
        time.sleep(0.5)  # the task's process is idle again, its connection kept
        with connection.cursor() as cursor:
            cursor.execute(END_THE_WORKERS_CONNECTIONS)
            ended = cursor.fetchall()
        assert ended, "no connection of the worker was found to end"
        approve(charges[1])
        on_time = wait_until(lambda: succeeded(charges[1]), 15)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    action = Action.objects.get(pk=charges[1])
    assert on_time, (action.status, list(action.attempt_set.values_list("outcome", flat=True)), stderr.decode()[-3000:])
    assert list(action.attempt_set.values_list("outcome", flat=True)) == ["succeeded"]  # not taken over after a lease
    assert [c["effect_applied"] for c in call_list(tenant=acme(), tool="payments.charge")["results"]] == [True, True]
