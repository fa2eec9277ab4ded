"""Issue 39, finding 2: waiting for a step holds no worker, and each agent has a bound on its waits.

`GET /api/v1/actions/{id}/wait` and MCP's `unwind_status {wait}` are served by an ASGI server on its event loop (the
production command; here `tests.asgi_server`, uvicorn in a thread with the production worker's protocol) and by a
WSGI server in the request's thread (`manage.py runserver` and `make demo`; here pytest-django's `live_server`).
Both are attacked over HTTP: an agent past UNWIND_MAX_WAITS_PER_AGENT waits is answered 429 and nothing happens,
waits end when their step does, a client that hangs up gives its wait back, and a request trickled in slower than
the worker's deadline is cut off. tests/test_production_server.py does the same to the production command itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx2
import pytest
import requests
from django.db import close_old_connections, connections
from django.db.backends.signals import connection_created
from django.utils import timezone
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import LATEST_HANDSHAKE_VERSION

from approvals.models import ApprovalRequest
from config import http_worker, request_threads
from ledger.api import waits
from ledger.models import Action, AuditEvent, WaitSlot
from ledger.tenancy import agent_create
from tests.api_support import effects
from tests.asgi_server import asgi_server
from tests.conftest import needs_postgres
from tests.live_processes import read_until_closed
from tests.test_database_unavailable import Cut, assert_unavailable

pytest_plugins = ["tests.api_fixtures"]  # the api fixture: acme and globex with the sandbox tools, transactional

CHARGE = {"customer": "cus_1", "amount_cents": 4900}  # payments.charge: high risk, so a person must approve it


@pytest.fixture(params=["asgi", "wsgi"])
def served(request, api, live_server, settings):
    """The api world served over HTTP by the ASGI server (waits on its event loop) or by the WSGI live server."""
    if request.param == "wsgi":
        api.url = live_server.url
        settings.UNWIND_BASE_URL = api.url
        yield api
        return
    with asgi_server() as url:
        api.url = url
        settings.UNWIND_BASE_URL = url
        yield api


@pytest.fixture
def asgi_served(api, settings):
    with asgi_server() as url:
        api.url = url
        settings.UNWIND_BASE_URL = url
        yield api


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def pending_charge(base: str, key: str, customer: str = "cus_1") -> dict:
    """A run with a charge waiting for a person's approval (made over HTTP, as the agent does)."""
    run = requests.post(f"{base}/api/v1/runs", json={"goal": "Buy", "on_behalf_of": "carol@example.com"},
                        headers=bearer(key), timeout=10)
    assert run.status_code == 201, run.text
    action = requests.post(f"{base}/api/v1/runs/{run.json()['id']}/actions", headers=bearer(key), timeout=10,
                           json={"tool": "payments.charge", "args": {**CHARGE, "customer": customer}})
    assert action.status_code == 202 and action.json()["status"] == "awaiting_approval", action.text
    return action.json()


def wait(base: str, key: str, action_id: int, timeout: float) -> requests.Response:
    return requests.get(f"{base}/api/v1/actions/{action_id}/wait", params={"timeout": timeout},
                        headers=bearer(key), timeout=timeout + 30)


def open_waits() -> int:
    return WaitSlot.objects.filter(until__gt=timezone.now()).count()


