"""Issue 12, the trust boundary: what a policy may make Unwind run, fetch, and spend time on.

Every attack is made over HTTP against a live server, as a person with the admin role: the guards hold
for admins too, because an admin of one tenant must reach neither the server nor the other tenants.
Each test asserts the refusal and that nothing happened: a marker file not written, a loopback listener
that recorded no connection, no tool row written.
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from django.db import connection

from ledger.models import Action, Tool
from tests.quick_server import QUICK_SHUTDOWN

MARKER: dict[str, Path] = {}


def write_marker(*args, **kwargs):
    """Any importable function: what a dotted path in policy used to reach (os:system, os:getenv...)."""
    MARKER["path"].write_text(repr(args))
    return {"ran": True}


class Listener:
    """A real HTTP server on 127.0.0.1:<free port> that records every connection it accepts."""

    def __init__(self, status: int = 200, body: bytes = b'{"ok": true}', headers: dict | None = None,
                 declare_length: bool = True):
        listener = self
        self.connections: list = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.answer()

            def answer(self):
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                if declare_length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request, client_address):
                listener.connections.append(client_address)
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listeners():
    started: list[Listener] = []

    def start(**kwargs) -> Listener:
        started.append(Listener(**kwargs))
        return started[-1]

    yield start
    for listener in started:
        listener.close()


@pytest.fixture
def admin(http_tools):
    """Ada, the World's person with the admin role in acme, speaking HTTP Basic to the live server."""
    session = requests.Session()
    session.auth = ("ada", "pw-ada")
    session.base = http_tools.live_server.url
    return session


