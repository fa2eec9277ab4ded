"""The processes a chaos run puts under stress: a multi-process web server and `manage.py worker`s.

Every child starts in a session of its own, so a kill takes the whole tree at once: `manage.py worker`
together with its django-q2 cluster (sentinel, pusher, monitor, task processes), as when a machine dies.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
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

    def freeze_all(self) -> None:
        """SIGSTOP every worker tree: frozen, not dead (a stalled machine, a stop-the-world pause)."""
        for child in self.children:
            if child.alive:
                signal_all([child.process.pid, *descendants(child.process.pid)], signal.SIGSTOP)

    def thaw_all(self) -> None:
        for child in self.children:
            if child.alive:
                signal_all([child.process.pid, *descendants(child.process.pid)], signal.SIGCONT)

    def restart_all(self, *, failpoints: str = "") -> None:
        self.stop()
        self.start(failpoints=failpoints)

    def failpoint_kills(self) -> int:
        """Task processes that died under a cluster (failpoints): django-q2's sentinel logs each rebirth."""
        return sum(count_in(child.log, "after death") for child in self.children)

    def stop(self) -> None:
        stop_together(self.children)


class PrivateRedis:
    """A Redis of the chaos run's own (`redis-server` on a free port, in a temporary directory, nothing saved): the
    broker of the Redis phase, which a scenario may stop and start again without touching anyone else's."""

    def __init__(self, *, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="unwind-chaos-redis-")
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        import redis

        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)
        self.process = None

    def remove(self) -> None:
        """Stop it for good, and its directory with it."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivatePostgres:
    """A PostgreSQL cluster of the chaos run's own (Debian's binaries under /usr/lib/postgresql/*/bin, or on PATH),
    in a temporary directory on a free port: the phase's database, which the database scenarios restart and stall
    without touching anyone else's. As root, its commands run as the `postgres` user (initdb refuses root)."""

    def __init__(self):
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        pg_ctl = str(found[-1]) if found else shutil.which("pg_ctl")
        if pg_ctl is None:
            raise RuntimeError("no PostgreSQL server binaries (pg_ctl, initdb) found for the chaos run's database")
        self.bin = Path(pg_ctl).parent
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="unwind-chaos-pg-"))
        self.data = self.dir / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")

    def url(self, name: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def _run(self, *argv: str) -> None:
        subprocess.run([*self.as_user, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=120)

    def start(self) -> None:
        if not self.data.exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--no-sync")
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                   f"-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w",
                  "-o", options, "start")

    def restart(self) -> None:
        """A fast restart: every connection is cut, the server comes back on the same port."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "restart")

    def pids(self) -> list[int]:
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        return [postmaster, *descendants(postmaster)]

    def freeze(self) -> None:
        """SIGSTOP the server and every backend: the database stalls (answers nothing) without dropping anyone."""
        signal_all(self.pids(), signal.SIGSTOP)

    def thaw(self) -> None:
        signal_all(self.pids(), signal.SIGCONT)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self.thaw()
            except (OSError, ValueError):
                pass
            subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                            "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)
