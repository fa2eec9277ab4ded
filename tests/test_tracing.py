"""Traces in the team's own observability stack (issue 30): a live server and a worker, each a real process with a
real OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP/HTTP receiver in this test (tests/otlp_receiver.py)."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.db import connection

from ledger.models import Action, Run
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_cancel
from ledger.policy.versions import tool_upsert
from tests.conftest import World
from tests.helpers import act, open_run
from tests.otlp_receiver import OtlpReceiver
from tests.recorder import Recorder
from tests.test_mcp_proxy import upstream  # noqa: F401 (the fixture: a live Unwind and a declared upstream server)
from tests.test_settling import failpoint  # noqa: F401 (the fixture: arm one of the engine's failpoints)

ROOT = Path(__file__).resolve().parent.parent
SERVER = 2  # SpanKind SERVER in OTLP
live = [pytest.mark.slow, pytest.mark.skipif(
    connection.vendor == "sqlite" and ":memory:" in str(connection.settings_dict.get("NAME")),
    reason="server and worker processes need a database file or server")]


def database_url() -> str:
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    return f"postgres://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


class Processes:
    """A runserver and (optionally) a worker, sharing the test database and the environment given."""

    def __init__(self, env: dict, *, worker: bool):
        # A free port can be taken by another test run between our look and the server's bind (CI runs six side by
        # side): then the server exits saying so, and it is started again on another.
        for _ in range(3):
            if self._start(env, worker):
                return
            errors = self.stop()
            assert "That port is already in use" in errors, errors
        raise AssertionError("three free ports were each taken before the server could bind one")

    def _start(self, env: dict, worker: bool) -> bool:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "UNWIND_BASE_URL"))}
        self.env.update(DATABASE_URL=database_url(), UNWIND_TASKS_SYNC="0", UNWIND_SWEEP_INTERVAL="0.2",
                        UNWIND_WORKERS="1", PYTHONPATH=str(ROOT), UNWIND_TOOL_BASE_URL=self.url,
                        UNWIND_BASE_URL=self.url, OTEL_BSP_SCHEDULE_DELAY="100", **env)
        server = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                                  cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.started = [server]
        if worker:
            self.started.append(subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=ROOT, env=self.env,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

        def up_or_gone():
            if server.poll() is not None:
                return True
            try:
                return requests.get(self.url + "/healthz", timeout=1).status_code in (200, 503)
            except requests.RequestException:  # not listening yet, or someone else's server there
                return False
        assert wait_until(up_or_gone, 60), self.stop()
        return server.poll() is None

    def stop(self) -> str:
        """Stop them; the end of their stderr (all of it in `self.stderr`)."""
        errors, self.stderr = "", ""
        for process in self.started:
            process.send_signal(signal.SIGTERM)
            try:
                written = process.communicate(timeout=30)[1].decode()
            except subprocess.TimeoutExpired:
                process.kill()
                written = process.communicate()[1].decode()
            errors += written[-2000:]
            self.stderr += written
        return errors


@pytest.fixture
def traced(transactional_db, settings):
    world = World()
    recorder = Recorder()
    receiver = OtlpReceiver()
    spec = {"description": "Create a record.", "action_class": "internal_update", "saga_role": "compensatable",
            "risk": "low", "executor": {"kind": "http", "url": recorder.origin + "/create"},
            "idempotency": {"honours_key": True}, "retry": {"max_attempts": 3, "backoff": 5},
            "args_schema": {"type": "object", "properties": {"email": {"type": "string"}, "plan": {"type": "string"}}},
            "compensation": {"strategy": "twin", "tool": "rec.undo", "args": {"n": "$result.n"}}}
    undo = {"description": "Undo a record.", "action_class": "internal_update", "saga_role": "compensatable",
            "risk": "low", "executor": {"kind": "http", "url": recorder.origin + "/undo"},
            "idempotency": {"honours_key": True},
            "args_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    settings.UNWIND_TOOL_ORIGINS = [recorder.origin]
    tool_upsert(tenant=world.acme, name="rec.undo", spec=undo, actor="test")
    tool_upsert(tenant=world.acme, name="rec.create", spec=spec, actor="test")
    world.recorder, world.receiver = recorder, receiver
    world.origins = recorder.origin
    yield world
    recorder.close()
    receiver.close()


def agent(world, url, traceparent=None):
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    if traceparent:
        session.headers["traceparent"] = traceparent
    return session


@live[0]
@live[1]
def test_a_run_joins_the_agents_trace_from_the_request_to_the_tool_and_its_undo(traced):
    trace_id, agent_span = secrets.token_hex(16), secrets.token_hex(8)
    processes = Processes({"OTEL_EXPORTER_OTLP_ENDPOINT": traced.receiver.endpoint,
                           "UNWIND_TOOL_ORIGINS": traced.origins,
                           "UNWIND_TRACE_ARG_FIELDS": "plan", "OTEL_SERVICE_NAME": "unwind-under-test",
                           "UNWIND_LOG_FORMAT": "json"}, worker=True)
    try:
        api = agent(traced, processes.url, f"00-{trace_id}-{agent_span}-01")
        run = api.post(processes.url + "/api/v1/runs", json={"goal": "trace me", "on_behalf_of": "c@example.com"},
                       timeout=30).json()
        first = api.post(f"{processes.url}/api/v1/runs/{run['id']}/actions", timeout=30,
                         json={"tool": "rec.create", "args": {"email": "secret-one@example.com", "plan": "gold"}})
        assert first.status_code in (200, 201), first.content
        # The second step's first call is answered 503: its retry (2.5 to 5 s away, past an inline retry) is the
        # worker's, claimed by its sweep.
        traced.recorder.status = 503
        second = api.post(f"{processes.url}/api/v1/runs/{run['id']}/actions", timeout=30,
                          json={"tool": "rec.create", "args": {"email": "secret-two@example.com", "plan": "silver"}})
        traced.recorder.status = 200
        second_id = second.json()["id"]
        assert wait_until(lambda: Action.objects.get(pk=second_id).status == "succeeded", 60), processes.stop()
        cancel = api.post(f"{processes.url}/api/v1/runs/{run['id']}/cancel", json={"reason": "done"}, timeout=30)
        assert cancel.status_code in (200, 202), cancel.content
        assert wait_until(lambda: Run.objects.get(pk=run["id"]).status == "compensated", 60), processes.stop()

        def all_there():
            names = [s["name"] for s in traced.receiver.in_trace(trace_id)]
            return names.count("execute_tool rec.create") >= 3 and names.count("execute_tool rec.undo") >= 2
        assert wait_until(all_there, 30), [s["name"] for s in traced.receiver.spans]
    finally:
        errors = processes.stop()
    spans = traced.receiver.in_trace(trace_id)
    if os.environ.get("UNWIND_TRACE_DUMP"):  # the spans docs/observability.md draws (bench/waterfall.py)
        Path(os.environ["UNWIND_TRACE_DUMP"]).write_text(json.dumps(spans, indent=1))
    by_id = {s["span_id"]: s for s in spans}
    first_id = first.json()["id"]
    steps = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "execute_tool"]
    forward = {(s["attributes"]["unwind.action.id"], s["attributes"]["unwind.attempt"]): s for s in steps
               if s["attributes"]["unwind.action.kind"] == "forward"}
    # The inline step: a child of the REST request's span, itself a child of the agent's span.
    inline = forward[(first_id, 1)]
    request = by_id[inline["parent_span_id"]]
    assert request["kind"] == SERVER and request["parent_span_id"] == agent_span
    assert request["resource"]["service.name"] == "unwind-under-test"
    attributes = inline["attributes"]
    assert attributes["gen_ai.tool.name"] == "rec.create" and attributes["gen_ai.tool.call.id"]
    assert attributes["unwind.run.id"] == run["id"] and attributes["unwind.saga.role"] == "compensatable"
    assert attributes["unwind.risk"] == "low" and attributes["unwind.outcome"] == "succeeded"
    assert attributes["unwind.args.plan"] == "gold"  # the one field the deployer allowed
    # The step the worker retried, minutes later in production: attempt 2 in the same trace, under its request.
    retried = forward[(second_id, 2)]
    assert retried["attributes"]["unwind.outcome"] == "succeeded", [
        (s["attributes"]["unwind.attempt"], s["attributes"]["unwind.outcome"], s["span_id"], s["parent_span_id"])
        for s in steps if s["attributes"]["unwind.action.id"] == second_id]
    assert by_id[retried["parent_span_id"]]["kind"] == SERVER
    assert forward[(second_id, 1)]["attributes"]["unwind.outcome"] == "retry_scheduled"
    assert any(s["name"] == "unwind.worker execute_action" and s["attributes"].get("unwind.action.id") == second_id
               for s in traced.receiver.spans)
    # Each compensation is in the trace and linked to the execute_tool span of the attempt it undoes.
    undone = {s["attributes"]["unwind.compensates.action.id"]: s for s in steps
              if s["attributes"]["unwind.action.kind"] == "compensation"}
    assert undone[first_id]["links"] == [(trace_id, inline["span_id"])]
    assert undone[second_id]["links"] == [(trace_id, retried["span_id"])]
    assert undone[first_id]["attributes"]["unwind.outcome"] == "succeeded"
    # The tool received a traceparent naming the step's own span, in the agent's trace.
    parents = [h.get("traceparent") or h.get("Traceparent") for h in traced.recorder.headers]
    assert len(parents) == 5 and all(p and p.split("-")[1] == trace_id for p in parents), parents
    assert {p.split("-")[2] for p in parents} <= {s["span_id"] for s in steps}
    # No argument value is exported, but the one allowed.
    exported = b"".join(traced.receiver.raw)
    for value in (b"secret-one@example.com", b"secret-two@example.com", b"secret"):
        assert value not in exported
    assert "Traceback" not in errors, errors
    # JSON logs: the worker's sweep line names the trace and span of the sweep that wrote it.
    logged = [json.loads(line) for line in errors.splitlines() if line.startswith("{")]
    sweeps = {(s["trace_id"], s["span_id"]) for s in traced.receiver.spans if s["name"] == "unwind.sweep"}
    assert any(line["message"].startswith("sweep:") and (line.get("trace_id"), line.get("span_id")) in sweeps
               for line in logged), errors


@live[0]
@live[1]
def test_a_dead_collector_costs_no_step(traced):
    """No collector: steps answer as fast as ever, the spans past a (here tiny) bounded queue are dropped, and that
    costs a log line, not one per span."""
    dead = f"http://127.0.0.1:{free_port()}"
    processes = Processes({"OTEL_EXPORTER_OTLP_ENDPOINT": dead, "UNWIND_TOOL_ORIGINS": traced.origins,
                           "OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4"}, worker=False)
    errors = ""
    try:
        api = agent(traced, processes.url, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
        run = api.post(processes.url + "/api/v1/runs", json={"goal": "no collector", "on_behalf_of": "c@example.com"},
                       timeout=30).json()
        took = []
        for n in range(5):
            t0 = time.monotonic()
            answer = api.post(f"{processes.url}/api/v1/runs/{run['id']}/actions", timeout=30,
                              json={"tool": "rec.create", "args": {"email": f"n{n}@example.com"}})
            took.append(time.monotonic() - t0)
            assert answer.status_code in (200, 201), answer.content
            assert answer.json()["status"] == "succeeded"
            time.sleep(0.3)  # let the batch processor try (and fail) to export in between
        # Trace context is the agent's data: malformed or oversized, it is ignored, and the step runs as any other.
        junk = api.post(f"{processes.url}/api/v1/runs/{run['id']}/actions", timeout=30,
                        json={"tool": "rec.create", "args": {"email": "junk@example.com"}},
                        headers={"traceparent": "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "tracestate": "x" * 5000,
                                 "baggage": "k=" + "v" * 7000})
        assert junk.status_code in (200, 201) and junk.json()["status"] == "succeeded", junk.content
        assert Action.objects.get(pk=junk.json()["id"]).trace_context["traceparent"] != junk.request.headers[
            "traceparent"]
    finally:
        processes.stop()
    # An export in the request's path would wait out the exporter's retries (seconds each); the margin is a loaded
    # CI machine's.
    assert max(took) < 5.0, took
    # 7 requests made 13 spans; the exporter is stuck retrying its first batch of 4, the queue holds 4 more: the
    # rest are dropped, and the SDK says so in one line per 20 s (its DuplicateFilter), not one per span.
    assert 1 <= processes.stderr.count("Queue full, dropping Span") <= 2, processes.stderr[-3000:]


@live[0]
@live[1]
def test_an_mcp_tools_call_joins_the_trace_its_meta_names_over_the_headers(traced):
    from tests.test_mcp_gateway import initialized

    header_trace, meta_trace, meta_span = secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(8)
    processes = Processes({"OTEL_EXPORTER_OTLP_ENDPOINT": traced.receiver.endpoint,
                           "UNWIND_TOOL_ORIGINS": traced.origins}, worker=False)
    try:
        headers = initialized(processes.url + "/mcp", traced.key)
        headers["traceparent"] = f"00-{header_trace}-{secrets.token_hex(8)}-01"
        called = requests.post(processes.url + "/mcp", headers=headers, timeout=30, json={
            "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "rec.create", "arguments": {"email": "secret-mcp@example.com"},
                "_meta": {"traceparent": f"00-{meta_trace}-{meta_span}-01", "tracestate": "vendor=1"}}})
        assert called.status_code == 200 and not called.json()["result"].get("isError"), called.text
        # Trace context is the agent's data over MCP too: malformed or oversized, it is ignored (the headers' context
        # stands); a `_meta` that is not an object is refused as invalid params, and no step is proposed.
        not_an_object = requests.post(processes.url + "/mcp", headers=headers, timeout=30, json={
            "jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
                "name": "rec.create", "arguments": {"email": "junk@example.com"}, "_meta": "00-" + meta_trace}})
        assert not_an_object.status_code == 200 and not_an_object.json()["error"]["code"] == -32602
        assert not Action.objects.filter(args__email="junk@example.com").exists()
        junk_metas = [{"traceparent": "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "tracestate": "x" * 5000,
                       "baggage": "k=" + "v" * 7000}, {"traceparent": ["00", meta_trace]}]
        for n, junk in enumerate(junk_metas):
            answered = requests.post(processes.url + "/mcp", headers=headers, timeout=30, json={
                "jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": {
                    "name": "rec.create", "arguments": {"email": f"junk{n}@example.com"}, "_meta": junk}})
            assert answered.status_code == 200, answered.text
            assert not (answered.json().get("result") or {"isError": True}).get("isError"), answered.text
            step = Action.objects.get(args__email=f"junk{n}@example.com")
            assert step.status == "succeeded" and step.trace_context["traceparent"].split("-")[1] == header_trace
            assert "z" * 32 not in json.dumps(step.trace_context) and "x" * 100 not in json.dumps(step.trace_context)
        # A refused REST request (a tool the policy does not declare): its span says the problem, status error.
        refused_trace = secrets.token_hex(16)
        api = agent(traced, processes.url, f"00-{refused_trace}-{secrets.token_hex(8)}-01")
        run = api.post(processes.url + "/api/v1/runs", json={"goal": "refused", "on_behalf_of": "c@example.com"},
                       timeout=30).json()
        refused = api.post(f"{processes.url}/api/v1/runs/{run['id']}/actions", timeout=30,
                           json={"tool": "nobody.declared", "args": {"email": "secret-refused@example.com"}})
        assert refused.status_code in (400, 404, 422), refused.text

        # The step's span ends first and the call's and the request's after it: each may come in a later batch.
        def all_there():
            names = {s["name"] for s in traced.receiver.in_trace(meta_trace)}
            request = [s for s in traced.receiver.in_trace(header_trace) if s["kind"] == SERVER]
            return {"execute_tool rec.create", "tools/call rec.create"} <= names and bool(request) and len(
                [s for s in traced.receiver.in_trace(refused_trace) if s["kind"] == SERVER]) == 2
        assert wait_until(all_there, 30), traced.receiver.spans
    finally:
        processes.stop()
    spans = traced.receiver.in_trace(meta_trace)
    call = next(s for s in spans if s["name"] == "tools/call rec.create")
    step = next(s for s in spans if s["name"] == "execute_tool rec.create")
    assert call["parent_span_id"] == meta_span and step["parent_span_id"] == call["span_id"]
    request = next(s for s in traced.receiver.in_trace(header_trace) if s["kind"] == SERVER)
    assert call["links"] == [(header_trace, request["span_id"])]
    tool_got = traced.recorder.headers[0]  # the first call, with the `_meta` context
    assert (tool_got.get("traceparent") or tool_got.get("Traceparent")).split("-")[1] == meta_trace
    assert b"secret-mcp" not in b"".join(traced.receiver.raw) and b"secret-refused" not in b"".join(traced.receiver.raw)
    problem = refused.json()["type"]
    span = next(s for s in traced.receiver.in_trace(refused_trace)
                if s["kind"] == SERVER and s["attributes"].get("http.response.status_code") == refused.status_code)
    assert span["status"] == (2, problem) and span["attributes"]["error.type"] == problem  # 2: STATUS_CODE_ERROR
    assert span["events"] == [("unwind.problem", {"unwind.problem.type": problem})]


def test_json_log_lines_name_the_trace_span_run_and_action(monkeypatch):
    import logging

    from opentelemetry.sdk.trace import TracerProvider

    from ledger import tracing

    monkeypatch.setattr(tracing, "_tracer", TracerProvider().get_tracer("test"))
    record = logging.LogRecord("unwind.engine", logging.WARNING, __file__, 1, "settling %s", ("step",), None)
    with tracing._tracer.start_as_current_span("execute_tool x") as span:
        token = tracing._log_ids.set({"run_id": 7, "action_id": 9})
        try:
            line = json.loads(tracing.JsonFormatter().format(record))
        finally:
            tracing._log_ids.reset(token)
    context = span.get_span_context()
    assert line["trace_id"] == f"{context.trace_id:032x}" and line["span_id"] == f"{context.span_id:016x}"
    assert (line["run_id"], line["action_id"], line["message"], line["level"]) == (7, 9, "settling step", "WARNING")


def test_the_client_sends_the_callers_trace_context():
    from opentelemetry.sdk.trace import TracerProvider

    from unwind_client.client import Unwind

    recorder = Recorder()
    try:
        client = Unwind(recorder.origin, api_key="uw_test")
        with TracerProvider().get_tracer("agent").start_as_current_span("agent turn") as span:
            client.request("POST", "/anything", json={"x": 1})
        client.request("POST", "/anything", json={"x": 2})
    finally:
        recorder.close()
    context = span.get_span_context()
    inside, outside = recorder.headers
    assert inside["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert "traceparent" not in outside


def test_an_upstream_mcp_tool_gets_the_steps_trace_context_in_meta(upstream, monkeypatch):
    """The MCP SDK's client puts the current W3C context in the `_meta` of each call (the keys MCP reserves for it):
    Unwind adds nothing of its own, and this shows it reaches the upstream from a step's span."""
    from opentelemetry.sdk.trace import TracerProvider

    from ledger.executors import call as executors
    from ledger import tracing

    monkeypatch.setattr(tracing, "_tracer", TracerProvider().get_tracer("test"))
    with tracing._tracer.start_as_current_span("execute_tool seats.book") as span:
        executors.mcp_call(endpoint="crm/book", args={"seat": "7C"}, idempotency_key="k-7c", timeout=10,
                           tenant="acme")
    context = span.get_span_context()
    sent = upstream.upstream.calls("book")[-1]
    assert sent["key"] == "k-7c"
    assert sent["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")


