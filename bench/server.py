"""A real multi-process server for the HTTP parts: gunicorn on the bench database, stopped by its group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests

from bench.common import DATABASE_URL, ROOT, bench_env, log


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`root`: the checkout to serve (bench/ab.py serves two revisions side by side); `database_url`: its database.
    A free port unless one is named, so two benchmarks on one machine (CI's smoke beside a full run) never meet.
    `production`: docs/production.md's command (uvicorn's ASGI worker on config.asgi, a connection pool of 20)
    instead of the sync WSGI workers the parts and bench/ab.py have always compared on."""

    def __init__(self, *, port: int | None = None, workers: int = 4, threads: int = 1, root=ROOT,
                 database_url: str = DATABASE_URL, env: dict | None = None, production: bool = False):
        self.port, self.workers, self.threads = port or free_port(), workers, threads
        self.production = production
        self.root, self.database_url, self.extra_env = root, database_url, env or {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self):
        gunicorn = os.path.join(os.path.dirname(sys.executable), "gunicorn")
        settings = dict(
            DJANGO_SETTINGS_MODULE="bench.settings",
            # Persistent connections, as a production deployment runs: no connect per request.
            DATABASE_URL=f"{self.database_url}?conn_max_age=60",
            # Both endpoints pass the throttle check; the rate only has to be out of the way.
            UNWIND_THROTTLE_RATE="10000000/min",
            UNWIND_TASKS_SYNC="0",
            PYTHONPATH=str(self.root),
        )
        if self.production:  # docs/production.env's pool, not persistent connections
            settings.update(DATABASE_URL=self.database_url, UNWIND_DB_POOL="20")
        env = bench_env(**{**settings, **self.extra_env})
        app = ["config.asgi", "-k", "config.http_worker.Worker"] if self.production else ["config.wsgi:application"]
        args = [gunicorn, *app, "-b", f"127.0.0.1:{self.port}", "-w", str(self.workers),
                "--log-level", "warning", "--timeout", "60"]
        if self.threads > 1 and not self.production:
            args += ["--worker-class", "gthread", "--threads", str(self.threads)]
        self.process = subprocess.Popen(args, cwd=str(self.root), env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if requests.get(f"{self.url}/healthz", timeout=2).status_code < 500:
                    log(f"gunicorn up at {self.url}: {self.describe}")
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError("gunicorn did not answer /healthz within 60 s")

    @property
    def describe(self) -> str:
        if self.production:
            return f"gunicorn, {self.workers} uvicorn ASGI workers, a pool of 20"
        return f"gunicorn, {self.workers} sync workers" + (f" x {self.threads} threads" if self.threads > 1 else "")

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
