"""MCP on any number of web processes (issue 26): two gunicorn servers, 4 workers each, one PostgreSQL database.

One official-SDK client session whose requests alternate between the two servers (an httpx2 transport that sends
each request to the other port) lists tools, makes ten calls, waits for a person's approval given in between and
rolls back: every call answers, the run holds exactly those steps, nothing ran twice. A server restarted in the
middle of a session: the next request on the same Mcp-Session-Id continues the same run. Another agent's key with a
known session id is refused on every server, and a session ended by DELETE is gone on every server.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
import requests
from django.db import connection
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import LATEST_HANDSHAKE_VERSION

from approvals.models import ApprovalRequest
from ledger.models import Action, Run
from ledger.tenancy import agent_create
from ledger.policy.versions import tool_upsert
from mcp_gateway.gateway import in_thread
from mcp_gateway.models import McpSession
from sandbox.selectors import world_state
from tests.api_support import effects
from tests.conftest import in_process_policy, is_postgres
from tests.helpers import acme
from tests.test_g05_crash_safety import database_url

pytest_plugins = ["tests.api_fixtures"]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("postgres" not in database_url(), reason="several servers share one PostgreSQL")]

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gunicorn:
    """`gunicorn config.wsgi -w 4`, the README's production command, on the test database; stopped by its group."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.process = port, log, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> Gunicorn:
        return self.launch().ready()

    def launch(self) -> Gunicorn:
        env = dict(os.environ, DATABASE_URL=database_url(), PYTHONPATH=str(ROOT), DEBUG="0",
                   UNWIND_THROTTLE_RATE="100000/min", UNWIND_TASKS_SYNC="1", UNWIND_SANDBOX="1")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [GUNICORN, "config.wsgi", "-w", "4", "-b", f"127.0.0.1:{self.port}", "--timeout", "60",
                 "--log-level", "warning"], cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log)
        return self

    def ready(self) -> Gunicorn:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/healthz", timeout=2).status_code < 500:
                    return self
            time.sleep(0.3)
        raise AssertionError(f"gunicorn on {self.port} did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """Quick shutdown (SIGINT: gunicorn stops its workers at once), as a crash or a redeploy would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, django_db_setup, django_db_blocker):
    """Two servers on two ports, 4 worker processes each, sharing the test database (started once per module)."""
    logs = tmp_path_factory.mktemp("gunicorn")
    pair = [Gunicorn(free_port(), logs / f"server{n}.log") for n in (1, 2)]
    try:
        for server in pair:
            server.launch()
        for server in pair:
            server.ready()
        yield pair
    finally:
        for server in pair:
            server.stop()
        with django_db_blocker.unblock():
            disconnected()


def disconnected(timeout: float = 10.0) -> None:
    """Wait until the stopped servers' database sessions are gone, so the test database can be dropped."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()")
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(0.2)


@pytest.fixture
def world(api, servers, settings):
    """The api world on the servers' database; alice's password hashed as the servers hash (the tests' MD5 hasher
    is a setting of this process only)."""
    assert is_postgres()
    from django.conf import global_settings
    from django.contrib.auth import get_user_model

    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS
    alice = get_user_model().objects.get(username="alice")
    alice.set_password("pw-alice")
    alice.save(update_fields=["password"])
    return api


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next server in turn, whatever URL the client asked for: a round-robin balancer
    with no stickiness. `sent` records (method, JSON-RPC method, port) for every request."""

    def __init__(self, servers: list[Gunicorn]):
        self.ports = [server.port for server in servers]
        self.inner = httpx2.AsyncHTTPTransport()
        self.sent: list[tuple[str, str, int]] = []

    async def handle_async_request(self, request):
        port = self.ports[len(self.sent) % len(self.ports)]
        body = json.loads(request.content or b"{}") if request.method == "POST" else {}
        self.sent.append((request.method, body.get("method", ""), port))
        request.url = request.url.copy_with(port=port)
        request.headers["Host"] = f"127.0.0.1:{port}"
        return await self.inner.handle_async_request(request)

    async def aclose(self):
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def connected(url: str, key: str, *, transport=None, terminate: bool = True):
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, transport=transport,
                                  timeout=httpx2.Timeout(30, read=60)) as http:
        async with streamable_http_client(url, http_client=http, terminate_on_close=terminate) as (read, write):
            async with ClientSession(read, write) as mcp:
                await mcp.initialize()
                yield mcp


async def call(mcp, name, args=None, **options):
    result = await mcp.call_tool(name, args or {}, **options)
    return result.is_error, result.structured_content


def approve(base_url: str, action_id: int) -> None:
    """A person approves in the inbox (here the approvals API) of the other server. Runs in a worker thread, whose
    database connection is closed after (none may outlive the test)."""
    approval = in_thread(ApprovalRequest.objects.get, action_id=action_id)
    decided = requests.post(f"{base_url}/api/v1/approvals/{approval.pk}/approve", json={"reason": "ok"},
                            auth=("alice", "pw-alice"), timeout=10)
    assert decided.status_code == 200, decided.text


def gated_license_tool() -> None:
    """licenses.provision needs a person's approval (a policy version of its own), so a run can wait and still
    be rolled back (every step compensatable)."""
    spec = in_process_policy()["tools"]["licenses.provision"]
    tool_upsert(tenant=acme(), name="licenses.provision", spec={**spec, "approval": "manual"}, actor="test")


def raw(server: Gunicorn, key: str, session_id: str, message: dict | None, *, method: str = "POST"):
    headers = {"Authorization": f"Bearer {key}", "Mcp-Session-Id": session_id, "Accept": "application/json, "
               "text/event-stream", "Mcp-Protocol-Version": LATEST_HANDSHAKE_VERSION}
    return requests.request(method, f"{server.url}/mcp", json=message, headers=headers, timeout=30)


