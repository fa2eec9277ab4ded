"""Part 2: the API over HTTP, against gunicorn on the same PostgreSQL.

- overhead per action: POST /api/v1/runs/{id}/actions (propose → executed inline → 201, no-op tool)
  against POST /bench/noop (same server, same agent-key authentication, throttle, parser, renderer),
  one agent, requests alternating so both see the same conditions;
- throughput: 1, 4 and 16 agents at once (threads, each with its own key, run and keep-alive session).
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
from urllib.parse import urlsplit

from bench.common import log, summary

ACTIONS_PER_RUN = 20


class Agent:
    """One agent: its key, its run and its own connection. The load generator shares the two CPUs with the server
    and PostgreSQL, so it speaks HTTP with the standard library's client: with `requests` it took 0.92 ms of CPU a
    request (of the 6.5 ms an action cost the machine, read from /proc), with http.client 0.34 ms."""

    def __init__(self, base: str, key: str, name: str):
        self.name = name
        address = urlsplit(base)
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.run_id = None
        self.done_in_run = 0
        self.counter = 0

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        """POST `body` as JSON; (status, body). gunicorn's sync workers close each connection after answering, and
        the client opens the next one by itself. The ASGI worker keeps a connection 2 s (`--keep-alive`): one left
        idle longer (the warm-up goes agent by agent, slow on a busy machine) is closed under the next request, which
        is then sent once more on a new connection, as HTTP clients do (urllib3)."""
        try:
            return self._send(path, body)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.connection.close()
            return self._send(path, body)

    def _send(self, path: str, body: dict) -> tuple[int, bytes]:
        self.connection.request("POST", path, body=json.dumps(body), headers=self.headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def open_run(self) -> None:
        status, text = self.post("/api/v1/runs", {"goal": f"bench {self.name}"})
        assert status == 201, (status, text[:500])
        self.run_id = json.loads(text)["id"]
        self.done_in_run = 0

    def act(self) -> float:
        """Propose one no-op action (a fresh run every ACTIONS_PER_RUN); returns the request's seconds."""
        if self.run_id is None or self.done_in_run >= ACTIONS_PER_RUN:
            self.open_run()
        self.counter += 1
        body = {"tool": "bench.noop", "args": {"agent": self.name, "n": self.counter}}
        started = time.perf_counter()
        status, text = self.post(f"/api/v1/runs/{self.run_id}/actions", body)
        seconds = time.perf_counter() - started
        assert status == 201 and json.loads(text)["status"] == "succeeded", (status, text[:500])
        self.done_in_run += 1
        return seconds

    def noop(self) -> float:
        body = {"tool": "bench.noop", "args": {"agent": self.name, "n": self.counter}}
        started = time.perf_counter()
        status, text = self.post("/bench/noop", body)
        seconds = time.perf_counter() - started
        assert status == 201, (status, text[:300])
        return seconds


def new_agents(tenant, count: int, base: str) -> list[Agent]:
    from ledger.tenancy import agent_create

    stamp = int(time.time() * 1000)
    return [Agent(base, agent_create(tenant=tenant, name=f"bench-{stamp}-{i}")[1], f"a{stamp}-{i}")
            for i in range(count)]


def overhead(tenant, base: str, n: int) -> dict:
    agent = new_agents(tenant, 1, base)[0]
    for _ in range(10):  # warm every worker's connections and imports
        agent.noop()
        agent.act()
    actions, noops = [], []
    for _ in range(n):
        noops.append(agent.noop())
        actions.append(agent.act())
    result = {"action": summary(actions), "noop": summary(noops)}
    result["overhead_p50_ms"] = round(result["action"]["p50"] - result["noop"]["p50"], 3)
    return result


def _cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) spent so far by each process, keyed "pid:start" (a pid is reused), with its
    command name and parent: read from /proc, so a process that exits between two readings is not counted."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[1] is the parent, [11] utime, [12] stime, [19] start time (proc(5), counted from the state field).
        found[f"{entry}:{fields[19]}"] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    return found


