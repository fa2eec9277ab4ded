"""A loopback HTTP tool for tests that must see exactly what Unwind sent: every request's raw body is kept.

It answers each POST with `status` and a small JSON body, after `delay` seconds (to hold a call in flight).
Register it as an HTTP tool with its origin allowed (`settings.UNWIND_TOOL_ORIGINS = [recorder.origin]`).
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.quick_server import QUICK_SHUTDOWN


class Recorder:
    def __init__(self, *, status: int = 200, delay: float = 0.0):
        recorder = self
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        self.status = status
        self.delay = delay
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with recorder._lock:
                    recorder.bodies.append(body)
                    recorder.paths.append(self.path)
                    recorder.headers.append(dict(self.headers))
                time.sleep(recorder.delay)
                answer = b'{"ok": true, "n": %d}' % len(recorder.bodies)
                self.send_response(recorder.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def received(self, path: str) -> list[bytes]:
        return [body for body, where in zip(self.bodies, self.paths) if where == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder(settings):
    """A started Recorder whose origin Unwind may call."""
    started = Recorder()
    settings.UNWIND_TOOL_ORIGINS = [started.origin]
    yield started
    started.close()
