"""Issue 39, findings 2 and 3, against the production command itself: the line in docs/production.md ("The web
server"), started as it is written (gunicorn, four ASGI workers) in the environment docs/production.env gives
(DEBUG off, HTTPS behind a proxy, a database pool), on PostgreSQL, on a free loopback port.

- One agent keeps 200 waits open (150 REST, 50 MCP) and a 201st is refused 429; each web process's threads stay
  bounded however many waits it holds (each wait held one under Django's own handling of a request); meanwhile
  /healthz and another agent's reads and proposals are answered, and timed (p50/p95 printed with `-s`, not
  asserted: the machine is shared; docs/production.md keeps the figures of runs of it); the issue's own attack (six
  waits of 30 s by a third agent) runs through the whole test, and no worker is killed. Under the former command
  (`gunicorn config.wsgi -w 4`) /healthz timed out and gunicorn killed its four workers at 30 s.
- Ten sockets send one header line a second: another client is served throughout, and the slow sockets are
  disconnected at the worker's read deadline (config/http_worker.py).
"""
from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import requests
from django.conf import settings
from django.db import close_old_connections, connection, connections
from django.utils import timezone
from mcp_types.version import LATEST_HANDSHAKE_VERSION

from config import request_threads
from config.http_worker import REQUEST_READ_TIMEOUT
from ledger.api import waits
from ledger.models import WaitSlot
from ledger.policy.versions import tools_load
from ledger.tenancy import agent_create
from tests.asgi_server import free_port
from tests.conftest import World, in_process_policy, needs_postgres, seed_sandboxes
from tests.test_readme_production import filled_in

pytestmark = [pytest.mark.slow, needs_postgres]

ROOT = Path(settings.BASE_DIR)
PROXY = {"Host": "unwind.example.com", "X-Forwarded-Proto": "https"}  # as the proxy in front of it sends them
POOL = 6  # connections per web process: the tests share this machine's PostgreSQL (production.env says 20)
MANY = 200


def the_command() -> list[str]:
    """The gunicorn line of docs/production.md's "The web server", with this virtualenv's gunicorn."""
    section = (ROOT / "docs" / "production.md").read_text().split("## The web server", 1)[1]
    block = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M).group(1)
    line = next(line for line in block.splitlines() if line.startswith(".venv/bin/gunicorn"))
    words = shlex.split(line.rstrip("& "))
    return [str(Path(sys.executable).parent / "gunicorn"), *words[1:]]


def production_env(tmp: Path, port: int) -> dict:
    database = settings.DATABASES["default"]
    url = f"postgres://{database['USER']}@{database['HOST'] or '127.0.0.1'}:{database['PORT'] or 5432}/{database['NAME']}"
    env = {}
    for line in filled_in(tmp, url).splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            env[name] = value
    env.update(
        UNWIND_AUDIT_SIGNING_KEY_FILE="", UNWIND_AUDIT_EXPORT_DIR="",  # no chain heads to sign here
        UNWIND_SANDBOX="1",  # the tests' tools are the sandbox's in-process ones
        UNWIND_MAX_WAITS_PER_AGENT=str(MANY), UNWIND_DB_POOL=str(POOL),
        PATH=os.environ["PATH"], HOME=os.environ.get("HOME", "/tmp"), LANG="C.UTF-8", PYTHONUNBUFFERED="1",
        GUNICORN_CMD_ARGS=f"--bind 127.0.0.1:{port}",  # gunicorn's own variable: the line stays as written
    )
    return env


def workers_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in found)


