"""Issue 39, finding 4: Redis stopping is no 500 for anyone, and an agent's run goes on across the outage.

With `UNWIND_REDIS_URL` set, Redis is the task broker, and nothing else. It used to hold the agent-key throttle's
counters too, read on every API request: a stopped Redis answered every request with a 500 page (the client, which
does not resend a 500, abandoned its runs with their steps done), and later let every key through unthrottled. The
throttle now counts in the database (ledger/api/throttle.py), so an outage of Redis does not touch agents' requests:
a key over its rate stays refused and another key is served, on the API and on MCP. Work the broker cannot take is
left to the sweep (ledger/engine/dispatch.py), and /healthz says degraded.

Real parts: a Redis of the test's own on a free loopback port, the README's production command
(`gunicorn config.wsgi -w 4`) pointed at it and at the test database, an agent using the Python client. Redis is
killed (SIGKILL) mid-run and started again on the same port.
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
import requests

from ledger.models import Action, Run
from ledger.tenancy import agent_create
from sandbox.selectors import world_state
from tests.live_processes import Served
from tests.quick_server import QUICK_SHUTDOWN
from tests.test_serving import free_port
from unwind_client import Unwind

pytest_plugins = ["tests.api_fixtures"]
live = [pytest.mark.slow,
        pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

RATE = 20  # requests an hour per agent key: a burst of 20 (enough for the run's own requests), then one each 3 min,
# so a key that made its burst stays refused for the whole test


class RedisServer:
    """`redis-server --port N --save '' --appendonly no` on loopback; `kill` is SIGKILL, as a crash would be."""

    def __init__(self, directory: Path):
        self.port, self.directory, self.process = free_port(), directory, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    return self
            time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture
def outage(api, tmp_path):
    cache = RedisServer(tmp_path).start()
    server = Served("gunicorn", tmp_path / "gunicorn.log", UNWIND_REDIS_URL=cache.url, UNWIND_TASKS_SYNC="0",
                    UNWIND_THROTTLE_RATE=f"{RATE}/hour")
    try:
        yield api.world, cache, server.start()
    finally:
        server.stop()
        cache.kill()


def flood(url: str, key: str, *, until_refused: bool, limit: int = 200) -> list[int]:
    """GET /api/v1/tools with `key` until a 429 (or `limit` requests): every status answered, in order."""
    statuses = []
    for _ in range(limit):
        status = requests.get(f"{url}/api/v1/tools", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code
        statuses.append(status)
        if until_refused and status == 429:
            break
    return statuses


@live[0]
@live[1]
def test_a_run_completes_across_a_redis_outage_and_nothing_answers_500(outage):
    world, cache, server = outage
    _, flooder = agent_create(tenant=world.acme, name="flooder")
    _, newcomer = agent_create(tenant=world.acme, name="newcomer")
    agent = Unwind(server.url, world.key)
    run = agent.run(goal="Onboard Ashu", on_behalf_of="carol@example.com")
    user = run.act("hr.create_user", {"email": "ashu@example.com", "name": "Ashu Kumar"})

    # Redis up: the four worker processes share one count per key, so the flooder gets exactly RATE answers.
    statuses = flood(server.url, flooder, until_refused=True)
    assert statuses == [200] * RATE + [429], statuses

    cache.kill()
    # The throttle neither opens nor closes with Redis: the flooder stays refused, on the API and on MCP, and a key
    # that has made no request is served.
    assert flood(server.url, flooder, until_refused=False, limit=3) == [429] * 3
    mcp = requests.get(f"{server.url}/mcp", headers={"Authorization": f"Bearer {flooder}"}, timeout=10)
    assert mcp.status_code == 429, mcp.text
    assert flood(server.url, newcomer, until_refused=False, limit=3) == [200] * 3
    # The agent's run goes on: its next step, reading it, completing it.
    license_ = run.act("licenses.provision", {"user_id": user["id"]})
    assert run.refresh().status == "running"
    run.complete()
    assert run.status == "completed"
    # A cancel queues an unwind for the worker, which the broker cannot take: answered, and unwound inline.
    other = agent.run(goal="Cancelled during the outage", on_behalf_of="carol@example.com")
    other.act("hr.create_user", {"email": "dora@example.com", "name": "Dora"})
    other.cancel("the agent changed its mind")
    health = requests.get(f"{server.url}/healthz", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["broker"] == "unreachable", health.text

    state = world_state(tenant=world.acme)
    assert [u["email"] for u in state["users"]] == ["ashu@example.com"]  # dora's was undone
    assert [lic["id"] for lic in state["licenses"]] == [license_["id"]]
    assert state["call_counts"]["hr.create_user"]["effects"] == 2
    assert state["call_counts"]["licenses.provision"]["effects"] == 1
    assert Run.objects.get(pk=run.id).status == "completed"
    assert Run.objects.get(pk=other.id).status == "compensated"
    assert set(Action.objects.filter(run_id=run.id).values_list("status", flat=True)) == {"succeeded"}

    # Redis back on the same port: nothing of the throttle was lost or reset.
    cache.start()
    assert flood(server.url, flooder, until_refused=False, limit=1) == [429]

    log = server.log.read_text()
    assert "the broker did not take ledger.tasks.unwind_run" in log
    assert "Internal Server Error" not in log and "Traceback" not in log, log[-3000:]


class BusyThenServing:
    """A loopback server in front of nothing: the first `busy` requests get 503 with `Retry-After` as an HTTP-date
    `ahead` seconds on (as a proxy or load balancer sends), the next a run's JSON."""

    def __init__(self, busy: int, ahead: float):
        self.times: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.times.append(time.monotonic())
                if len(outer.times) <= busy:
                    when = datetime.now(timezone.utc) + timedelta(seconds=ahead)
                    self.send_response(503)
                    self.send_header("Retry-After", format_datetime(when, usegmt=True))
                    body = b"upstream restarting"
                else:
                    self.send_response(201)
                    body = b'{"id": 7, "status": "running"}'
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_client_waits_out_a_503_whose_retry_after_is_a_date():
    server = BusyThenServing(busy=1, ahead=3)
    try:
        run = Unwind(server.url, "uw_x_y", backoff=0.01).run(goal="after the restart")
    finally:
        server.close()
    assert run.id == 7 and len(server.times) == 2
    # The header's date is whole seconds: 2 to 3 s after the first answer, never the 10 ms backoff.
    assert server.times[1] - server.times[0] >= 1.9