# --- in process: the spans of each outcome, against what the ledger recorded -----------------------------------

@pytest.fixture
def collected(monkeypatch):
    """Tracing on in this process, as `setup` configures it, its spans kept in memory as they end."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ledger import tracing
    from ledger.tracing_provider import make_provider, quiet_sweeps

    exporter = InMemorySpanExporter()
    provider = make_provider(tracing._wanted_span_id)
    provider.add_span_processor(quiet_sweeps(SimpleSpanProcessor(exporter), tracing.SWEEP))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def step_spans(exporter) -> dict:
    """{(action id, attempt): the execute_tool span} of what was collected."""
    return {(s.attributes["unwind.action.id"], s.attributes["unwind.attempt"]): s for s in exporter.get_finished_spans()
            if s.attributes.get("gen_ai.operation.name") == "execute_tool"}


def test_each_attempts_outcome_is_the_status_the_ledger_recorded(tools, collected, failpoint):
    """ok, retried inline, refused (failed), undone (two compensations), and unknown (lost): the span of each
    step's last attempt says the status its action has in the database; a failed or lost one has status error."""
    from opentelemetry.trace import StatusCode

    from tests.helpers import fault

    run = open_run(tools)
    user = act(run, "hr.create_user", {"email": "trace@example.com", "name": "T"})
    fault("licenses.provision", "status", status=503, times=1)
    licence = act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("travel.book_flight", "status", status=422, times=1)
    flight = act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2027-01-01"})
    assert (user.status, licence.status, flight.status, licence.attempts) == ("succeeded", "succeeded", "failed", 2)
    assert run_cancel(run=run, actor="agent:booker", reason="undo it").status == "compensated"
    unknown_run = open_run(tools)
    fault("email.send", "error_after_effect", status=500, times=1)
    failpoint("settle_read_back")
    email = act(unknown_run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    assert email.status == "lost"

    spans = step_spans(collected)
    actions = list(Action.objects.filter(run__in=[run, unknown_run]))
    assert {a.kind for a in actions} == {"forward", "compensation"}
    assert len([a for a in actions if a.kind == "compensation"]) == 2
    for action in actions:
        last = spans[(action.pk, action.attempts)]
        recorded = "succeeded" if action.status == "compensated" else action.status  # then undone, later
        assert last.attributes["unwind.outcome"] == recorded, (action.kind, action.status, last.attributes)
        if action.status in ("failed", "lost"):
            assert last.status.status_code == StatusCode.ERROR
            assert last.attributes["error.type"] == action.error_class and action.error_class
        else:
            assert last.status.status_code == StatusCode.UNSET
    # The run waiting for a person (the lost step) is an event of that step's span, with the reason.
    lost = spans[(email.pk, email.attempts)]
    assert ("unwind.run_needs_attention", "settle_failed", email.pk) in [
        (e.name, e.attributes.get("unwind.reason"), e.attributes.get("unwind.action.id")) for e in lost.events]
    first_try = spans[(licence.pk, 1)]
    assert first_try.attributes["unwind.outcome"] == "retry" and first_try.status.status_code == StatusCode.ERROR
    # Each compensation is linked to the span of the attempt it undoes (here none had a trace to join: roots).
    for compensation in (a for a in actions if a.kind == "compensation"):
        undone = Action.objects.get(pk=compensation.compensates_id)
        assert spans[(compensation.pk, compensation.attempts)].attributes["unwind.compensates.action.id"] == undone.pk


def test_a_sweep_that_found_nothing_sends_no_span(tools, collected, django_capture_on_commit_callbacks):
    """An idle sweep's span is dropped before export; a sweep that claims a due retry is kept, with its counts."""
    from datetime import timedelta

    from django.utils import timezone

    from ledger.engine.sweep import sweep
    from tests.helpers import fault

    with django_capture_on_commit_callbacks(execute=True):
        assert not any(sweep().values())
    assert not [s for s in collected.get_finished_spans() if s.name == "unwind.sweep"]
    run = open_run(tools)
    fault("licenses.provision", "status", status=503, times=1)
    proposal = action_propose(run=run, tool_name="licenses.provision", args={"user_id": "u-1"}, actor="agent:booker")
    Action.objects.filter(pk=proposal.action.pk).update(status="retry_scheduled", lease_owner="",
                                                        lease_expires_at=None,
                                                        next_attempt_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["retried"] == 1
    kept = [s for s in collected.get_finished_spans() if s.name == "unwind.sweep"]
    assert len(kept) == 1 and kept[0].attributes["unwind.retried"] == 1


def test_an_approval_wait_is_an_event_of_the_proposing_requests_span(tools, collected):
    from ledger import tracing

    run = open_run(tools)
    with tracing.span("POST /api/v1/runs/{run_id}/actions") as request:
        proposal = action_propose(run=run, tool_name="payments.charge", actor="agent:booker",
                                  args={"customer": "c-1", "amount_cents": 5000, "currency": "EUR"})
    assert proposal.action.status == "awaiting_approval"
    assert [(e.name, e.attributes["unwind.action.id"]) for e in request.events] == [
        ("unwind.approval_required", proposal.action.pk)]


def test_a_request_span_is_named_by_its_method_then_by_its_route_or_its_redacted_path(monkeypatch, client):
    """The SERVER span starts named by its method alone, so a processor or a sampler never sees the path; once the
    request is answered it is named by the route it matched, else by its path with any secret in it redacted (an
    agent key pasted into a URL under /api/ stays out of the trace)."""
    from opentelemetry.sdk.trace import SpanProcessor

    from ledger import tracing
    from ledger.tracing_provider import make_provider

    started, ended = [], []

    class Watch(SpanProcessor):
        def on_start(self, span, parent_context=None):
            started.append(span.name)

        def on_end(self, span):
            ended.append(span.name)

    provider = make_provider(tracing._wanted_span_id)
    provider.add_span_processor(Watch())
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    client.get("/api/v1/nowhere/uw_0123456789ab_s3cretpart", HTTP_TRACEPARENT=f"00-{'a' * 32}-{'d' * 16}-01")
    client.get("/api/v1/runs/12345", HTTP_TRACEPARENT=f"00-{'a' * 32}-{'e' * 16}-01")
    provider.shutdown()
    assert started == ["GET", "GET"], started
    assert ended == ["GET /api/v1/nowhere/uw_0123456789ab_[redacted]", "GET /api/v1/runs/<id:run_id>"], ended


def test_an_agents_baggage_goes_nowhere(collected):
    """Trace context only picks the parent of Unwind's spans (SECURITY.md): the agent's `baggage` header is not kept
    in the request's context, so a step proposed in it neither stores it nor sends it on to a tool; each span is the
    child of its own headers' span."""
    from django.http import HttpResponse
    from django.test import RequestFactory
    from opentelemetry import baggage, trace

    from ledger import tracing

    first, second = f"00-{'1' * 32}-{'2' * 16}-01", f"00-{'3' * 32}-{'4' * 16}-01"
    seen = []

    def view(request):
        outgoing = {}
        tracing.inject(outgoing)  # what a call to a tool would carry
        seen.append((trace.get_current_span().get_span_context().trace_id, dict(baggage.get_all()),
                     tracing.current_carrier(), outgoing))
        return HttpResponse()

    middleware = tracing.TraceMiddleware(view)
    factory = RequestFactory()
    middleware(factory.get("/api/v1/runs", HTTP_TRACEPARENT=first, HTTP_BAGGAGE="tenant=globex,role=admin"))
    middleware(factory.get("/api/v1/runs", HTTP_TRACEPARENT=second))
    assert [(trace_id, found) for trace_id, found, _, _ in seen] == [(int("1" * 32, 16), {}), (int("3" * 32, 16), {})]
    for _, _, stored, outgoing in seen:
        assert set(stored) == {"traceparent"} and set(outgoing) == {"traceparent"}, (stored, outgoing)
    parents = [s.parent.span_id for s in collected.get_finished_spans() if s.kind.name == "SERVER"]
    assert parents == [int("2" * 16, 16), int("4" * 16, 16)]
