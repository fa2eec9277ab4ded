"""Unwind as an MCP proxy (issue 16): a tool's executor is a tool of an upstream MCP server.

Everything is real: Unwind on a live server, the agent and the people over HTTP, and the upstream a small MCP
server built with the `mcp` SDK (tests/mcp_upstream_server.py), started by the test on loopback, over
streamable HTTP (a subprocess with uvicorn) and over stdio (a subprocess Unwind starts per call). The upstream
writes every effect to a file, so each test sees what reached it.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command

from ledger.executors import mcp as mcp_upstream
from ledger.executors.call import ToolError, mcp_call
from ledger.models import Action, Tool

UPSTREAM = str(Path(__file__).resolve().parent / "mcp_upstream_server.py")
BOOK_SCHEMA = {"type": "object", "required": ["seat"], "properties": {"seat": {"type": "string"}}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Upstream:
    """The upstream MCP server over streamable HTTP on 127.0.0.1:<free port>, and the same tools over stdio."""

    def __init__(self, effects: Path):
        self.effects = effects
        self.effects.touch()
        self.port = free_port()
        self.origin = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.origin}/mcp"
        self.process = subprocess.Popen([sys.executable, UPSTREAM, "http", str(self.port), str(effects)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the upstream MCP server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the upstream MCP server did not start listening within 30s")

    def stdio(self) -> dict:
        return {"command": sys.executable, "args": [UPSTREAM, "stdio", str(self.effects)]}

    def calls(self, tool: str | None = None) -> list[dict]:
        lines = [json.loads(line) for line in self.effects.read_text().splitlines() if line.strip()]
        return [line for line in lines if tool is None or line["tool"] == tool]

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stderr.close()


@pytest.fixture
def upstream(http_tools, settings, tmp_path):
    """The live Unwind (acme's people and agent) with two declared upstream servers: "crm" over streamable HTTP
    and "desk" over stdio, both serving the seat world."""
    server = Upstream(tmp_path / "effects.jsonl")
    settings.UNWIND_TOOL_ORIGINS = [server.origin]
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": server.url}, "desk": server.stdio()}
    # A step's first call to "desk" starts its process (Python and the MCP SDK): on a loaded CI machine that took
    # longer than the 5 s a request waits for a step, and the agent was answered 202 before the upstream's answer.
    # These tests are about the answer, so the request waits for it.
    settings.UNWIND_INLINE_WAIT = 30.0
    http_tools.upstream = server
    yield http_tools
    server.close()


def person(world, username: str = "ada") -> requests.Session:
    session = requests.Session()
    session.auth = (username, f"pw-{username}")
    session.base = world.live_server.url
    return session


def agent(world) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    session.base = world.live_server.url
    return session


def mcp(server: str, tool: str) -> dict:
    return {"kind": "mcp", "server": server, "tool": tool}


def policy(server: str = "crm") -> dict:
    """Seats and cards behind an upstream MCP server; the booking's undo is the upstream's cancel tool."""
    return {"tools": {
        "seats.cancel": {"executor": mcp(server, "cancel"), "approval": "auto", "compensation": "none",
                         "args_schema": {"type": "object"}, "retry": {"max_attempts": 2, "backoff": 0}},
        "seats.book": {"executor": mcp(server, "book"), "approval": "auto", "args_schema": BOOK_SCHEMA,
                       "compensation": {"strategy": "twin", "tool": "seats.cancel",
                                        "args": {"booking_id": "$result.booking_id"}}},
        "cards.charge": {"executor": mcp(server, "charge"), "saga_role": "pivot", "approval": "auto",
                         "compensation": "none", "on_refusal": "unwind", "args_schema": {"type": "object"}},
        "seats.slow": {"executor": mcp(server, "slow"), "approval": "auto", "compensation": "none", "timeout": 1,
                       "retry": {"max_attempts": 2, "backoff": 0}, "args_schema": {"type": "object"}},
    }}


def load(world, document: dict) -> requests.Response:
    admin = person(world)
    return admin.post(f"{admin.base}/api/v1/policy", json=document, timeout=30)


def open_run(client) -> int:
    opened = client.post(f"{client.base}/api/v1/runs", json={"goal": "book a trip", "on_behalf_of": "carol@example.com"},
                         timeout=30)
    assert opened.status_code == 201, opened.text
    return opened.json()["id"]


def propose(client, run_id: int, tool: str, args: dict) -> requests.Response:
    return client.post(f"{client.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args}, timeout=60)


def wait(client, action_id: int) -> dict:
    return client.get(f"{client.base}/api/v1/actions/{action_id}/wait?timeout=20", timeout=60).json()


def assert_refused_field(response: requests.Response, field: str, words: str) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:800])
    problem = response.json()
    assert problem["code"] == "validation_error" and problem["field"] == field, problem
    assert words in problem["detail"], problem
    return problem


# --- calls through the proxy -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("server, protocol, spoken", [
    ("crm", "auto", "2026-07-28"), ("crm", "legacy", "2025-11-25"), ("crm", "2026-07-28", "2026-07-28"),
    ("desk", "auto", "2026-07-28"), ("desk", "legacy", "2025-11-25")])
def test_a_call_goes_through_the_proxy_to_the_upstream_tool(upstream, settings, server, protocol, spoken):
    """The official client speaks the upstream's revision: 2026-07-28 to a server that answers server/discover
    (`auto`, the default, or pinned), the initialize handshake when the deployer says `legacy`."""
    settings.UNWIND_MCP_SERVERS = {**settings.UNWIND_MCP_SERVERS,
                                   server: {**settings.UNWIND_MCP_SERVERS[server], "protocol": protocol}}
    loaded = load(upstream, policy(server))
    assert loaded.status_code == 200, loaded.text
    assert Tool.objects.get(tenant=upstream.acme, name="seats.book", is_current=True).endpoint == f"{server}/book"
    client = agent(upstream)
    run_id = open_run(client)

    booked = propose(client, run_id, "seats.book", {"seat": "3C"})
    assert booked.status_code == 201, booked.text
    body = booked.json()
    assert body["status"] == "succeeded", body
    assert body["result"] == {"booking_id": "bk-3C", "seat": "3C"}, "structuredContent is the step's result"
    action = Action.objects.get(pk=body["id"])
    assert upstream.upstream.calls() == [{"tool": "book", "args": {"seat": "3C"}, "key": action.tool_key,
                                          "protocol": spoken}], \
        "one call upstream, in the revision asked for, carrying Unwind's idempotency key in _meta"
    completed = client.post(f"{client.base}/api/v1/runs/{run_id}/complete", timeout=30)
    assert completed.status_code == 200 and completed.json()["status"] == "completed", completed.text
    assert upstream.upstream.calls("cancel") == []


@pytest.mark.slow
@pytest.mark.parametrize("server", ["crm", "desk"])
def test_an_upstream_is_error_answers_the_agent_422_tool_refused_and_the_run_goes_on(upstream, server):
    assert load(upstream, policy(server)).status_code == 200
    client = agent(upstream)
    run_id = open_run(client)

    refused = propose(client, run_id, "seats.book", {"seat": "12A"})
    assert refused.status_code == 422, refused.text
    problem = refused.json()
    assert problem["code"] == "tool_refused" and "seat 12A is taken" in problem["reason"], problem
    assert problem["run_status"] == "running"
    assert problem["action"]["error"]["error_class"] == "refused"
    assert upstream.upstream.calls() == [], "the upstream turned it down: nothing happened"

    again = propose(client, run_id, "seats.book", {"seat": "12B"})
    assert again.status_code == 201 and again.json()["status"] == "succeeded", again.text
    assert [call["args"]["seat"] for call in upstream.upstream.calls("book")] == ["12B"]


@pytest.mark.slow
def test_a_later_failure_calls_the_upstream_compensation_twin(upstream):
    assert load(upstream, policy("crm")).status_code == 200
    client = agent(upstream)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).json()["status"] == "succeeded"

    failed = propose(client, run_id, "cards.charge", {"card": "declined", "amount": 120})
    assert failed.status_code == 201, failed.text  # on_refusal: unwind, as for an HTTP tool's 4xx
    body = failed.json()
    assert body["status"] == "failed" and body["error"]["error_class"] == "mcp_is_error", body
    assert "insufficient funds" in body["error"]["message"]
    settled = wait(client, body["id"])
    assert settled["run_status"] == "compensated", settled
    assert upstream.upstream.calls("cancel") == [
        {"tool": "cancel", "args": {"booking_id": "bk-3C"},
         "key": Action.objects.get(run_id=run_id, kind="compensation").tool_key, "protocol": "2026-07-28"}]
    assert upstream.upstream.calls("charge") == []


@pytest.mark.slow
def test_a_call_whose_outcome_is_lost_goes_to_a_person_and_is_not_sent_again(upstream):
    """An upstream MCP tool ignores Unwind's key unless its policy says otherwise: after a timeout the step is
    never sent again on a guess."""
    assert load(upstream, policy("crm")).status_code == 200
    assert not Tool.objects.get(tenant=upstream.acme, name="seats.slow", is_current=True).honours_idempotency_key
    client = agent(upstream)
    run_id = open_run(client)
    proposed = propose(client, run_id, "seats.slow", {"note": "n1"})
    assert proposed.status_code in (201, 202), proposed.text
    action_id = proposed.json()["id"]
    deadline = time.monotonic() + 30
    while Action.objects.get(pk=action_id).status not in ("lost", "succeeded", "failed") and time.monotonic() < deadline:
        from ledger.engine.sweep import sweep

        sweep()
        time.sleep(0.5)
    action = Action.objects.get(pk=action_id)
    assert (action.status, action.error_class) == ("lost", "outcome_unknown"), (action.status, action.error_message)
    assert action.run.status == "needs_attention"
    assert len(upstream.upstream.calls("slow")) == 1, "one effect: never re-sent without knowing"


@pytest.mark.slow
def test_an_mcp_tool_reads_back_as_written_and_a_put_of_it_changes_nothing(upstream):
    assert load(upstream, policy("crm")).status_code == 200
    admin = person(upstream)
    shown = admin.get(f"{admin.base}/api/v1/tools/seats.book", timeout=30).json()
    assert shown["policy"]["executor"] == mcp("crm", "book") and "endpoint" not in shown["policy"]
    assert shown["policy"]["idempotency"]["honours_key"] is False, "an upstream MCP tool ignores the key by default"
    again = admin.put(f"{admin.base}/api/v1/tools/seats.book", json=shown["policy"], timeout=30)
    assert again.status_code == 200 and again.json()["version"] == shown["version"], again.text


@pytest.mark.slow
def test_a_result_larger_than_the_cap_is_not_kept(upstream, settings):
    settings.UNWIND_TOOL_MAX_RESPONSE_BYTES = 2048
    assert mcp_call(endpoint="crm/big", args={"size": 1000}, idempotency_key="k1", timeout=10,
                    tenant="acme").result == {"result": "x" * 1000}, "a str result is wrapped as structuredContent"
    with pytest.raises(ToolError, match="larger than 2048 bytes") as refused:
        mcp_call(endpoint="crm/big", args={"size": 5000}, idempotency_key="k2", timeout=10, tenant="acme")
    assert refused.value.maybe_applied and not refused.value.transient


# --- what policy may and may not name ------------------------------------------------------------------------

def test_a_policy_naming_an_undeclared_server_is_refused_when_written(upstream):
    before = Tool.objects.count()
    document = {"tools": {"x.book": {"executor": mcp("elsewhere", "book"), "approval": "auto"}}}
    assert_refused_field(load(upstream, document), "tools.x.book.executor.server",
                         "'elsewhere' is not a declared MCP server (declared: crm, desk)")
    assert Tool.objects.count() == before


@pytest.mark.slow
def test_a_server_declared_for_one_tenant_is_not_another_tenants(upstream, settings):
    """A server's URL, headers (credentials) or command belong to the tenants the deployer declared it for:
    another tenant's admin cannot name it in policy, and a call under a policy written before is not sent."""
    settings.UNWIND_MCP_SERVERS = {**settings.UNWIND_MCP_SERVERS,
                                   "crm": {"url": upstream.upstream.url, "tenants": ["acme"]}}
    mallory = person(upstream, "mallory")
    before = Tool.objects.filter(tenant=upstream.globex).count()
    answer = mallory.post(f"{mallory.base}/api/v1/policy", json=policy("crm"), timeout=30)
    assert_refused_field(answer, "tools.seats.cancel.executor.server", "is not declared for tenant 'globex'")
    assert Tool.objects.filter(tenant=upstream.globex).count() == before
    assert load(upstream, policy("crm")).status_code == 200, "acme's admin may"

    with pytest.raises(ToolError, match="is not declared for tenant 'globex'") as refused:
        mcp_call(endpoint="crm/book", args={"seat": "3C"}, idempotency_key="k1", timeout=5, tenant="globex")
    assert refused.value.not_sent
    assert upstream.upstream.calls() == []


@pytest.mark.parametrize("extra, field", [
    ({"command": "/bin/sh", "args": ["-c", "touch {marker}"]}, "command"),
    ({"args": ["-c", "touch {marker}"]}, "args"),
    ({"env": {"PYTHONSTARTUP": "{marker}"}}, "env"),
    ({"url": "http://169.254.169.254/mcp"}, "url"),
    ({"headers": {"Authorization": "Bearer stolen"}}, "headers"),
])
def test_a_stdio_command_or_a_url_cannot_come_from_the_api(upstream, tmp_path, extra, field):
    """Policy names a declared server; it never says what to start, with what, or where to connect."""
    marker = tmp_path / "marker"
    extra = json.loads(json.dumps(extra).replace("{marker}", str(marker)))
    before = Tool.objects.count()
    document = {"tools": {"x.book": {"executor": {**mcp("desk", "book"), **extra}, "approval": "auto"}}}
    problem = assert_refused_field(load(upstream, document), f"tools.x.book.executor.{field}", "UNWIND_MCP_SERVERS")
    assert "is not taken from policy" in problem["detail"]
    assert Tool.objects.count() == before
    time.sleep(0.3)
    assert not marker.exists(), "no process may be started from policy"
    assert upstream.upstream.calls() == []


def test_an_executor_kind_that_is_a_command_is_refused(upstream, tmp_path):
    marker = tmp_path / "marker"
    document = {"tools": {"x.run": {"executor": {"kind": "stdio", "command": "/bin/sh", "args": ["-c", f"touch {marker}"]}}}}
    assert_refused_field(load(upstream, document), "tools.x.run.executor", "must be one of http, python, client, mcp")
    assert not marker.exists()


def test_settings_refuse_a_server_url_outside_the_allowed_origins(settings):
    settings.UNWIND_TOOL_ORIGINS = ["https://crm.example"]
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": "http://169.254.169.254/mcp"}}
    with pytest.raises(ImproperlyConfigured, match=r"UNWIND_MCP_SERVERS\['crm'\].url .* is not an allowed tool origin"):
        mcp_upstream.check_settings()
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": "https://crm.example/mcp", "command": "/bin/sh"}}
    with pytest.raises(ImproperlyConfigured, match="exactly one of url"):
        mcp_upstream.check_settings()
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": "https://crm.example/mcp", "protocol": "2025-06-18"}}
    with pytest.raises(ImproperlyConfigured, match=r"protocol must be one of auto, legacy, 2026-07-28"):
        mcp_upstream.check_settings()
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": "https://crm.example/mcp", "headers": {"Authorization": "Bearer t"}}}
    mcp_upstream.check_settings()


def test_the_servers_setting_is_a_json_object_or_a_clear_error(monkeypatch):
    from config.env import env_json_object

    monkeypatch.setenv("UNWIND_MCP_SERVERS", '{"crm": {"url": "https://crm.example/mcp"}}')
    assert env_json_object("UNWIND_MCP_SERVERS", {}) == {"crm": {"url": "https://crm.example/mcp"}}
    for text, words in (('["crm"]', "must be a JSON object, not list"), ("crm=https://x", "must be a JSON object:")):
        monkeypatch.setenv("UNWIND_MCP_SERVERS", text)
        with pytest.raises(ImproperlyConfigured, match=words):
            env_json_object("UNWIND_MCP_SERVERS", {})
    monkeypatch.delenv("UNWIND_MCP_SERVERS")
    assert env_json_object("UNWIND_MCP_SERVERS", {}) == {}


@pytest.mark.slow
def test_a_url_outside_the_allowed_origins_is_refused_before_connecting(upstream, settings):
    """The origin is checked again on every call: taken off UNWIND_TOOL_ORIGINS, the server is not reached."""
    assert load(upstream, policy("crm")).status_code == 200
    settings.UNWIND_TOOL_ORIGINS = []
    with pytest.raises(ToolError) as refused:
        mcp_call(endpoint="crm/book", args={"seat": "3C"}, idempotency_key="k1", timeout=5, tenant="acme")
    assert "is not an allowed tool origin" in refused.value.message
    assert refused.value.not_sent and not refused.value.transient and not refused.value.refused
    assert upstream.upstream.calls() == []


@pytest.mark.slow
def test_a_name_resolving_to_loopback_is_refused_at_connect_time(upstream, settings):
    """An allowed origin named by DNS may not lead to loopback (or private space) unless the deployer allows it:
    the connection itself is checked, not only the URL."""
    alias = next((name for name in ("vm", "runsc") if _resolves_to_loopback(name)), None)
    if alias is None:
        pytest.skip("no host name other than localhost resolves to loopback here (/etc/hosts)")
    port = upstream.upstream.port
    settings.UNWIND_TOOL_ORIGINS = [f"http://{alias}:{port}"]
    settings.UNWIND_MCP_SERVERS = {"crm": {"url": f"http://{alias}:{port}/mcp"}}
    with pytest.raises(ToolError) as refused:
        mcp_call(endpoint="crm/book", args={"seat": "3C"}, idempotency_key="k1", timeout=5, tenant="acme")
    assert "an address tools may not be reached at" in refused.value.message, refused.value.message
    assert refused.value.not_sent and not refused.value.transient
    assert upstream.upstream.calls() == []

    settings.UNWIND_TOOL_PRIVATE_NETWORKS = ["127.0.0.0/8"]
    outcome = mcp_call(endpoint="crm/book", args={"seat": "3C"}, idempotency_key="k2", timeout=10, tenant="acme")
    assert outcome.result == {"booking_id": "bk-3C", "seat": "3C"}


@pytest.mark.slow
def test_every_connection_is_checked_not_only_the_configured_url(upstream, settings):
    """The MCP client's connections go through GuardedBackend: one to a host and port outside the allowed origins
    (where a redirect or a second URL could lead) is refused before it is opened."""
    import anyio

    backend = mcp_upstream.GuardedBackend()
    with pytest.raises(Exception, match="is not an allowed tool origin"):
        anyio.run(backend.connect_tcp, "127.0.0.1", upstream.upstream.port + 1 if upstream.upstream.port < 65535 else 1)
    assert "is not an allowed tool origin" in backend.refused

    allowed = mcp_upstream.GuardedBackend()

    async def connect_and_close():
        stream = await allowed.connect_tcp("127.0.0.1", upstream.upstream.port)
        await stream.aclose()

    anyio.run(connect_and_close)
    assert allowed.refused is None


def _resolves_to_loopback(name: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") for info in socket.getaddrinfo(name, 80))
    except OSError:
        return False


# --- import_mcp_tools ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_import_mcp_tools_writes_a_proposal_that_loads_after_review_and_needs_approval(upstream, tmp_path):
    out = tmp_path / "crm.yaml"
    tools_before = Tool.objects.count()
    call_command("import_mcp_tools", "crm", tenant="acme", out=str(out))
    assert Tool.objects.count() == tools_before, "the import never writes policy to the database"
    text = out.read_text()
    proposal = yaml.safe_load(text)
    assert proposal["tenant"] == "acme"
    tools = proposal["tools"]
    assert set(tools) == {"crm.book", "crm.cancel", "crm.charge", "crm.slow", "crm.big", "crm.free_seats"}
    assert all(spec["approval"] == "manual" for spec in tools.values())
    assert tools["crm.book"]["executor"] == mcp("crm", "book")
    assert tools["crm.book"]["description"] == "Book a seat on the flight."
    assert tools["crm.book"]["args_schema"]["properties"]["seat"]["type"] == "string"
    assert tools["crm.free_seats"]["action_class"] == "read_only"
    assert "action_class" not in tools["crm.charge"] and "saga_role" not in tools["crm.charge"]
    assert "# upstream annotations: destructiveHint=true" in text
    assert "# saga_role: compensatable" in text and "# compensation: {strategy: twin" in text

    # A person reviews it: the booking is undone by the upstream's cancel, the charge is the pivot.
    tools["crm.book"]["compensation"] = {"strategy": "twin", "tool": "crm.cancel",
                                         "args": {"booking_id": "$result.booking_id"}}
    tools["crm.charge"]["saga_role"] = "pivot"
    out.write_text(yaml.safe_dump(proposal))
    call_command("load_tools", str(out), tenant="acme")
    book = Tool.objects.get(tenant=upstream.acme, name="crm.book", is_current=True)
    assert (book.executor, book.endpoint, book.approval) == ("mcp", "crm/book", "manual")

    client = agent(upstream)
    run_id = open_run(client)
    proposed = propose(client, run_id, "crm.book", {"seat": "3C"})
    assert proposed.status_code == 202 and proposed.json()["status"] == "awaiting_approval", proposed.text
    assert upstream.upstream.calls() == [], "nothing reaches the upstream before a person approves"


def test_import_mcp_tools_refuses_an_undeclared_server_and_an_existing_file(upstream, tmp_path):
    with pytest.raises(CommandError, match="not a declared MCP server"):
        call_command("import_mcp_tools", "elsewhere", tenant="acme")
    existing = tmp_path / "reviewed.yaml"
    existing.write_text("tools: {}\n")
    with pytest.raises(CommandError, match="never overwrites"):
        call_command("import_mcp_tools", "crm", tenant="acme", out=str(existing))
    assert existing.read_text() == "tools: {}\n"
