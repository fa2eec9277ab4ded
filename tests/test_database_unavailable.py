"""A database that stops answering in the middle of a request (a restart, a failover, a proxy cutting an idle
connection) gets a 503 the agent can act on, never a 500: the request's transaction committed or it did not, so
the answer says to send it again with the same Idempotency-Key, and the next request opens a new connection.

Over real HTTP against a live server, with the request's own PostgreSQL backend really terminated at a chosen
statement (`pg_terminate_backend` from another connection): nothing is simulated but the timing.
"""
from __future__ import annotations

import threading

import psycopg
import pytest
import requests
from django.db import connection
from django.db.backends.signals import connection_created

from ledger.models import Action, AuditEvent, Run
from tests.conftest import needs_postgres

pytestmark = needs_postgres


class Cut:
    """Terminates the backend of the next connection (of any thread: the live server's request threads too) that
    runs a statement containing `marker`, just before that statement, once per `arm`."""

    def __init__(self):
        self.marker = None
        self.lock = threading.Lock()
        self.cut = 0

    def arm(self, marker: str) -> None:
        with self.lock:
            self.marker = marker

    def wrapper(self, execute, sql, params, many, context):
        with self.lock:
            hit = self.marker is not None and self.marker in sql
            if hit:
                self.marker = None
        if hit:
            raw = context["connection"].connection
            with psycopg.connect(**{**raw.info.get_parameters(), "password": raw.info.password or None},
                                 autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s, 5000)", [raw.info.backend_pid])
            self.cut += 1
        return execute(sql, params, many, context)

    def install(self, sender, connection, **kwargs):
        if self.wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(self.wrapper)


@pytest.fixture
def cut(http_tools):
    cutter = Cut()
    cutter.world = http_tools
    connection_created.connect(cutter.install)
    yield cutter
    connection_created.disconnect(cutter.install)


def call(world, method: str, path: str, body: dict | None = None, key: str | None = None):
    headers = {"Authorization": f"Bearer {world.key}"}
    if key:
        headers["Idempotency-Key"] = key
    return requests.request(method, world.live_server.url + path, json=body, headers=headers, timeout=30)


def assert_unavailable(response) -> None:
    assert response.status_code == 503, (response.status_code, response.text[:500])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    assert response.headers["Retry-After"] == "1"
    body = response.json()
    assert body["code"] == "database_unavailable" and "same Idempotency-Key" in body["detail"]


def test_a_connection_cut_while_authenticating_answers_503_and_the_next_request_works(cut):
    world = cut.world
    cut.arm("ledger_agent")  # the agent's key is looked up first, on every request
    assert_unavailable(call(world, "POST", "/api/v1/runs", {"goal": "cut"}, key="open-cut-1"))
    assert cut.cut == 1
    connection.close()  # this test's own connection may have been the one cut: it reconnects
    assert not Run.objects.filter(open_key="open-cut-1").exists()  # nothing was recorded
    again = call(world, "POST", "/api/v1/runs", {"goal": "cut"}, key="open-cut-1")
    assert again.status_code == 201, again.text[:500]
    assert Run.objects.filter(open_key="open-cut-1").count() == 1


def test_a_connection_cut_before_the_proposal_is_recorded_loses_nothing_and_the_retry_records_it_once(cut, settings):
    world = cut.world
    run = call(world, "POST", "/api/v1/runs", {"goal": "cut a proposal"}).json()
    events_before = AuditEvent.objects.filter(run_ref=run["id"]).count()
    # The statement that records the proposal: the fast path's one call, or the Python path's insert of the step.
    cut.arm("unwind_propose(" if settings.UNWIND_FAST_PATH else 'INSERT INTO "ledger_action"')
    body = {"tool": "hr.create_user", "args": {"email": "cut@company.com", "name": "Cut"}}
    assert_unavailable(call(world, "POST", f"/api/v1/runs/{run['id']}/actions", body, key="cut-step-1"))
    connection.close()
    assert not Action.objects.filter(run_id=run["id"]).exists()
    assert AuditEvent.objects.filter(run_ref=run["id"]).count() == events_before
    again = call(world, "POST", f"/api/v1/runs/{run['id']}/actions", body, key="cut-step-1")
    assert again.status_code in (201, 202), again.text[:500]
    assert Action.objects.filter(run_id=run["id"], idempotency_key="cut-step-1").count() == 1


def test_a_page_whose_connection_is_cut_answers_a_503_page_and_the_reload_works(cut):
    """People's pages too: a short page that says what happened, 503 with Retry-After, never Django's 500."""
    from django.test import Client

    world = cut.world
    browser = Client()
    browser.force_login(world.oscar)
    cookies = {"sessionid": browser.cookies["sessionid"].value}
    cut.arm("django_session")  # the session is read first on every page
    page = requests.get(world.live_server.url + "/console/recovery/", cookies=cookies, timeout=30)
    assert page.status_code == 503 and page.headers["Retry-After"] == "1"
    assert "The database is not answering" in page.text and "Traceback" not in page.text
    connection.close()
    again = requests.get(world.live_server.url + "/console/recovery/", cookies=cookies, timeout=30)
    assert again.status_code == 200 and "Recovery" in again.text


def test_the_mcp_endpoint_answers_the_same_problem(cut):
    """/mcp authenticates the agent outside DRF: the middleware answers the API's problem, and the retry is served."""
    world = cut.world
    headers = {"Authorization": f"Bearer {world.key}", "Accept": "application/json, text/event-stream"}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "cut", "version": "1"}}}
    cut.arm("ledger_agent")
    assert_unavailable(requests.post(world.live_server.url + "/mcp", json=initialize, headers=headers, timeout=30))
    again = requests.post(world.live_server.url + "/mcp", json=initialize, headers=headers, timeout=30)
    assert again.status_code == 200, again.text[:300]
