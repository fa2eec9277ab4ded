"""OpenTelemetry traces: the agent's trace, through Unwind, to the tool (docs/observability.md).

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER`) is
set; then the SDK is configured once per process (`setup`, from the ledger app's `ready`, so web and workers alike)
from the standard `OTEL_*` variables: service name and resource attributes, sampler, exporter headers and timeout,
and the batch processor's queue (`OTEL_BSP_*`). Spans leave in the batch processor's thread: a dead collector fills
a bounded queue (spans past it are dropped) and costs a log line, never a failed or blocked step. Off, every hook
here is one test of a module global.

What joins the agent's trace: the W3C `traceparent`/`tracestate`/`baggage` of a REST request (headers) or of an MCP
`tools/call` (`params._meta`, which wins over the headers). The proposing request's span context is stored with
the action (`Action.trace_context`), so a step a worker executes later is a *child* of that request span, in the
agent's trace; a compensation is a child of the same request span (the forward step's context) with a *link* to
the `execute_tool` span of the attempt it undoes. That link needs no stored span id: an `execute_tool` span's id
is derived from its trace, its action and its attempt number (`step_span_id`), so the compensation computes it.

Arguments and results never go into spans, except the argument fields a deployer names in
`UNWIND_TRACE_ARG_FIELDS` (top-level fields of the step's arguments, as `unwind.args.<field>`). A request span is
named by its route; one whose path matched none, by its path with any token redacted (ledger/log_redaction.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import time

from django.conf import settings

from ledger.log_redaction import redact

log = logging.getLogger("unwind.tracing")

# Set by `setup` when tracing is on; None means every hook does nothing.
_tracer = None
# The span id the next span started in this context must take (see `_Ids`), and the ids a log line names.
_wanted_span_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("unwind_wanted_span_id", default=None)
_log_ids: contextvars.ContextVar[dict] = contextvars.ContextVar("unwind_log_ids", default={})
# The carrier `current_carrier` last made in this context, and the context it was made from.
_stored: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("unwind_stored_carrier", default=None)

# W3C bounds (traceparent is 55 characters; tracestate at most 32 members of 256; baggage 8192 bytes): anything
# longer from an agent is not trace context and is ignored.
CARRIER_LIMITS = {"traceparent": 128, "tracestate": 1024, "baggage": 8192}
TRACED_PATHS = ("/api/", "/mcp")
SWEEP = "unwind.sweep"  # the sweep's span: its counts are its int attributes (`task`)


def wanted(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def enabled() -> bool:
    return _tracer is not None


def setup() -> None:
    """Configure the SDK once per process, when the environment asks for traces."""
    global _tracer
    from ledger import events
    for event in EVENTS:  # always: each records nothing while tracing is off
        events.subscribe(event, _event_recorder(event))
    if _tracer is not None or not wanted():
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    from ledger.tracing_provider import make_provider, quiet_sweeps

    provider = make_provider(_wanted_span_id)
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",") if n.strip()]
    for name in names or ["otlp"]:
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name in ("otlp", "otlp_proto_http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()  # endpoint, headers, timeout, compression: OTEL_EXPORTER_OTLP_*
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not one Unwind ships (otlp, console): not exported", name)
            continue
        # A bounded queue (OTEL_BSP_MAX_QUEUE_SIZE, 2048) emptied by the processor's own thread: a step only appends.
        provider.add_span_processor(quiet_sweeps(BatchSpanProcessor(exporter), SWEEP))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("unwind")


# --- context in and out ---------------------------------------------------------------------------------------

def carrier_of(source) -> dict:
    """The W3C trace context fields of `source` (headers or an MCP `_meta`), strings within their bounds only."""
    if not isinstance(source, dict) and not hasattr(source, "get"):
        return {}
    found = {}
    for key, limit in CARRIER_LIMITS.items():
        value = source.get(key)
        if isinstance(value, str) and value and len(value) <= limit:
            found[key] = value
    return found


def request_carrier(request) -> dict:
    """`carrier_of` a Django request's headers, read from META (building `request.headers` parses every name)."""
    meta = request.META
    if "HTTP_TRACEPARENT" not in meta and "HTTP_BAGGAGE" not in meta:
        return {}
    return carrier_of({key: meta.get(name) for key, name in _META_NAMES})


