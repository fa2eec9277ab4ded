"""The processes a chaos run puts under stress: a multi-process web server and `manage.py worker`s.

Every child starts in a session of its own, so a kill takes the whole tree at once: `manage.py worker`
together with its django-q2 cluster (sentinel, pusher, monitor, task processes), as when a machine dies.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, whatever session it moved to (`manage.py worker` puts its cluster in one of its own)."""
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def count_in(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except OSError:
        return 0


class Child:
    """One supervised process tree, logging to a file. Kills and stops reach every descendant."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name = name
        self.argv = argv
        self.env = env
        self.log = log
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole tree at once, no goodbye: as when its machine dies."""
        if self.process is None:
            return
        signal_all([self.process.pid, *descendants(self.process.pid)], signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the top process and wait for it to stop its children; SIGKILL whatever is left after that."""
        stop_together([self], timeout)


def stop_together(children: list[Child], timeout: float = 20.0) -> None:
    """Stop several trees at once: SIGTERM every top process, wait for all (up to `timeout`), SIGKILL the rest."""
    running = [child for child in children if child.process is not None]
    trees = {id(child): [child.process.pid, *descendants(child.process.pid)] for child in running}
    signal_all([child.process.pid for child in running if child.process.poll() is None], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in running:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_all(trees[id(child)], signal.SIGKILL)
        child.process.wait()


class WebServer:
    """gunicorn with several worker processes, each with threads: the API and the sandbox behind one port."""

    def __init__(self, *, env: dict, log: Path, workers: int = 3, threads: int = 12, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.threads = threads
        self.base_env = env
        self.log = log
        self.child: Child | None = None
        self.kills = 0

    def start(self, *, failpoints: str = "") -> None:
        env = dict(self.base_env, UNWIND_FAILPOINTS=failpoints)
        argv = [sys.executable, "-m", "gunicorn", "config.wsgi:application", "--bind", f"127.0.0.1:{self.port}",
                "--workers", str(self.workers), "--threads", str(self.threads), "--worker-class", "gthread",
                "--timeout", "120", "--graceful-timeout", "5", "--backlog", "512"]
        self.child = Child("web", argv, env, self.log)
        self.child.start()
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.child.alive:
                raise RuntimeError(f"the web server exited; see {self.log}")
            try:
                if requests.get(self.url + "/healthz", timeout=2).status_code in (200, 503):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the web server did not answer within {timeout:g}s; see {self.log}")

    def worker_pids(self) -> list[int]:
        return children_of(self.child.process.pid) if self.child and self.child.alive else []

    def kill_a_worker(self, rng: random.Random) -> bool:
        """SIGKILL one gunicorn worker process (the master starts a new one)."""
        pids = self.worker_pids()
        if not pids:
            return False
        try:
            os.kill(rng.choice(pids), signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills += 1
        return True

    def sigkilled_workers(self) -> int:
        """Worker processes that died of SIGKILL, by the master's log: ours and the failpoints'."""
        return count_in(self.log, "was sent SIGKILL")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


class WorkerPool:
    """N `manage.py worker` processes (a django-q2 cluster + the sweep clock each)."""

    def __init__(self, *, count: int, env: dict, log_dir: Path):
        self.env = env
        self.log_dir = log_dir
        self.children = [Child(f"worker-{n}", [sys.executable, "manage.py", "worker"], dict(env),
                               log_dir / f"worker-{n}.log") for n in range(1, count + 1)]
        self.kills = 0

    def start(self, *, failpoints: str = "") -> None:
        for child in self.children:
            child.env = dict(self.env, UNWIND_FAILPOINTS=failpoints)
            child.start()

    def kill_one(self, rng: random.Random) -> Child | None:
        alive = [child for child in self.children if child.alive]
        if not alive:
            return None
        child = rng.choice(alive)
        child.kill()
        self.kills += 1
        return child

    def kill_all(self) -> None:
        for child in self.children:
            if child.alive:
                child.kill()
                self.kills += 1

    def restart_dead(self) -> int:
        """Start again every worker that is not running (killed by us, or exited by itself)."""
        restarted = 0
        for child in self.children:
            if not child.alive:
                child.start()
                restarted += 1
        return restarted

    def restart_all(self, *, failpoints: str = "") -> None:
        self.stop()
        self.start(failpoints=failpoints)

    def failpoint_kills(self) -> int:
        """Task processes that died under a cluster (failpoints): django-q2's sentinel logs each rebirth."""
        return sum(count_in(child.log, "after death") for child in self.children)

    def stop(self) -> None:
        stop_together(self.children)
