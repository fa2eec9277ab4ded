"""Issue 39, finding 8: one agent key cannot grow the MCP session table without end.

Each `initialize` writes a session row. An agent holds at most UNWIND_MCP_MAX_SESSIONS_PER_AGENT open sessions (one
more ends its least recently used one, which then answers 404 as the spec says for a session that is gone), and the
worker's sweep removes ended sessions and idle ones whose run is over (mcp_gateway/sessions.py). Over HTTP against a
live server; the sweep is the engine's own (`ledger.engine.sweep.sweep`, which calls the gateway's hook).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import requests
from django.utils import timezone

from ledger.engine.sweep import sweep
from ledger.models import Run
from mcp_gateway.models import McpSession
from tests.test_mcp_gateway import gateway  # noqa: F401 (the fixture: the api world served by the live server)

pytest_plugins = ["tests.api_fixtures"]

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "loop", "version": "1"}}}
USER = {"email": "ashu@example.com", "name": "Ashu Kumar"}


def headers_for(key: str, session_id: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream"}
    if session_id:
        headers.update({"Mcp-Session-Id": session_id, "Mcp-Protocol-Version": "2025-06-18"})
    return headers


def initialize(http: requests.Session, url: str, key: str) -> str:
    opened = http.post(url, json=INITIALIZE, headers=headers_for(key), timeout=30)
    assert opened.status_code == 200, opened.text
    return opened.headers["Mcp-Session-Id"]


def rpc(url: str, key: str, session_id: str, method: str, params: dict | None = None) -> requests.Response:
    return requests.post(url, headers=headers_for(key, session_id), timeout=30, json={
        "jsonrpc": "2.0", "id": 2, "method": method, "params": params or {}})


def test_300_initializes_from_one_key_leave_at_most_the_cap_open(gateway, settings):  # noqa: F811
    # The finding was 1,500 in 14.5 s from one key with no cap; 300 against a cap of 10 is the same attack, 30 caps
    # over, in a fifth of the time.
    settings.UNWIND_MCP_MAX_SESSIONS_PER_AGENT = 10
    url, key = gateway.url, gateway.world.key
    bystander = initialize(requests.Session(), url, gateway.world.other_key)  # another tenant's agent
    first = initialize(requests.Session(), url, key)
    clients = [requests.Session() for _ in range(4)]

    def loop(n):
        return [initialize(clients[n], url, key) for _ in range(75)]

    with ThreadPoolExecutor(max_workers=4) as pool:  # four at once: the cap holds between concurrent opens too
        opened = [session_id for batch in pool.map(loop, range(4)) for session_id in batch]
    assert len(set(opened)) == 300
    # The newest session answers. Opened after the flood: which of the four threads' sessions came last in time is
    # the scheduler's choice, and the cap may already have ended the last of any one thread's list.
    newest = initialize(requests.Session(), url, key)
    mine = McpSession.objects.filter(agent=gateway.world.agent)
    assert mine.count() <= 10 and mine.filter(ended_at__isnull=True).count() <= 10
    # The first one was ended (the spec's answer for a session that is gone: 404, after which a client initializes
    # again); the other agent's session was not touched.
    assert rpc(url, key, newest, "ping").json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    gone = rpc(url, key, first, "ping")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "Session not found"
    assert rpc(url, gateway.world.other_key, bystander, "ping").status_code == 200


def test_a_loop_of_initialize_and_delete_leaves_no_pile_of_ended_sessions(gateway, settings):  # noqa: F811
    settings.UNWIND_MCP_MAX_SESSIONS_PER_AGENT = 5
    url, key = gateway.url, gateway.world.key
    http = requests.Session()
    for _ in range(40):
        session_id = initialize(http, url, key)
        assert http.delete(url, headers=headers_for(key, session_id), timeout=30).status_code == 204
    # No sweep ran: the last one ended is the only row left.
    assert McpSession.objects.filter(agent=gateway.world.agent).count() == 1
    assert McpSession.objects.get().ended_at is not None


def test_initializes_sent_at_once_never_leave_more_than_the_cap(gateway, settings):  # noqa: F811
    """Each open is counted under a lock on the agent's row: two opens at once cannot each see only the other's
    predecessor and both stay (without the lock, PostgreSQL kept all six of a round)."""
    settings.UNWIND_MCP_MAX_SESSIONS_PER_AGENT = 1
    url, key = gateway.url, gateway.world.key
    clients = [requests.Session() for _ in range(6)]
    for _ in range(10):
        gate = threading.Barrier(len(clients))

        def opened(http):
            gate.wait()
            return initialize(http, url, key)

        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            assert len(set(pool.map(opened, clients))) == len(clients)
        assert McpSession.objects.filter(agent=gateway.world.agent).count() == 1


def test_the_least_recently_used_session_is_the_one_ended(gateway, settings):  # noqa: F811
    settings.UNWIND_MCP_MAX_SESSIONS_PER_AGENT = 3
    url, key = gateway.url, gateway.world.key
    http = requests.Session()
    busy, idle, other = (initialize(http, url, key) for _ in range(3))
    # `idle` was used longest ago, `busy` just now (last_activity_at is kept to the minute: step back in time).
    McpSession.objects.filter(session_id=idle).update(last_activity_at=timezone.now() - timedelta(minutes=10))
    McpSession.objects.filter(session_id=other).update(last_activity_at=timezone.now() - timedelta(minutes=5))
    McpSession.objects.filter(session_id=busy).update(last_activity_at=timezone.now() - timedelta(minutes=20))
    called = rpc(url, key, busy, "tools/call", {"name": "hr.create_user", "arguments": USER})
    assert called.status_code == 200 and not called.json()["result"]["isError"]
    newest = initialize(http, url, key)
    assert rpc(url, key, idle, "ping").status_code == 404
    assert all(rpc(url, key, s, "ping").status_code == 200 for s in (busy, other, newest))
    # The ended session's run is untouched: the agent can take it up again in the new session.
    run = Run.objects.get()
    assert run.status == "running"
    taken = rpc(url, key, newest, "tools/call", {"name": "unwind_begin", "arguments": {"run_id": run.pk}})
    assert taken.json()["result"]["structuredContent"]["run_id"] == run.pk


def test_the_sweep_removes_ended_and_idle_sessions_and_keeps_one_whose_run_is_open(gateway, settings):  # noqa: F811
    settings.UNWIND_MCP_SESSION_IDLE = 120
    url, key = gateway.url, gateway.world.key
    http = requests.Session()
    ended, idle, fresh, working = (initialize(http, url, key) for _ in range(4))
    assert requests.delete(url, headers=headers_for(key, ended), timeout=30).status_code == 204
    called = rpc(url, key, working, "tools/call", {"name": "hr.create_user", "arguments": USER})
    assert not called.json()["result"]["isError"]  # its run is open (running)
    long_ago = timezone.now() - timedelta(seconds=600)
    McpSession.objects.filter(session_id__in=[idle, working]).update(last_activity_at=long_ago)

    sweep()
    assert set(McpSession.objects.values_list("session_id", flat=True)) == {fresh, working}
    assert rpc(url, key, idle, "ping").status_code == 404 and rpc(url, key, ended, "ping").status_code == 404
    assert rpc(url, key, fresh, "ping").status_code == 200

    # Once its run is over, the idle session goes too.
    committed = rpc(url, key, working, "tools/call", {"name": "unwind_commit", "arguments": {}})
    assert committed.json()["result"]["structuredContent"]["run_status"] == "completed"
    McpSession.objects.filter(session_id=working).update(last_activity_at=long_ago)
    sweep()
    assert list(McpSession.objects.values_list("session_id", flat=True)) == [fresh]
    assert Run.objects.get().status == "completed"