def cpu_split(before: dict, after: dict, server_pid: int) -> dict[str, float]:
    """CPU seconds between two readings: the server's workers, PostgreSQL's processes, this load generator."""
    def spent(pick) -> float:
        return sum(cpu - (before[key][2] if key in before else 0.0)
                   for key, (name, parent, cpu) in after.items() if pick(key, name, parent))
    me = str(os.getpid())
    return {"server": spent(lambda key, name, parent: parent == server_pid),
            "postgresql": spent(lambda key, name, parent: name.startswith("postgres")),
            "load_generator": spent(lambda key, name, parent: key.split(":")[0] == me)}


def drive(agents: list, seconds: float) -> tuple[list[float], list[str], float, dict]:
    """Every agent acts in a loop of its own for `seconds` (after one warm-up action each): the latencies, the first
    errors, the wall time and the process CPU before it started (for `cpu_split`)."""
    for agent in agents:
        agent.act()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def work(agent):
        mine = []
        try:
            while time.monotonic() < stop:
                mine.append(agent.act())
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            errors.append(repr(exc)[:300])
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=work, args=(a,)) for a in agents]
    cpu_before = _cpu_by_process()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors, time.perf_counter() - started, cpu_before


def throughput(tenant, base: str, concurrency: int, seconds: float, server_pid: int | None = None) -> dict:
    latencies, errors, elapsed, cpu_before = drive(new_agents(tenant, concurrency, base), seconds)
    result = {"agents": concurrency, "actions": len(latencies), "seconds": round(elapsed, 2),
              "actions_per_s": round(len(latencies) / elapsed, 1), **summary(latencies)}
    if server_pid is not None and latencies:
        # Process CPU per action (the lever on throughput: two vCPUs give 2,000 ms of CPU a second to share).
        split = cpu_split(cpu_before, _cpu_by_process(), server_pid)
        result["cpu_ms_per_action"] = {k: round(v * 1000 / len(latencies), 2) for k, v in split.items()}
        result["cpu_busy"] = round(sum(split.values()) / elapsed, 2)  # CPUs kept busy on average
    if errors:
        result["errors"] = errors[:3]
    return result


def measure(tenant, *, n: int, seconds: float, levels=(1, 4, 16), workers: int = 4, server=None) -> dict:
    """On `server` (a running bench.server.Server, which part 6 shares), or on one of its own."""
    from contextlib import nullcontext

    from bench.server import Server

    with nullcontext(server) if server is not None else Server(workers=workers) as server:
        result = {"server": server.describe, "overhead": overhead(tenant, server.url, n)}
        log(f"api: overhead p50 {result['overhead']['overhead_p50_ms']} ms")
        result["throughput"] = []
        for level in levels:
            row = throughput(tenant, server.url, level, seconds, server_pid=server.process.pid)
            log(f"api: {level} agents -> {row['actions_per_s']} actions/s, p50 {row['p50']} ms")
            result["throughput"].append(row)
    return result


def production(tenant, *, n: int, seconds: float, workers: int = 4) -> dict:
    """The same overhead and 16 agents on docs/production.md's command (uvicorn's ASGI worker, a pool): the figures
    above are the sync WSGI workers' (what bench/ab.py compares on); this is what a deployment that follows the
    docs serves (0.77× the sync workers' actions a second at 16 agents in 70d2578's full run, at 1.4× the server's
    CPU an action). Taking sync-only middlewares out changed nothing because the hops were not theirs: Django's ASGI
    chain ends in an async handler, so every request crossed the loop twice below the innermost sync middleware,
    and started two threads; issue 40 removed both and moved the worker to httptools (docs/production.md)."""
    from bench.server import Server

    with Server(workers=workers, production=True) as server:
        result = {"server": server.describe, "overhead": overhead(tenant, server.url, n)}
        result["throughput"] = [throughput(tenant, server.url, 16, seconds, server_pid=server.process.pid)]
    log(f"api (production command): overhead p50 {result['overhead']['overhead_p50_ms']} ms, 16 agents "
        f"{result['throughput'][0]['actions_per_s']} actions/s")
    return result