def test_one_session_alternating_between_two_servers_lists_calls_waits_and_rolls_back(world, servers):
    gated_license_tool()
    transport = Alternating(servers)
    users = [{"email": f"u{n}@example.com", "name": f"U{n}"} for n in range(9)]

    async def script(mcp):
        listed = [tool.name for tool in (await mcp.list_tools()).tools]
        answers = [await call(mcp, "hr.create_user", user) for user in users[:8]]
        pending = await call(mcp, "licenses.provision", {"user_id": answers[0][1]["result"]["id"], "sku": "pro"})
        answers.append(pending)
        action_id = pending[1]["action_id"]
        decided = []

        async def person_decides(done, total, message):  # while the agent waits, on whichever server
            if not decided:
                decided.append(await asyncio.to_thread(approve, servers[1].url, action_id))

        waited = await call(mcp, "unwind_status", {"action_id": action_id, "wait": 15},
                            progress_callback=person_decides)
        answers.append(await call(mcp, "hr.create_user", users[8]))
        resent = await call(mcp, "hr.create_user", users[3])  # the same call again: matched, not done twice
        rolled = await call(mcp, "unwind_rollback", {"reason": "the ticket was withdrawn"})
        return listed, answers, waited, resent, rolled, decided

    async def main():
        async with connected(f"{servers[0].url}/mcp", world.world.key, transport=transport) as mcp:
            return await script(mcp)

    listed, answers, waited, resent, rolled, decided = asyncio.run(main())

    # Requests really alternated between the servers (initialize on one, the next request on the other, ...).
    posts = [port for method, _, port in transport.sent]
    assert posts[:4] == [servers[0].port, servers[1].port] * 2 and set(posts) == {s.port for s in servers}
    assert len([m for _, m, _ in transport.sent if m == "tools/call"]) >= 13
    assert McpSession.objects.count() == 1 and McpSession.objects.get().ended_at is not None  # DELETE ended it

    assert "hr.create_user" in listed and "unwind_status" in listed
    assert all(not is_error for is_error, _ in answers), answers
    assert answers[8][1]["pending"] is True and answers[8][1]["status"] == "awaiting_approval"
    assert decided and not waited[0] and waited[1]["status"] == "succeeded", waited
    assert not resent[0] and resent[1]["replayed"] is True and resent[1]["action_id"] == answers[3][1]["action_id"]
    run = Run.objects.get()
    assert {payload["run_id"] for _, payload in answers} == {run.pk}
    assert not rolled[0] and rolled[1]["run_status"] == "compensated" and run.status == "compensated"

    forward = list(Action.objects.filter(run=run, kind="forward").order_by("seq").values_list("tool__name", "status"))
    assert forward == [("hr.create_user", "compensated")] * 8 + [("licenses.provision", "compensated"),
                                                                 ("hr.create_user", "compensated")]
    assert len(effects("hr.create_user")) == 9 and len(effects("licenses.provision")) == 1  # nothing ran twice
    assert len(rolled[1]["undone"]) == 10 and rolled[1]["undone"][0]["undone_by"] == "hr.delete_user"
    assert world_state(tenant=acme())["users"] == []


def test_a_server_restarted_mid_session_the_same_session_continues_the_same_run(world, servers):
    first, second = servers

    async def main():
        async with connected(f"{first.url}/mcp", world.world.key, terminate=False) as mcp:
            before = await call(mcp, "hr.create_user", {"email": "a@example.com", "name": "A"})
            await asyncio.to_thread(first.stop)
            await asyncio.to_thread(first.start)  # every process of the server is new: nothing of the session is left
            after = await call(mcp, "hr.create_user", {"email": "b@example.com", "name": "B"})
            return before, after

    (before_error, before), (after_error, after) = asyncio.run(main())
    assert not before_error and not after_error, after
    assert after["run_id"] == before["run_id"] and Run.objects.count() == 1
    session = McpSession.objects.get()
    assert session.run_id == before["run_id"]
    # The same session's id, sent to the other server, still finds the run.
    answered = raw(second, world.world.key, session.session_id, {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                   "params": {"name": "unwind_status", "arguments": {}}})
    assert answered.status_code == 200 and answered.json()["result"]["structuredContent"]["run_id"] == before["run_id"]
    assert len(effects("hr.create_user")) == 2


def test_another_agents_key_with_a_known_session_id_is_refused_on_every_server(world, servers):
    async def main():
        async with connected(f"{servers[0].url}/mcp", world.world.key, terminate=False) as mcp:
            return await call(mcp, "hr.create_user", {"email": "a@example.com", "name": "A"})

    _, created = asyncio.run(main())
    session_id = McpSession.objects.get().session_id
    _, colleague = agent_create(tenant=acme(), name="colleague")  # same tenant, another agent
    evil = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
            "params": {"name": "hr.create_user", "arguments": {"email": "evil@example.com", "name": "Evil"}}}
    for server in servers:
        for key in (colleague, world.world.other_key):
            refused = raw(server, key, session_id, evil)
            assert refused.status_code == 404 and "result" not in refused.json(), refused.text
            assert raw(server, key, session_id, None, method="DELETE").status_code == 404
    assert Action.objects.count() == 1 and len(effects("hr.create_user")) == 1
    assert McpSession.objects.get().ended_at is None  # the stranger's DELETE ended nothing

    # Its own agent ends it on one server; then every server answers 404 for it.
    assert raw(servers[1], world.world.key, session_id, None, method="DELETE").status_code == 204
    for server in servers:
        assert raw(server, world.world.key, session_id, evil).status_code == 404
    assert Action.objects.count() == 1 and Run.objects.get().pk == created["run_id"]