@pytest.fixture(scope="module")
def production_server(django_db_setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("production")
    port = free_port()
    log = tmp / "gunicorn.log"
    with open(log, "w") as out:
        server = subprocess.Popen(the_command(), cwd=ROOT, env=production_env(tmp, port), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/healthz", headers=PROXY, timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        yield SimpleNamespace(url=url, port=port, pid=server.pid, log=log)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


@pytest.fixture
def served_world(transactional_db, production_server):
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    return world


def in_own_connection(work, *args):
    close_old_connections()
    try:
        return work(*args)
    finally:
        connections.close_all()


def waits_of(agent_id: int) -> int:
    return WaitSlot.objects.filter(holder=f"agent:{agent_id}", until__gt=timezone.now()).count()


def server_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def p95(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def threads_of(pid: int) -> dict[int, int]:
    """Each web process's threads (/proc/<pid>/status)."""
    return {worker: int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{worker}/status").read_text(), re.M).group(1))
            for worker in workers_of(pid)}


def thread_and_memory(pid: int) -> str:
    lines = []
    for worker in workers_of(pid):
        status = Path(f"/proc/{worker}/status").read_text()
        threads = re.search(r"^Threads:\s+(\d+)", status, re.M).group(1)
        rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) // 1024
        lines.append(f"{threads} threads, {rss} MiB")
    return "; ".join(lines)


def test_one_agent_holding_200_waits_slows_no_one_else(production_server, served_world):
    server = production_server
    greedy, greedy_key = served_world.agent, served_world.key
    bystander_key = agent_create(tenant=served_world.acme, name="bystander")[1]
    patient, patient_key = agent_create(tenant=served_world.acme, name="patient")
    workers = workers_of(server.pid)
    assert len(workers) == 4
    threads_before = threads_of(server.pid)

    def auth(key: str) -> dict:
        return {**PROXY, "Authorization": f"Bearer {key}"}

    async def pending_charge(client, key: str, n: int) -> dict:
        run = await client.post("/api/v1/runs", headers=auth(key), json={"goal": "Buy", "on_behalf_of": "c@example.com"})
        assert run.status_code == 201, run.text
        action = await client.post(f"/api/v1/runs/{run.json()['id']}/actions", headers=auth(key), json={
            "tool": "payments.charge", "args": {"customer": f"cus_{n}", "amount_cents": 4900}})
        assert action.status_code == 202 and action.json()["status"] == "awaiting_approval", action.text
        return action.json()

    async def scenario() -> dict:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)  # no idle connection reused late
        async with httpx.AsyncClient(base_url=server.url, timeout=90, limits=limits) as client:
            # The attack, by a third agent: six waits of the longest time allowed, running all along.
            theirs = await pending_charge(client, patient_key, 99)
            started = time.monotonic()
            six = [asyncio.create_task(client.get(f"/api/v1/actions/{theirs['id']}/wait", params={"timeout": 30},
                                                  headers=auth(patient_key))) for _ in range(6)]
            charges = [await pending_charge(client, greedy_key, n) for n in range(10)]
            opened = await client.post("/mcp", headers={**auth(greedy_key), "Accept": "application/json, text/event-stream"},
                                       json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                                           "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
                                           "clientInfo": {"name": "greedy", "version": "1"}}})
            mcp = {**auth(greedy_key), "Accept": "application/json, text/event-stream",
                   "Mcp-Session-Id": opened.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": LATEST_HANDSHAKE_VERSION}
            rest_waits = [asyncio.create_task(client.get(f"/api/v1/actions/{charges[n % 10]['id']}/wait",
                                                         params={"timeout": 30}, headers=auth(greedy_key)))
                          for n in range(150)]
            mcp_waits = [asyncio.create_task(client.post("/mcp", headers=mcp, json={
                "jsonrpc": "2.0", "id": 100 + n, "method": "tools/call", "params": {
                    "name": "unwind_status", "arguments": {"action_id": charges[n % 10]["id"], "wait": 30}}}))
                for n in range(50)]
            while await asyncio.to_thread(in_own_connection, waits_of, greedy.pk) < MANY:
                assert time.monotonic() - started < 25, "the 200 waits did not all open"
                await asyncio.sleep(0.2)
            all_open = time.monotonic() - started
            threads_open = threads_of(server.pid)
            refused = await client.get(f"/api/v1/actions/{charges[0]['id']}/wait", params={"timeout": 30},
                                       headers=auth(greedy_key))
            # Everyone else, while the 200 waits stay open: /healthz, another agent's reads and proposals.
            run = (await client.post("/api/v1/runs", headers=auth(bystander_key),
                                     json={"goal": "Mail", "on_behalf_of": "d@example.com"})).json()
            timed = {"healthz": [], "read": [], "propose": []}
            for n in range(30):
                for kind, request in (
                        ("healthz", lambda: client.get("/healthz", headers=PROXY)),
                        ("read", lambda: client.get(f"/api/v1/runs/{run['id']}", headers=auth(bystander_key))),
                        ("propose", lambda: client.post(f"/api/v1/runs/{run['id']}/actions", headers=auth(bystander_key),
                                                        json={"tool": "email.send", "args": {
                                                            "to": f"d{n}@example.com", "subject": "Hi", "body": "."}}))):
                    began = time.monotonic()
                    answer = await request()
                    timed[kind].append(time.monotonic() - began)
                    assert answer.status_code in (200, 201), (kind, answer.status_code, answer.text[:300])
            still_open = await asyncio.to_thread(in_own_connection, waits_of, greedy.pk)
            connections_held = await asyncio.to_thread(in_own_connection, server_connections)
            memory = thread_and_memory(server.pid)
            # The waits end with their steps: the greedy agent cancels its runs.
            cancels_began = time.monotonic()
            for charge in charges:
                cancelled = await client.post(f"/api/v1/runs/{charge['run']}/cancel", headers=auth(greedy_key),
                                              json={"reason": "done"})
                assert cancelled.status_code == 200, cancelled.text
            rest_answers = await asyncio.gather(*rest_waits)
            mcp_answers = await asyncio.gather(*mcp_waits)
            answered_in = time.monotonic() - cancels_began
            six_answers = await asyncio.gather(*six)
            return dict(all_open=all_open, threads_open=threads_open, refused=refused, timed=timed,
                        still_open=still_open, memory=memory,
                        connections_held=connections_held, rest=rest_answers, mcp=mcp_answers,
                        answered_in=answered_in, six=six_answers, six_took=time.monotonic() - started)

    seen = asyncio.run(scenario())
    report = {kind: f"p50 {sorted(t)[len(t) // 2] * 1000:.0f} ms, p95 {p95(t) * 1000:.0f} ms"
              for kind, t in seen["timed"].items()}
    print(f"\n200 waits open in {seen['all_open']:.1f} s; while open: {report}; threads per worker before "
          f"{sorted(threads_before.values())}, with the 200 open {sorted(seen['threads_open'].values())}; "
          f"after the timed requests: {seen['memory']}; "
          f"database connections: {seen['connections_held']}; all answered {seen['answered_in']:.1f} s after "
          f"the cancels")
    refused = seen["refused"]
    assert refused.status_code == 429 and refused.json()["code"] == "too_many_waits", refused.text
    assert refused.headers["Content-Type"].startswith("application/problem+json") and int(refused.headers["Retry-After"]) >= 1
    assert seen["still_open"] == MANY  # nobody's wait was dropped to serve the others
    # An open wait holds no thread: with its ~50 waits open a web process has its main thread, the database pool's
    # (a scheduler and three workers, started by its first query), the LANES threads that answer waits and the one
    # that polls for them, the idle request threads it keeps for its next requests, and two for requests in flight;
    # under Django's own handling each wait held one more.
    most = 1 + 4 + waits.LANES + 1 + request_threads.IDLE_KEPT + 2
    assert all(threads <= most for threads in seen["threads_open"].values()), (threads_before, seen["threads_open"])
    assert seen["connections_held"] <= 4 * POOL + 2  # the pool bounds the web server's connections, waits or not
    assert [(a.status_code, a.json()["status"]) for a in seen["rest"]] == [(200, "skipped")] * 150
    assert [a.json()["result"]["structuredContent"]["status"] for a in seen["mcp"]] == ["skipped"] * 50
    assert seen["answered_in"] < 20
    # The six 30 s waits ran their course and were answered; no worker was killed or replaced.
    assert [a.status_code for a in seen["six"]] == [202] * 6 and seen["six_took"] >= 30
    assert workers_of(server.pid) == workers and "WORKER TIMEOUT" not in server.log.read_text()
    assert in_own_connection(waits_of, greedy.pk) == in_own_connection(waits_of, patient.pk) == 0


def test_slow_clients_do_not_stop_anyone_being_served(production_server):
    server = production_server
    outcomes: dict[int, tuple[float, bytes]] = {}

    def trickle(n: int) -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_READ_TIMEOUT + 10) as slow:
            connected = time.monotonic()
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: unwind.example.com\r\n")
            received = b""
            try:
                for line in range(int(REQUEST_READ_TIMEOUT) + 8):
                    time.sleep(1)
                    slow.sendall(f"X-Slow-{line}: {n}\r\n".encode())  # one header line a second, never the end
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                while chunk := slow.recv(65536):
                    received += chunk
            except (ConnectionResetError, TimeoutError):
                pass
            outcomes[n] = (time.monotonic() - connected, received)

    slow = [threading.Thread(target=trickle, args=(n,)) for n in range(10)]
    for thread in slow:
        thread.start()
    time.sleep(1)
    served = []
    until = time.monotonic() + 8
    while time.monotonic() < until:
        began = time.monotonic()
        answer = requests.get(f"{server.url}/healthz", headers=PROXY, timeout=5)
        served.append((answer.status_code, time.monotonic() - began))
        time.sleep(0.5)
    for thread in slow:
        thread.join(REQUEST_READ_TIMEOUT + 20)
    print(f"\nwhile 10 sockets trickled: {len(served)} answers, slowest {max(t for _, t in served) * 1000:.0f} ms; "
          f"the slow sockets were closed after {min(o[0] for o in outcomes.values()):.1f}-"
          f"{max(o[0] for o in outcomes.values()):.1f} s")
    # Served throughout: under the WSGI command these timed out at 5 s. The bound is wide and no median is asserted:
    # CI runs this beside three other suites on two cores, where a quiet server's /healthz itself can take 2 s.
    assert all(status == 200 and took < 3.0 for status, took in served), served
    assert len(outcomes) == 10
    for took, received in outcomes.values():
        assert received == b"" and REQUEST_READ_TIMEOUT - 0.5 <= took <= REQUEST_READ_TIMEOUT + 4, (took, received)


def test_a_burst_of_requests_waits_for_the_pool_instead_of_exhausting_postgresql(production_server, served_world):
    server = production_server
    action_id = served_world.acme.pk  # any id: each request reads the agent's action (404), one query or two
    peak, done = [0], threading.Event()

    def watch() -> None:
        close_old_connections()
        try:
            while not done.is_set():
                peak[0] = max(peak[0], server_connections())
                time.sleep(0.02)
        finally:
            connections.close_all()

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            answers = await asyncio.gather(*[client.get(f"/api/v1/actions/{action_id}", headers={
                **PROXY, "Authorization": f"Bearer {served_world.key}"}) for _ in range(60)])
        return [answer.status_code for answer in answers]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        statuses = asyncio.run(burst())
    finally:
        done.set()
        watcher.join(10)
    print(f"\n60 requests at once: {sorted(set(statuses))}; at most {peak[0]} database connections")
    assert statuses == [404] * 60  # each answered, none with 503
    assert peak[0] <= 4 * POOL + 2