def until(check, seconds: float = 20.0) -> float:
    """Poll `check` until it holds; how long that took (the test fails if it never does)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def approve(base: str, action_id: int) -> None:
    approval = ApprovalRequest.objects.get(action_id=action_id)
    approved = requests.post(f"{base}/api/v1/approvals/{approval.pk}/approve", json={}, auth=("alice", "pw-alice"),
                             timeout=10)
    assert approved.status_code == 200, approved.text


def mcp_session(base: str, key: str) -> dict:
    """An MCP session over plain HTTP (initialize), as any client opens one: the headers for its later requests."""
    opened = requests.post(f"{base}/mcp", headers={**bearer(key), "Accept": "application/json, text/event-stream"},
                           json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                               "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
                               "clientInfo": {"name": "test", "version": "1"}}}, timeout=10)
    assert opened.status_code == 200, opened.text
    return {**bearer(key), "Accept": "application/json, text/event-stream",
            "Mcp-Session-Id": opened.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": LATEST_HANDSHAKE_VERSION}


def mcp_status_wait(base: str, headers: dict, action_id: int, seconds: float) -> requests.Response:
    return requests.post(f"{base}/mcp", headers=headers, timeout=seconds + 30, json={
        "jsonrpc": "2.0", "id": 7, "method": "tools/call",
        "params": {"name": "unwind_status", "arguments": {"action_id": action_id, "wait": seconds}}})


def assert_too_many_waits(response, limit: int) -> dict:
    assert response.status_code == 429, (response.status_code, response.text[:300])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == "too_many_waits" and body["limit"] == limit and "UNWIND_MAX_WAITS_PER_AGENT" in body["detail"]
    assert 1 <= int(response.headers["Retry-After"]) == body["retry_after"] <= 40
    return body


def ledger_state(action_id: int) -> tuple:
    """What a refused wait must leave as it was: the step, its approval, the audit chain, the tool's calls."""
    action = Action.objects.get(pk=action_id)
    approval = ApprovalRequest.objects.get(action_id=action_id)
    return (action.status, action.updated_at, approval.status, approval.decisions.count(), AuditEvent.objects.count(),
            len(effects("payments.charge")))


def test_a_wait_past_the_agents_bound_is_refused_and_nothing_happens(served, settings):
    settings.UNWIND_MAX_WAITS_PER_AGENT = 3
    base, key = served.url, served.world.key
    charge = pending_charge(base, key)
    session = mcp_session(base, key)
    with ThreadPoolExecutor(max_workers=3) as pool:
        held = [pool.submit(wait, base, key, charge["id"], 20) for _ in range(3)]
        until(lambda: open_waits() == 3)
        before = ledger_state(charge["id"])
        refused = wait(base, key, charge["id"], 20)
        assert_too_many_waits(refused, 3)
        # The bound is the agent's, over REST and MCP alike.
        assert_too_many_waits(mcp_status_wait(base, session, charge["id"], 20), 3)
        assert ledger_state(charge["id"]) == before and open_waits() == 3
        assert not any(future.done() for future in held)
        # Another agent of the tenant waits as usual, and so does the agent itself without waiting (timeout 0).
        other_key = agent_create(tenant=served.world.acme, name="second")[1]
        other = pending_charge(base, other_key, customer="cus_2")
        assert wait(base, other_key, other["id"], 0.3).status_code == 202
        assert wait(base, key, charge["id"], 0).status_code == 202
        # The waits end when the step does: the agent cancels its run.
        cancelled = requests.post(f"{base}/api/v1/runs/{charge['run']}/cancel", json={"reason": "done"},
                                  headers=bearer(key), timeout=10)
        assert cancelled.status_code == 200, cancelled.text
        answers = [future.result(timeout=15) for future in held]
    assert [(a.status_code, a.json()["status"]) for a in answers] == [(200, "skipped")] * 3
    assert open_waits() == 0 and effects("payments.charge") == []


def test_waits_answer_as_soon_as_their_step_settles(served, settings):
    settings.UNWIND_MAX_WAITS_PER_AGENT = 30
    base, key = served.url, served.world.key
    charge = pending_charge(base, key)
    with ThreadPoolExecutor(max_workers=20) as pool:
        held = [pool.submit(wait, base, key, charge["id"], 25) for _ in range(20)]
        until(lambda: open_waits() == 20)
        assert wait(base, key, charge["id"], 0.3).status_code == 202  # still pending: answered after its timeout
        started = time.monotonic()
        approve(base, charge["id"])
        answers = [future.result(timeout=20) for future in held]
        took = time.monotonic() - started
    assert [(a.status_code, a.json()["status"]) for a in answers] == [(200, "succeeded")] * 20
    assert took < 10, took  # woken by the outcome, not by their 25 s timeout
    assert len(effects("payments.charge")) == 1 and open_waits() == 0


def server_threads() -> int:
    """This process's threads but the test's own clients' (the ASGI server runs in it) and the idle request threads
    the server keeps for its next requests (config/request_threads.py), which no request holds."""
    return sum(1 for thread in threading.enumerate() if not thread.name.startswith("client")) \
        - asgi_application().threads.idle()