_META_NAMES = tuple((key, "HTTP_" + key.upper()) for key in CARRIER_LIMITS)


class _Api:
    """The OpenTelemetry API names the hot paths use, imported once, when tracing is first used (off, never)."""

    def __init__(self):
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
        self.context, self.propagate, self.trace = context, propagate, trace
        self.Link, self.SpanContext, self.SpanKind, self.TraceFlags = Link, SpanContext, SpanKind, TraceFlags
        self.Status, self.StatusCode = Status, StatusCode
        self.sampled = TraceFlags(TraceFlags.SAMPLED)


_O: _Api | None = None


def _api() -> _Api:
    global _O
    if _O is None:
        _O = _Api()
    return _O


def _extract(carrier: dict):
    return _api().propagate.extract(carrier)


def current_carrier() -> dict:
    """The current span's context as W3C fields, to store with an action ({} when tracing is off). The context it
    came from is kept beside it, so that the step executed next in this request needs not parse it again."""
    if _tracer is None:
        return {}
    o = _api()
    carrier: dict = {}
    o.propagate.inject(carrier)
    _stored.set((carrier, o.context.get_current()))
    return carrier


def _context_of(carrier: dict):
    """The context a stored carrier names: the one it was made from in this request, else parsed."""
    stored = _stored.get()
    if stored is not None and stored[0] == carrier:
        return stored[1]
    return _extract(carrier)


def inject(headers: dict) -> None:
    """Add `traceparent` (and `tracestate`, `baggage`) of the current span to an outgoing call's headers."""
    if _tracer is not None:
        _api().propagate.inject(headers)


# --- spans ----------------------------------------------------------------------------------------------------

def _fail(span, kind: str, description: str = "") -> None:
    o = _api()
    span.set_attribute("error.type", kind)
    span.set_status(o.Status(o.StatusCode.ERROR, description or kind))


def _open(name: str, parent=None, attributes=None, links=None, kind=None):
    """Start a span, child of `parent` (a context; None: the current one), and make it current: (span, token).
    What `start_as_current_span` does, without its generator and decorator layers, on every step's path."""
    o = _api()
    span = _tracer.start_span(name, context=parent, kind=kind or o.SpanKind.INTERNAL, attributes=attributes,
                              links=links, record_exception=False, set_status_on_exception=False)
    return span, o.context.attach(o.trace.set_span_in_context(span))


def _close(span, token) -> None:
    _api().context.detach(token)
    span.end()


def _span_context(parent):
    return _api().trace.get_current_span(parent).get_span_context()


def _arg_fields():
    return getattr(settings, "UNWIND_TRACE_ARG_FIELDS", ())


