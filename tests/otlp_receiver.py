"""A loopback OTLP/HTTP trace receiver for tests: decodes each ExportTraceServiceRequest (opentelemetry-proto) and
keeps its spans as plain dicts (ids in hex, attributes as Python values)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, \
    ExportTraceServiceResponse

from tests.quick_server import QUICK_SHUTDOWN


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


class OtlpReceiver:
    def __init__(self):
        receiver = self
        self.spans: list[dict] = []
        self.raw: list[bytes] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                spans = []
                for resource_spans in request.resource_spans:
                    resource = _attributes(resource_spans.resource.attributes)
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            spans.append({
                                "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(), "kind": span.kind,
                                "attributes": _attributes(span.attributes), "resource": resource,
                                "events": [(e.name, _attributes(e.attributes)) for e in span.events],
                                "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                                "status": (span.status.code, span.status.message),
                                "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            })
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.raw.append(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def in_trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