def asgi_application():
    from config.asgi import application  # what tests/asgi_server.py serves, imported once the test database is set

    return application


def mcp_status_stream(base: str, headers: dict, action_id: int, seconds: float) -> dict:
    """`unwind_status {wait}` with a progress token: answered as an event stream; its last event, the result."""
    answer = requests.post(f"{base}/mcp", headers=headers, timeout=seconds + 30, json={
        "jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {
            "name": "unwind_status", "arguments": {"action_id": action_id, "wait": seconds},
            "_meta": {"progressToken": "p"}}})
    assert answer.headers["Content-Type"].startswith("text/event-stream"), answer.text[:300]
    return json.loads([line for line in answer.text.splitlines() if line.startswith("data: ")][-1][6:])


def test_an_open_wait_holds_no_thread(asgi_served, settings):
    """Twenty-five waits over REST and MCP (answered at once, or as a stream of progress), open at once: the server
    has as many threads as with none (under Django's own handling each held the thread it made for the request's
    synchronous code until the wait ended)."""
    settings.UNWIND_MAX_WAITS_PER_AGENT = 30
    base, key = asgi_served.url, asgi_served.world.key
    charge = pending_charge(base, key)
    session = mcp_session(base, key)
    assert wait(base, key, charge["id"], 0.3).status_code == 202  # the lanes and the poller exist from here on
    time.sleep(0.5)
    before = server_threads()
    with ThreadPoolExecutor(max_workers=25, thread_name_prefix="client") as pool:
        held = [pool.submit(wait, base, key, charge["id"], 25) for _ in range(15)]
        held += [pool.submit(mcp_status_wait, base, session, charge["id"], 25) for _ in range(5)]
        streamed = [pool.submit(mcp_status_stream, base, session, charge["id"], 25) for _ in range(5)]
        until(lambda: open_waits() == 25)
        time.sleep(0.5)
        during = server_threads()
        cancelled = requests.post(f"{base}/api/v1/runs/{charge['run']}/cancel", json={"reason": "done"},
                                  headers=bearer(key), timeout=10)
        assert cancelled.status_code == 200, cancelled.text
        answers = [future.result(timeout=15) for future in held]
        finals = [future.result(timeout=15) for future in streamed]
    assert during <= before + 1, (before, during)  # one: a request being answered as it is counted
    assert asgi_application().threads.idle() <= request_threads.IDLE_KEPT
    assert [final["result"]["structuredContent"]["status"] for final in finals] == ["skipped"] * 5
    assert [(a.status_code, a.json()["status"]) for a in answers[:15]] == [(200, "skipped")] * 15
    assert [a.json()["result"]["structuredContent"]["status"] for a in answers[15:]] == ["skipped"] * 5
    assert open_waits() == 0


@needs_postgres
def test_a_database_lost_as_a_wait_is_answered_answers_503(asgi_served):
    """The wait is answered after the middleware ran (config/asgi.py): a database that stops answering then is still
    503 problem+json with Retry-After, as for any request, and the next wait is served."""
    base, key = asgi_served.url, asgi_served.world.key
    charge = pending_charge(base, key)
    cutter = Cut()
    connection_created.connect(cutter.install)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="client") as pool:
            held = pool.submit(wait, base, key, charge["id"], 1.5)
            until(lambda: open_waits() == 1)
            cutter.arm('UPDATE "ledger_waitslot"')  # the wait's slot given back, as its answer is made
            answer = held.result(timeout=20)
    finally:
        connection_created.disconnect(cutter.install)
    assert cutter.cut == 1
    assert_unavailable(answer)
    assert wait(base, key, charge["id"], 0.2).status_code == 202


def test_a_client_that_hangs_up_gives_its_wait_back(asgi_served, settings):
    base, key = asgi_served.url, asgi_served.world.key
    charge = pending_charge(base, key)
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(f"GET /api/v1/actions/{charge['id']}/wait?timeout=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Authorization: Bearer {key}\r\n\r\n".encode())
        until(lambda: open_waits() == 1)
    # Django cancels the view when the client is gone; the wait gives its slot back then, not at its end (30 s, the
    # most a wait may be, and the slot 5 s after). 20 s leaves a loaded CI machine room: 5 s once ran out there.
    assert until(lambda: open_waits() == 0, seconds=20) < 20