class TraceMiddleware:
    """A SERVER span per API and MCP request, child of the request's `traceparent` (when it has one)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if _tracer is None or not request.path.startswith(TRACED_PATHS):
            return self.get_response(request)
        carrier = request_carrier(request)
        # Named by its method until the route is known (HTTP's semantic conventions name a span without a route so),
        # then by its route; a path that matched no route names it by the path, with any token in it (an approval
        # link pasted under /api/, say) redacted as in the logs. Redacting only then spares routed requests the
        # expressions (the middleware in a loop: 31.6 → 25.6 µs a call, docs/history.md).
        span, token = _open(request.method, _extract(carrier) if carrier else None,
                            {"http.request.method": request.method}, kind=_api().SpanKind.SERVER)
        try:
            response = self.get_response(request)
            match = getattr(request, "resolver_match", None)
            if match is not None and match.route:
                span.update_name(f"{request.method} /{match.route}")
                span.set_attributes({"http.route": "/" + match.route,
                                     "http.response.status_code": response.status_code})
            else:
                span.update_name(f"{request.method} {redact(request.path)}")
                span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                problem = getattr(response, "data", None)
                code = problem.get("code") if isinstance(problem, dict) and isinstance(problem.get("code"), str) \
                    else f"http_{response.status_code}"
                span.add_event("unwind.problem", {"unwind.problem.type": f"urn:unwind:problem:{code}"})
                _fail(span, f"urn:unwind:problem:{code}")
            return response
        except BaseException as error:
            _fail(span, type(error).__name__)
            raise
        finally:
            _close(span, token)


@contextlib.contextmanager
def mcp_call(meta, tool_name):
    """A span for one MCP `tools/call`: its parent is the `_meta` trace context when the call carries one (it wins
    over the HTTP headers, whose request span it links to), else the request span."""
    if _tracer is None:
        yield
        return
    carrier = carrier_of(meta if isinstance(meta, dict) else {})
    request_span = _span_context(None)
    parent = _extract(carrier) if "traceparent" in carrier else None
    if parent is not None and not _span_context(parent).is_valid:
        parent = None  # not W3C trace context: the request's (its headers') context stands
    links = [_api().Link(request_span)] if parent is not None and request_span.is_valid else None
    name = tool_name if isinstance(tool_name, str) else ""
    span, token = _open(f"tools/call {name[:100]}", parent,
                        {"mcp.method.name": "tools/call", "gen_ai.tool.name": name[:200]}, links)
    try:
        yield
    except BaseException as error:
        _fail(span, type(error).__name__)
        raise
    finally:
        _close(span, token)


def step_span_id(trace_id: int, action_id: int, attempt: int) -> int:
    digest = hashlib.sha256(f"{trace_id:032x}/{action_id}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


class _Step:
    """The `execute_tool` span of one attempt of a step; `again` ends it and starts the next attempt's, `ended` gives
    it the step as the attempt left it (its recorded status is the span's `unwind.outcome`)."""

    __slots__ = ("action", "span", "parent", "links", "_token", "_ids", "_ended")

    def __init__(self, action):
        self.action = action
        self.span = None
        self.parent = None
        self.links = None
        self._ended = None

    def __enter__(self):
        action = self.action
        carrier = action.trace_context or None
        if action.kind != "forward" and action.compensates_id:
            forward = _forward_of(action)
            if forward is not None:
                carrier = forward[0] or carrier
                undone = _span_context(_extract(carrier)) if carrier else None
                if undone is not None and undone.is_valid:
                    o = _api()
                    undone_id = step_span_id(undone.trace_id, action.compensates_id, forward[1])
                    self.links = [o.Link(o.SpanContext(undone.trace_id, undone_id, is_remote=True,
                                                       trace_flags=o.sampled), {"unwind.link": "undoes"})]
        self.parent = _context_of(carrier) if carrier else None
        self._start()
        return self

    def _start(self):
        action = self.action
        tool = action.tool.name
        attributes = {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": str(action.idempotency_key), "gen_ai.tool.type": "function",
            "unwind.run.id": action.run_id, "unwind.action.id": action.pk, "unwind.action.kind": action.kind,
            "unwind.saga.role": action.saga_role or "", "unwind.risk": action.risk or "",
            "unwind.attempt": action.attempts,
        }
        if action.compensates_id:
            attributes["unwind.compensates.action.id"] = action.compensates_id
        if _arg_fields():
            attributes.update(allowed_args(action.args))
        if self.parent is not None:
            trace_id = _span_context(self.parent).trace_id
            if trace_id:
                _wanted_span_id.set(step_span_id(trace_id, action.pk, action.attempts))
        self.span, self._token = _open(f"execute_tool {tool}", self.parent, attributes, self.links)
        _wanted_span_id.set(None)
        self._ids = _log_ids.set({"run_id": action.run_id, "action_id": action.pk})

    def _end(self, outcome: str, error_class: str = ""):
        span = self.span
        span.set_attribute("unwind.outcome", outcome)
        if error_class:
            _fail(span, error_class)
        _log_ids.reset(self._ids)
        _close(span, self._token)

    def again(self):
        """An inline retry: this attempt failed transiently; the next one gets its own span."""
        self._end("retry", self.action.error_class or "transient")
        self._start()

    def ended(self, action):
        """The step as this attempt leaves it, as `execute` returns it (possibly read again): returns it."""
        self._ended = action
        return action

    def __exit__(self, kind, value, traceback):
        if kind is not None:
            self._end("error", kind.__name__)
            return False
        action = self._ended if self._ended is not None else self.action
        failed = action.status in ("failed", "lost", "compensation_failed")
        self._end(action.status, (action.error_class or action.status) if failed else "")
        return False


def _forward_of(compensation):
    """(trace context, attempts) of the step a compensation undoes: the unwinder's claim has it loaded."""
    from ledger.models import Action
    if Action.compensates.is_cached(compensation) and compensation.compensates is not None:
        return compensation.compensates.trace_context, compensation.compensates.attempts
    return Action.objects.filter(pk=compensation.compensates_id).values_list("trace_context", "attempts").first()


class _Off:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def again(self):
        pass

    def ended(self, action):
        return action


_OFF = _Off()


def step(action):
    """`with tracing.step(action) as attempt:` around executing a claimed step; `attempt.again()` before an inline
    retry, `return attempt.ended(action)` with the step as it ends."""
    return _OFF if _tracer is None else _Step(action)


@contextlib.contextmanager
def span(name: str, **attributes):
    """A span of the engine's own work (the sweep, a worker's task); yields it (None when off)."""
    if _tracer is None:
        yield None
        return
    current, token = _open(name, None, {k: v for k, v in attributes.items() if v is not None})
    try:
        yield current
    except Exception as error:
        _fail(current, type(error).__name__)
        raise
    finally:
        _close(current, token)


def task(name: str, id_attribute: str | None = None):
    """A span per worker task (a claim taken, an unwind, a sweep), named `name`, its first argument as
    `id_attribute`; a dict result (the sweep's counts) becomes `unwind.<key>` attributes."""
    def wrap(function):
        @functools.wraps(function)
        def traced(*args, **kwargs):
            if _tracer is None:
                return function(*args, **kwargs)
            with span(name, **({id_attribute: args[0]} if id_attribute and args else {})) as current:
                result = function(*args, **kwargs)
                if isinstance(result, dict):
                    current.set_attributes({f"unwind.{k}": v for k, v in result.items() if isinstance(v, int)})
                else:
                    current.set_attribute("unwind.outcome", str(result))
                return result
        return traced
    return wrap


def allowed_args(args) -> dict:
    fields = _arg_fields()
    if not fields or not isinstance(args, dict):
        return {}
    shown = {}
    for field in fields:
        value = args.get(field)
        if isinstance(value, (str, bool, int, float)):
            shown[f"unwind.args.{field}"] = value if not isinstance(value, str) else value[:256]
    return shown


EVENTS = ("approval_required", "approval_withdrawn", "run_needs_attention", "run_attention_cleared",
          "compensation_failed")
_recorders: dict = {}


def _event_recorder(event: str):
    """Engine events (approval waits, recovery items and drift, failed compensations) as events of the current span
    (one recorder per event, so that subscribing again adds nothing)."""
    if event in _recorders:
        return _recorders[event]

    def record(**payload):
        if _tracer is None:
            return
        current = _api().trace.get_current_span()
        if not current.is_recording():
            return
        attributes = {}
        action = payload.get("action")
        run = payload.get("run")
        if action is not None:
            attributes["unwind.action.id"] = action.pk
            attributes["unwind.run.id"] = action.run_id
        elif run is not None:
            attributes["unwind.run.id"] = run.pk
        for key in ("reason", "resolution"):
            if isinstance(payload.get(key), str):
                attributes[f"unwind.{key}"] = payload[key]
        current.add_event(f"unwind.{event}", attributes)
    _recorders[event] = record
    return record


# --- logs -----------------------------------------------------------------------------------------------------

class JsonFormatter(logging.Formatter):
    """One JSON object per line, naming the trace, span, run and action the line was written in."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if _tracer is not None:
            from opentelemetry import trace
            context = trace.get_current_span().get_span_context()
            if context.is_valid:
                line["trace_id"] = f"{context.trace_id:032x}"
                line["span_id"] = f"{context.span_id:016x}"
        line.update(_log_ids.get())
        if record.exc_info:
            line["exception"] = record.exc_info[0].__name__ if record.exc_info[0] else ""
        return json.dumps(line, default=str)
