"""Fixtures for the wiring tests (issue 14, finding 4): a tool service on loopback and Unwind on a live server.

`ToolService` is a real HTTP server on 127.0.0.1 standing in for another ecosystem's tools: each path answers
what the test told it to, and every request it gets is recorded (path and JSON body), so a test sees exactly
what Unwind sent over the wire. Unwind itself runs on a live server and is driven with `requests`, as an agent
and an admin would.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tests.api_support import basic
from tests.conftest import World, seed_sandboxes
from tests.quick_server import QUICK_SHUTDOWN


class ToolService:
    def __init__(self):
        self.answers: dict[str, tuple[int, object]] = {}
        self.calls: list[tuple[str, object]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server hook's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                service.calls.append((self.path, json.loads(raw) if raw else None))
                status, body = service.answers.get(self.path, (404, {"detail": "no such tool"}))
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):  # noqa: N802 - a read-back or before-snapshot read; a list of answers is used in turn
                service.calls.append((self.path, None))
                answer = service.answers.get(self.path, (404, {"detail": "no such record"}))
                status, body = answer.pop(0) if isinstance(answer, list) and len(answer) > 1 else (
                    answer[0] if isinstance(answer, list) else answer)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: object, status: int = 200) -> str:
        """Make `path` answer `body` (JSON-encoded) with `status`; returns the full URL for a policy."""
        self.answers[path] = (status, body)
        return self.url + path

    def answer_in_turn(self, path: str, *answers: tuple[int, object]) -> str:
        """Make GET `path` answer each (status, body) once, in order, then the last one again."""
        self.answers[path] = list(answers)
        return self.url + path

    def calls_to(self, path: str) -> list:
        return [body for called, body in self.calls if called == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def tool_service(settings):
    service = ToolService()
    settings.UNWIND_TOOL_ORIGINS = [*settings.UNWIND_TOOL_ORIGINS, service.url]
    yield service
    service.close()


class Wired:
    """acme (and globex) with their personas, Unwind on a live server, and HTTP sessions for the agent and ada."""

    def __init__(self, world: World, base: str):
        self.world, self.base = world, base
        self.agent = self.session(f"Bearer {world.key}")
        self.admin = self.session(basic("ada"))

    @staticmethod
    def session(auth: str) -> requests.Session:
        s = requests.Session()
        s.headers["Authorization"] = auth
        return s

    def load(self, document: dict) -> requests.Response:
        return self.admin.post(f"{self.base}/api/v1/policy", json=document, timeout=30)

    def open_run(self, client: requests.Session | None = None) -> dict:
        answer = (client or self.agent).post(f"{self.base}/api/v1/runs", json={"goal": "wire"}, timeout=10)
        assert answer.status_code == 201, answer.text
        return answer.json()

    def propose(self, run_id: int, tool: str, args: dict, client: requests.Session | None = None):
        return (client or self.agent).post(f"{self.base}/api/v1/runs/{run_id}/actions",
                                           json={"tool": tool, "args": args}, timeout=30)

    def run(self, run_id: int) -> dict:
        return self.agent.get(f"{self.base}/api/v1/runs/{run_id}", timeout=10).json()


@pytest.fixture
def wired(transactional_db, live_server, settings, _engine_settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    settings.UNWIND_TOOL_BASE_URL = live_server.url
    world = World()
    seed_sandboxes(world)
    return Wired(world, live_server.url)