def test_mcp_status_waits_on_the_event_loop_with_progress(asgi_served, settings):
    base, key = asgi_served.url, asgi_served.world.key
    progress, pending = [], {}

    async def on_progress(done, total, message):
        progress.append((done, total, message))
        if len(progress) == 1:  # a person decides while the agent waits
            await asyncio.to_thread(decide)

    def decide():
        close_old_connections()
        try:
            approve(base, pending["action_id"])
        finally:
            connections.close_all()

    async def script():
        async with httpx2.AsyncClient(headers=bearer(key), timeout=httpx2.Timeout(30, read=60)) as http:
            async with streamable_http_client(f"{base}/mcp", http_client=http) as (read, write):
                async with ClientSession(read, write) as mcp:
                    await mcp.initialize()
                    charged = await mcp.call_tool("payments.charge", CHARGE)
                    pending.update(charged.structured_content)
                    return await mcp.call_tool("unwind_status", {"action_id": pending["action_id"], "wait": 20},
                                               progress_callback=on_progress)

    done = asyncio.run(script())
    assert pending["status"] == "awaiting_approval" and progress and progress[0][1] == 20
    assert not done.is_error and done.structured_content["status"] == "succeeded"
    assert len(effects("payments.charge")) == 1 and open_waits() == 0


@pytest.mark.django_db(transaction=True)
def test_concurrent_takers_never_hold_more_than_the_bound(settings):
    settings.UNWIND_MAX_WAITS_PER_AGENT = 5
    start, taken, refused = threading.Barrier(12), [], []

    def take():
        close_old_connections()
        try:
            start.wait(10)
            taken.append(waits.wait_slot_take(holder="agent:1", seconds=10))
        except waits.TooManyWaits as too_many:
            refused.append(too_many)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=take) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(taken) == 5 and sorted(slot.number for slot in taken) == [0, 1, 2, 3, 4]
    assert len(refused) == 7 and all(1 <= r.extra["retry_after"] <= 16 for r in refused)
    with pytest.raises(waits.TooManyWaits):
        waits.wait_slot_take(holder="agent:1", seconds=10)
    assert waits.wait_slot_take(holder="agent:2", seconds=10).number in range(5)  # another holder has its own
    waits.wait_slot_release(taken[0])
    assert waits.wait_slot_take(holder="agent:1", seconds=10).number == taken[0].number
    # A slot whose wait died with its process frees itself at its `until`; the late release of it does nothing.
    WaitSlot.objects.filter(holder="agent:1", number=taken[1].number).update(until=timezone.now() - timedelta(seconds=1))
    again = waits.wait_slot_take(holder="agent:1", seconds=10)
    assert again.number == taken[1].number
    waits.wait_slot_release(taken[1])
    assert WaitSlot.objects.get(holder="agent:1", number=again.number).token == again.token


@contextlib.contextmanager
def slow_socket(port: int):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        yield client


@pytest.mark.django_db(transaction=True)
def test_a_request_trickled_in_slower_than_the_deadline_is_cut_off(monkeypatch):
    monkeypatch.setattr(http_worker, "REQUEST_READ_TIMEOUT", 1.0)
    with asgi_server() as base:
        port = int(base.rsplit(":", 1)[1])
        with slow_socket(port) as silent, slow_socket(port) as trickling, slow_socket(port) as kept_alive:
            started = time.monotonic()
            trickling.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
            kept_alive.sendall(b"GET /healthz HTTP/1.1\r\n")  # its next request, never finished
            while time.monotonic() - started < 0.8:
                trickling.sendall(b"X-Slow: 1\r\n")  # a header line every 0.2 s: never a whole request
                assert requests.get(f"{base}/healthz", timeout=5).status_code == 200  # others are served meanwhile
                time.sleep(0.2)
            for client in (silent, trickling, kept_alive):
                client.settimeout(5)
            assert read_until_closed(silent) == read_until_closed(trickling) == b""  # no answer, just closed
            assert b"HTTP/1.1" not in read_until_closed(kept_alive).partition(b"\r\n\r\n")[2]  # only the first one's
            assert time.monotonic() - started < 4
