"""Web servers in processes of their own, on the test database, for tests that read what a real deployment does.

`Served("gunicorn", …)` runs the README's production command (gunicorn with four ASGI workers, DEBUG off);
`Served("runserver", …)` the development server (`make demo`'s). Either writes its stdout and stderr to `log`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.test_g05_crash_safety import database_url
from tests.test_serving import free_port

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


class Served:
    def __init__(self, kind: str, log: Path, *, workers: int = 4, **env: str):
        self.kind, self.log, self.workers, self.process = kind, log, workers, None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.env.update(DATABASE_URL=database_url(), PYTHONPATH=str(ROOT), UNWIND_BASE_URL=self.url,
                        UNWIND_TOOL_BASE_URL=self.url, UNWIND_SANDBOX="1", PYTHONUNBUFFERED="1",
                        DEBUG="1" if kind == "runserver" else "0", **env)

    def start(self) -> Served:
        if self.kind == "gunicorn":
            # The README's production command (docs/production.md, "The web server").
            command = [GUNICORN, "config.asgi", "-k", "config.http_worker.Worker", "-w", str(self.workers),
                       "-b", f"127.0.0.1:{self.port}", "--timeout", "60", "--graceful-timeout", "40"]
        else:
            command = [sys.executable, "manage.py", "runserver", f"127.0.0.1:{self.port}", "--noreload"]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, env=self.env, start_new_session=True, stdout=log,
                                            stderr=log)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        raise AssertionError(f"{self.kind} did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM to the process group (gunicorn stops its workers gracefully, exporters flush), then SIGKILL."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def read_until_closed(client: socket.socket) -> bytes:
    """Everything a server still sends on `client` until it closes the connection (a reset counts as closed; the
    socket's own timeout fails a server that keeps it open)."""
    received = b""
    try:
        while chunk := client.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received