def write_behind_the_services(statement: str, params: list) -> None:
    """Someone with database access edits a recorded policy version (the ORM refuses to)."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def put_tool(admin, name: str, spec: dict) -> requests.Response:
    return admin.put(f"{admin.base}/api/v1/tools/{name}", json=spec, timeout=30)


def assert_refused(response: requests.Response, field: str) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:500])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == "validation_error", body
    assert body["field"] == field, body
    return body


def agent(world) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    session.base = world.live_server.url
    return session


def propose(world, tool: str, args: dict, *, timeout: float = 30) -> requests.Response:
    client = agent(world)
    run = client.post(f"{client.base}/api/v1/runs", json={"goal": "trust boundary", "on_behalf_of": "carol@example.com"},
                      timeout=timeout)
    assert run.status_code == 201, run.text
    return client.post(f"{client.base}/api/v1/runs/{run.json()['id']}/actions", json={"tool": tool, "args": args},
                       timeout=timeout)


def failed_action(response: requests.Response) -> Action:
    assert response.status_code in (200, 201), (response.status_code, response.text[:500])
    action = Action.objects.get(pk=response.json()["id"])
    assert action.status in ("failed", "lost"), (action.status, action.error_message)
    return action


TICKET = {"endpoint": "/sandbox/crm/tickets", "args_schema": {"type": "object"}, "compensation": "none"}


# --- 1. run any command on the server -------------------------------------------------------------

CODE_ATTACKS = [
    ({"executor": {"kind": "python", "path": "os:system"}}, "tools.evil.executor.path"),
    ({"executor": "python", "path": "tests.test_trust_code_and_urls:write_marker"}, "tools.evil.path"),
    ({**TICKET, "snapshot": {"read": "os:system"}}, "tools.evil.snapshot.read"),
    ({**TICKET, "lookup": {"read": "linecache:getlines"}}, "tools.evil.lookup.read"),
    ({**TICKET, "verify": {"read": "os:getenv", "expect": {"id": "$args.id"}}}, "tools.evil.verify.read"),
    ({**TICKET, "snapshot": {"read": "tests.test_trust_code_and_urls.write_marker"}}, "tools.evil.snapshot.read"),
]


@pytest.mark.parametrize("spec,field", CODE_ATTACKS, ids=[f for _, f in CODE_ATTACKS])
def test_policy_naming_importable_code_is_refused(admin, http_tools, tmp_path, spec, field):
    MARKER["path"] = tmp_path / "marker"
    body = assert_refused(put_tool(admin, "evil", spec), field)
    assert "is not a registered Python" in body["detail"] and "never by import path" in body["detail"], body
    assert not Tool.objects.filter(name="evil").exists()
    document = {"tools": {"evil": {**spec, "target": {"type": "t", "from": "args.cmd"}}}}
    loaded = admin.post(f"{admin.base}/api/v1/policy", json=document, timeout=30)
    assert_refused(loaded, field)
    assert not Tool.objects.filter(name="evil").exists()
    assert not MARKER["path"].exists()


def test_a_dotted_path_already_in_the_database_is_never_imported(admin, http_tools, tmp_path):
    """A row written before this rule (or around the API) names an import path: the call fails for good."""
    MARKER["path"] = tmp_path / "marker"
    created = put_tool(admin, "inproc", {"executor": {"kind": "python", "path": "sandbox.crm.update_ticket"},
                                         "args_schema": {"type": "object"}, "compensation": "none"})
    assert created.status_code == 201, created.text
    write_behind_the_services("UPDATE ledger_tool SET endpoint = %s WHERE name = %s",
                              ["tests.test_trust_code_and_urls:write_marker", "inproc"])
    action = failed_action(propose(http_tools, "inproc", {"cmd": "id"}))
    assert "is not a registered Python tool" in action.error_message
    assert not MARKER["path"].exists()


def test_a_registered_key_runs_the_registered_tool(admin, http_tools):
    created = put_tool(admin, "inproc", {"executor": {"kind": "python", "path": "sandbox.crm.create_ticket"},
                                         "args_schema": {"type": "object"}, "compensation": "none"})
    assert created.status_code == 201, created.text
    proposed = propose(http_tools, "inproc", {"id": "T-900", "subject": "printer jam"})
    assert proposed.status_code == 201 and proposed.json()["status"] == "succeeded", proposed.text


# --- 3. make Unwind fetch any URL -----------------------------------------------------------------

URL_FIELDS = [
    (lambda url: {"endpoint": url, "compensation": "none"}, "tools.fetch.endpoint"),
    (lambda url: {"executor": {"kind": "http", "url": url}, "compensation": "none"}, "tools.fetch.executor.url"),
    (lambda url: {**TICKET, "snapshot": {"read": url}}, "tools.fetch.snapshot.read"),
    (lambda url: {**TICKET, "lookup": {"read": url}}, "tools.fetch.lookup.read"),
    (lambda url: {**TICKET, "verify": {"read": url, "expect": {"id": "$args.id"}}}, "tools.fetch.verify.read"),
]


@pytest.mark.parametrize("shape,field", URL_FIELDS, ids=[f for _, f in URL_FIELDS])
def test_a_url_outside_the_allowed_origins_is_refused_when_written(admin, http_tools, listeners, shape, field):
    listener = listeners()
    for url in [f"{listener.origin}/charge", "http://169.254.169.254/latest/meta-data/",
                f"http://127.0.0.1:{listener.port}@127.0.0.1:5432/", f"https://127.0.0.1:{listener.port}/"]:
        body = assert_refused(put_tool(admin, "fetch", shape(url)), field)
        assert "origin" in body["detail"] or "user name" in body["detail"], body
    assert_refused(put_tool(admin, "fetch", shape(f"httpx://127.0.0.1:{listener.port}/")), field)
    assert not Tool.objects.filter(name="fetch").exists()
    assert listener.connections == []


@pytest.fixture
def rebound_name(monkeypatch):
    """A DNS name that resolves to loopback, as a name an attacker controls can be made to (DNS rebinding)."""
    name = "tools.rebound.test"
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        return real("127.0.0.1" if host == name else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return name


def test_a_name_resolving_to_loopback_is_refused_at_connect_time(admin, http_tools, listeners, rebound_name, settings):
    listener = listeners()
    settings.UNWIND_TOOL_ORIGINS = [f"http://{rebound_name}:{listener.port}"]
    created = put_tool(admin, "fetch", {"endpoint": f"http://{rebound_name}:{listener.port}/charge",
                                        "args_schema": {"type": "object"}, "compensation": "none",
                                        "retry": {"max_attempts": 1}})
    assert created.status_code == 201, created.text
    action = failed_action(propose(http_tools, "fetch", {"amount": 1}))
    assert "resolves to 127.0.0.1" in action.error_message, action.error_message
    assert listener.connections == []

    # The same tool on a network the deployer declared private is reached: the refusal above was the guard's.
    settings.UNWIND_TOOL_PRIVATE_NETWORKS = ["127.0.0.0/8"]
    proposed = propose(http_tools, "fetch", {"amount": 2})
    assert proposed.json()["status"] == "succeeded", proposed.text
    assert len(listener.connections) == 1


def test_a_redirect_is_not_followed(admin, http_tools, listeners, settings):
    second = listeners()
    first = listeners(status=302, headers={"Location": f"{second.origin}/internal"})
    settings.UNWIND_TOOL_ORIGINS = [first.origin, second.origin]
    created = put_tool(admin, "hop", {"endpoint": f"{first.origin}/charge", "args_schema": {"type": "object"},
                                      "compensation": "none"})
    assert created.status_code == 201, created.text
    action = failed_action(propose(http_tools, "hop", {"amount": 1}))
    assert "redirect" in action.error_message and "does not follow" in action.error_message, action.error_message
    assert len(first.connections) == 1
    assert second.connections == []


def test_a_remote_ref_in_args_schema_is_refused_and_never_fetched(admin, http_tools, listeners):
    listener = listeners(body=b'{"type": "object"}')
    schema = {"type": "object", "properties": {"x": {"$ref": f"{listener.origin}/schema.json"}}}
    assert_refused(put_tool(admin, "schema", {**TICKET, "args_schema": schema}),
                   "tools.schema.args_schema.properties.x.$ref")
    assert not Tool.objects.filter(name="schema").exists()

    # A schema written around the API (a row from before this rule) is evaluated without fetching either.
    assert put_tool(admin, "schema", TICKET).status_code == 201
    write_behind_the_services("UPDATE ledger_tool SET args_schema = %s WHERE name = %s", [json.dumps(schema), "schema"])
    proposed = propose(http_tools, "schema", {"x": 1})
    assert proposed.status_code == 400 and proposed.json()["field"] == "args_schema", proposed.text
    assert listener.connections == []


# --- 4. stall the service -------------------------------------------------------------------------

REDOS = "^(a+)+$"
EVIL_INPUT = "a" * 40 + "!"  # Python's backtracking `re` would take longer than the age of the universe


def test_a_backtracking_pattern_is_evaluated_in_linear_time(admin, http_tools):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": REDOS}},
              "patternProperties": {REDOS: {"type": "integer"}}, "additionalProperties": False}
    created = put_tool(admin, "redos", {**TICKET, "args_schema": schema})
    assert created.status_code == 201, created.text
    # Outcomes, not timings: with a backtracking engine these requests would not come back within the timeout.
    refused = propose(http_tools, "redos", {"name": EVIL_INPUT}, timeout=60)
    assert refused.status_code == 400 and refused.json()["field"] == "args.name", refused.text
    extra = propose(http_tools, "redos", {EVIL_INPUT: 1}, timeout=60)
    assert extra.status_code == 400 and "does not match any of the regexes" in extra.json()["detail"], extra.text


@pytest.mark.parametrize("pattern", ["(a)\\1", "(?=a)a", "(?<!b)a"])
def test_a_pattern_only_a_backtracking_engine_can_run_is_refused(admin, http_tools, pattern):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": pattern}}}
    assert_refused(put_tool(admin, "redos", {**TICKET, "args_schema": schema}),
                   "tools.redos.args_schema.properties.name.pattern")
    assert_refused(put_tool(admin, "redos", {**TICKET, "args_schema": {"patternProperties": {pattern: {}}}}),
                   "tools.redos.args_schema.patternProperties")
    assert not Tool.objects.filter(name="redos").exists()


BOUNDS = [
    ({"timeout": 1e12}, "tools.slow.timeout"),
    ({"timeout": "100000000000s"}, "tools.slow.timeout"),
    ({"timeout": 0.01}, "tools.slow.timeout"),
    ({"retry": {"max_attempts": 10**15}}, "tools.slow.retry.max_attempts"),
    ({"retry": {"max_attempts": 21}}, "tools.slow.retry.max_attempts"),
    ({"retry": {"backoff": 1e300}}, "tools.slow.retry.backoff"),
    ({"retry": {"backoff": "2d"}}, "tools.slow.retry.backoff"),
    ({"approvals_required": 11}, "tools.slow.approvals_required"),
    ({"compensation": {"strategy": "twin", "tool": "crm.close_ticket", "approvals_required": 10**12}},
     "tools.slow.compensation.approvals_required"),
]


@pytest.mark.parametrize("change,field", BOUNDS, ids=[f"{f}={json.dumps(c)[:30]}" for c, f in BOUNDS])
def test_limits_out_of_bounds_are_refused(admin, http_tools, change, field):
    body = assert_refused(put_tool(admin, "slow", {**TICKET, **change}), field)
    assert "must be from" in body["detail"], body
    assert_refused(admin.post(f"{admin.base}/api/v1/policy", json={"tools": {"slow": {**TICKET, **change}}},
                              timeout=30), field)
    assert not Tool.objects.filter(name="slow").exists()


def test_limits_at_their_bounds_are_accepted(admin, http_tools):
    spec = {**TICKET, "timeout": 300, "retry": {"max_attempts": 20, "backoff": "1h"}, "approvals_required": 10}
    accepted = put_tool(admin, "slow", spec)
    assert accepted.status_code == 201, accepted.text
    tool = Tool.objects.get(name="slow")
    assert (tool.timeout_seconds, tool.max_attempts, tool.backoff_seconds, tool.approvals_required) == (300, 20, 3600, 10)


@pytest.mark.parametrize("declare_length", [True, False], ids=["declared", "streamed"])
def test_an_oversized_answer_is_refused_not_kept(admin, http_tools, listeners, settings, declare_length):
    settings.UNWIND_TOOL_MAX_RESPONSE_BYTES = 4096
    listener = listeners(body=json.dumps({"data": "x" * 100_000}).encode(), declare_length=declare_length)
    settings.UNWIND_TOOL_ORIGINS = [listener.origin]
    created = put_tool(admin, "big", {"endpoint": f"{listener.origin}/charge", "args_schema": {"type": "object"},
                                      "compensation": "none"})
    assert created.status_code == 201, created.text
    action = failed_action(propose(http_tools, "big", {"amount": 1}))
    assert "larger than 4096 bytes" in action.error_message, action.error_message
    assert action.result is None or "x" * 4096 not in json.dumps(action.result)
    assert len(listener.connections) == 1


def test_what_an_agent_sees_of_a_tool_error_is_bounded_and_clean(admin, http_tools, listeners, settings):
    detail = "\x1b[31mSELECT * FROM secrets\x00\r\n" + "internal dump " * 500
    listener = listeners(status=422, body=json.dumps({"detail": detail}).encode())
    settings.UNWIND_TOOL_ORIGINS = [listener.origin]
    created = put_tool(admin, "noisy", {"endpoint": f"{listener.origin}/charge", "args_schema": {"type": "object"},
                                        "compensation": "none"})
    assert created.status_code == 201, created.text
    proposed = propose(http_tools, "noisy", {"amount": 1})
    # A 422 is a refusal the agent is answered with (422 tool_refused): its reason is the cleaned message.
    assert proposed.status_code == 422 and proposed.json()["code"] == "tool_refused", proposed.text[:500]
    message = proposed.json()["reason"]
    assert len(message) <= 300 and message.endswith("…"), message
    assert message.isprintable() and "\x1b" not in message and "\n" not in message, message
    assert proposed.json()["action"]["error"]["message"] == message
    detail = proposed.json()["detail"]
    assert len(detail) <= 500 and detail.isprintable() and "SELECT" in detail and "\x1b" not in detail, detail
    assert Action.objects.get(pk=proposed.json()["action_id"]).error_message == message


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "169.254.169.254", "10.1.2.3", "172.16.0.1", "192.168.1.1",
                                     "100.64.0.1", "0.0.0.0", "::", "224.0.0.1", "ff02::1", "240.0.0.1", "fe80::1",
                                     "fc00::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254"])
def test_a_dns_named_origin_may_not_reach_internal_addresses(settings, address):
    from ledger.executors.egress import address_allowed

    settings.UNWIND_TOOL_PRIVATE_NETWORKS = []
    assert not address_allowed("tools.example.com", address)
    assert address_allowed("tools.example.com", "93.184.216.34")
    settings.UNWIND_TOOL_PRIVATE_NETWORKS = ["10.0.0.0/8"]
    assert address_allowed("tools.example.com", "10.1.2.3")
    assert not address_allowed("tools.example.com", "169.254.169.254")


def test_an_ip_literal_or_localhost_origin_allows_exactly_that(settings):
    from ledger.executors.egress import address_allowed

    assert address_allowed("127.0.0.1", "127.0.0.1") and not address_allowed("127.0.0.1", "127.0.0.2")
    assert address_allowed("localhost", "127.0.0.1") and address_allowed("localhost", "::1")
    assert not address_allowed("localhost", "10.0.0.1")
