"""Part 6: MCP against REST, on one gunicorn server with 4 worker processes (no sticky routing: any worker answers).

- per call: REST `POST /api/v1/runs/{id}/actions`, MCP `tools/call` (raw JSON-RPC over streamable HTTP with the
  session's `Mcp-Session-Id`, JSON answer), MCP `tools/call` over 2026-07-28 (stateless: the `_meta` envelope, the
  routing headers and the run handle on every request) and the no-op endpoint, one agent, the four requests in
  turn, so all see the same conditions; the MCP session is initialized once;
- throughput: 1, 4 and 16 agents at once, REST and MCP in pairs of rounds at each level, in turns (ABBA), each agent
  with its own key, run (REST) or session (MCP) and connection.

Alone (a fresh BENCH_DB, migrated; writes bench/results_mcp.json, or BENCH_MCP_OUT, and bench/profile_mcp.txt):
`.venv/bin/python -m bench.mcp`, first the in-process CPU comparison and the profiles, then the server parts
(BENCH_MCP_IN_PROCESS_ONLY=1 skips them; BENCH_MCP_LEVELS=16 and BENCH_MCP_PAIRS=6 for more, shorter pairs at
one level). In `make bench` the server parts run after part 2.
"""
from __future__ import annotations

import json
import os
import time

from bench.api import ACTIONS_PER_RUN, Agent, _cpu_by_process, cpu_split, drive
from bench.common import log, summary

PROTOCOL = "2025-11-25"
MODERN = "2026-07-28"
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}


class RestAgent(Agent):
    """The REST agent of part 2, completing each run before it opens the next: the ledger work MCP's unwind_commit
    and unwind_begin do, so both sides pay for the same runs."""

    def open_run(self) -> None:
        if self.run_id is not None:
            status, text = self.post(f"/api/v1/runs/{self.run_id}/complete", {})
            assert status == 200, (status, text[:500])
        super().open_run()


class McpAgent(Agent):
    """An agent speaking MCP over streamable HTTP as the official client does: initialize, then requests carrying
    the session's id and protocol version, accepting JSON or an event stream."""

    def __init__(self, base: str, key: str, name: str):
        super().__init__(base, key, name)
        self.headers = {**self.headers, "Accept": "application/json, text/event-stream"}
        self.request_id = 0
        status, _, session_id = self.rpc("initialize", {"protocolVersion": PROTOCOL, "capabilities": {},
                                                        "clientInfo": {"name": "bench", "version": "1"}})
        assert status == 200 and session_id, status
        self.headers.update({"Mcp-Session-Id": session_id, "Mcp-Protocol-Version": PROTOCOL})
        self.connection.request("POST", "/mcp", headers=self.headers,
                                body=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        response = self.connection.getresponse()
        response.read()
        assert response.status == 202, response.status

    def rpc(self, method: str, params: dict) -> tuple[int, dict, str | None]:
        self.request_id += 1
        body = json.dumps({"jsonrpc": "2.0", "id": self.request_id, "method": method, "params": params})
        self.connection.request("POST", "/mcp", body=body, headers=self.headers)
        response = self.connection.getresponse()
        text = response.read()
        assert response.getheader("Content-Type", "").startswith("application/json"), response.getheader("Content-Type")
        return response.status, json.loads(text), response.getheader("Mcp-Session-Id")

    def act(self) -> float:
        """One no-op tools/call (every ACTIONS_PER_RUN calls the session's run is committed and a new one begun,
        untimed, as RestAgent completes and opens runs); returns the request's seconds."""
        if self.done_in_run >= ACTIONS_PER_RUN:
            for name in ("unwind_commit", "unwind_begin"):
                status, answer, _ = self.rpc("tools/call", {"name": name, "arguments": {}})
                assert status == 200 and not answer["result"].get("isError"), answer
            self.done_in_run = 0
        self.counter += 1
        params = {"name": "bench.noop", "arguments": {"agent": self.name, "n": self.counter}}
        started = time.perf_counter()
        status, answer, _ = self.rpc("tools/call", params)
        seconds = time.perf_counter() - started
        assert status == 200 and answer["result"]["structuredContent"]["status"] == "succeeded", answer
        self.done_in_run += 1
        return seconds


class ModernMcpAgent(McpAgent):
    """An agent speaking 2026-07-28 as the official client does: no initialize and no session; each request carries
    the `_meta` envelope and the routing headers, and each call the run handle unwind_begin answered."""

    def __init__(self, base: str, key: str, name: str):
        Agent.__init__(self, base, key, name)
        self.headers = {**self.headers, "Accept": "application/json, text/event-stream",
                        "Mcp-Protocol-Version": MODERN, "Mcp-Method": "tools/call"}
        self.request_id = 0
        self.begin()

    def begin(self) -> None:
        status, answer, _ = self.rpc("tools/call", {"name": "unwind_begin", "arguments": {}})
        assert status == 200 and not answer["result"].get("isError"), answer
        self.run_id, self.done_in_run = answer["result"]["structuredContent"]["run_id"], 0

    def rpc(self, method: str, params: dict) -> tuple[int, dict, str | None]:
        self.headers["Mcp-Name"] = params["name"]
        meta = {**ENVELOPE, **({"dev.unwind/run": self.run_id} if self.run_id else {})}
        return super().rpc(method, {**params, "_meta": meta})

    def act(self) -> float:
        """One no-op tools/call in the agent's run (committed and begun again every ACTIONS_PER_RUN, untimed)."""
        if self.done_in_run >= ACTIONS_PER_RUN:
            status, answer, _ = self.rpc("tools/call", {"name": "unwind_commit", "arguments": {}})
            assert status == 200 and not answer["result"].get("isError"), answer
            self.run_id = None
            self.begin()
        self.counter += 1
        started = time.perf_counter()
        status, answer, _ = self.rpc("tools/call", {"name": "bench.noop",
                                                    "arguments": {"agent": self.name, "n": self.counter}})
        seconds = time.perf_counter() - started
        assert status == 200 and answer["result"]["structuredContent"]["status"] == "succeeded", answer
        self.done_in_run += 1
        return seconds


def new_rest_agents(tenant, count: int, base: str) -> list[RestAgent]:
    from ledger.tenancy import agent_create

    stamp = int(time.time() * 1000)
    return [RestAgent(base, agent_create(tenant=tenant, name=f"rest-{stamp}-{i}")[1], f"r{stamp}-{i}")
            for i in range(count)]


def new_mcp_agents(tenant, count: int, base: str) -> list[McpAgent]:
    from ledger.tenancy import agent_create

    stamp = int(time.time() * 1000)
    return [McpAgent(base, agent_create(tenant=tenant, name=f"mcp-{stamp}-{i}")[1], f"m{stamp}-{i}")
            for i in range(count)]


def per_call(tenant, base: str, n: int) -> dict:
    from ledger.tenancy import agent_create

    rest, mcp = new_rest_agents(tenant, 1, base)[0], new_mcp_agents(tenant, 1, base)[0]
    stamp = int(time.time() * 1000)
    modern = ModernMcpAgent(base, agent_create(tenant=tenant, name=f"mcp26-{stamp}")[1], f"s{stamp}")
    for _ in range(10):  # warm every worker's connections and imports
        rest.noop(), rest.act(), mcp.act(), modern.act()
    noops, actions, calls, stateless = [], [], [], []
    for _ in range(n):
        noops.append(rest.noop())
        actions.append(rest.act())
        calls.append(mcp.act())
        stateless.append(modern.act())
    result = {"rest": summary(actions), "mcp": summary(calls), "mcp_2026": summary(stateless), "noop": summary(noops)}
    result["mcp_minus_rest_p50_ms"] = round(result["mcp"]["p50"] - result["rest"]["p50"], 3)
    result["mcp_2026_minus_rest_p50_ms"] = round(result["mcp_2026"]["p50"] - result["rest"]["p50"], 3)
    # The same difference pair by pair (each MCP call against the REST call just before it): drift cancels.
    paired = sorted((m - r) * 1000 for m, r in zip(calls, actions))
    result["paired_median_ms"] = round(paired[len(paired) // 2], 3)
    return result


def load(agents: list, seconds: float, server_pid: int) -> dict:
    latencies, errors, elapsed, cpu_before = drive(agents, seconds)
    split = cpu_split(cpu_before, _cpu_by_process(), server_pid)
    row = {"agents": len(agents), "actions": len(latencies), "seconds": round(elapsed, 2),
           "actions_per_s": round(len(latencies) / elapsed, 1), **summary(latencies),
           "server_cpu_ms_per_action": round(split["server"] * 1000 / max(1, len(latencies)), 2)}
    if errors:
        row["errors"] = errors[:3]
    return row


def throughput(tenant, base: str, levels, seconds: float, server_pid: int, pairs: int = 2) -> list[dict]:
    """At each level, `pairs` pairs of rounds: REST, MCP, then MCP, REST, ... (ABBA; fresh agents each round), so a
    drift of the machine hits both alike; the ratio of the sums, and each pair's own ratio."""
    rows = []
    for level in levels:
        rounds = {"rest": [], "mcp": []}
        for pair in range(pairs):
            for kind in (("rest", "mcp") if pair % 2 == 0 else ("mcp", "rest")):
                agents = (new_rest_agents if kind == "rest" else new_mcp_agents)(tenant, level, base)
                rounds[kind].append(load(agents, seconds, server_pid))
        rest = sum(r["actions_per_s"] for r in rounds["rest"]) / pairs
        mcp = sum(r["actions_per_s"] for r in rounds["mcp"]) / pairs
        by_pair = sorted(m["actions_per_s"] / r["actions_per_s"] for r, m in zip(rounds["rest"], rounds["mcp"]))
        row = {"agents": level, "rest_actions_per_s": round(rest, 1), "mcp_actions_per_s": round(mcp, 1),
               "mcp_over_rest": round(mcp / rest, 3) if rest else None,
               "pair_ratios": [round(x, 3) for x in by_pair], "rounds": rounds}
        log(f"mcp: {level} agents -> REST {row['rest_actions_per_s']}, MCP {row['mcp_actions_per_s']} actions/s "
            f"({row['mcp_over_rest']}; pairs {row['pair_ratios']})")
        rows.append(row)
    return rows


class InProcess:
    """REST propose and MCP tools/call through Django's test client in this process (the full middleware and view,
    no socket): the process CPU each request costs, by turns, which the machine's other load hardly moves."""

    def __init__(self, tenant):
        from django.test import Client

        from ledger.tenancy import agent_create

        stamp = int(time.time() * 1000)
        self.rest = Client(HTTP_AUTHORIZATION=f"Bearer {agent_create(tenant=tenant, name=f'pr-{stamp}')[1]}")
        self.mcp = Client(HTTP_AUTHORIZATION=f"Bearer {agent_create(tenant=tenant, name=f'pm-{stamp}')[1]}",
                          HTTP_ACCEPT="application/json, text/event-stream")
        opened = self.mcp.post("/mcp", {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}},
            content_type="application/json")
        self.mcp_headers = {"HTTP_MCP_SESSION_ID": opened["Mcp-Session-Id"], "HTTP_MCP_PROTOCOL_VERSION": PROTOCOL}
        self.run_id, self.done, self.mcp_done, self.counter = None, ACTIONS_PER_RUN, 0, 0
        self.modern = Client(HTTP_AUTHORIZATION=f"Bearer {agent_create(tenant=tenant, name=f'ps-{stamp}')[1]}",
                             HTTP_ACCEPT="application/json, text/event-stream", HTTP_MCP_PROTOCOL_VERSION=MODERN,
                             HTTP_MCP_METHOD="tools/call")
        self.modern_run, self.modern_done = None, ACTIONS_PER_RUN

    def rest_call(self) -> None:
        if self.done >= ACTIONS_PER_RUN:
            if self.run_id is not None:
                assert self.rest.post(f"/api/v1/runs/{self.run_id}/complete", {}, "application/json").status_code == 200
            self.run_id = self.rest.post("/api/v1/runs", {"goal": "bench"}, "application/json").json()["id"]
            self.done = 0
        self.counter += 1
        answered = self.rest.post(f"/api/v1/runs/{self.run_id}/actions", {
            "tool": "bench.noop", "args": {"n": self.counter}}, "application/json")
        assert answered.status_code == 201, answered.content[:300]
        self.done += 1

    def mcp_call(self, name: str = "bench.noop", arguments: dict | None = None) -> dict:
        self.counter += 1
        answered = self.mcp.post("/mcp", {"jsonrpc": "2.0", "id": self.counter, "method": "tools/call", "params": {
            "name": name, "arguments": {"n": self.counter} if arguments is None else arguments}},
            content_type="application/json", **self.mcp_headers)
        assert answered.status_code == 200 and not answered.json()["result"]["isError"], answered.content[:300]
        if name == "bench.noop":
            self.mcp_done += 1
            if self.mcp_done >= ACTIONS_PER_RUN:  # as rest_call: a new run every ACTIONS_PER_RUN calls
                self.mcp_call("unwind_commit", {})
                self.mcp_call("unwind_begin", {})
                self.mcp_done = 0
        return answered.json()


    def modern_call(self, name: str = "bench.noop", arguments: dict | None = None) -> dict:
        """A 2026-07-28 tools/call: the envelope and the run handle in `_meta`, the routing headers."""
        if name == "bench.noop" and self.modern_done >= ACTIONS_PER_RUN:
            if self.modern_run is not None:
                self.modern_call("unwind_commit", {})
            self.modern_run = None
            self.modern_run = self.modern_call("unwind_begin", {})["result"]["structuredContent"]["run_id"]
            self.modern_done = 0
        self.counter += 1
        meta = {**ENVELOPE, **({"dev.unwind/run": self.modern_run} if self.modern_run else {})}
        answered = self.modern.post("/mcp", {"jsonrpc": "2.0", "id": self.counter, "method": "tools/call", "params": {
            "name": name, "arguments": {"n": self.counter} if arguments is None else arguments, "_meta": meta}},
            content_type="application/json", HTTP_MCP_NAME=name)
        assert answered.status_code == 200 and not answered.json()["result"]["isError"], answered.content[:300]
        if name == "bench.noop":
            self.modern_done += 1
        return answered.json()


def in_process(tenant, n: int, profile_path=None) -> dict:
    """Process CPU per request, REST and MCP by turns; and (profile_path) a pyinstrument profile of each."""
    both = InProcess(tenant)
    for _ in range(20):
        both.rest_call(), both.mcp_call(), both.modern_call()
    rest, mcp, modern = [], [], []
    for _ in range(n):
        for calls, one in ((rest, both.rest_call), (mcp, both.mcp_call), (modern, both.modern_call)):
            started = time.process_time()
            one()
            calls.append(time.process_time() - started)
    result = {"rest_cpu": summary(rest), "mcp_cpu": summary(mcp), "mcp_2026_cpu": summary(modern)}
    if profile_path is not None:
        from pyinstrument import Profiler

        texts = []
        for label, one in (("REST POST /api/v1/runs/{id}/actions", both.rest_call),
                           ("MCP tools/call", both.mcp_call)):
            profiler = Profiler(interval=0.0005)
            profiler.start()
            for _ in range(min(n, 100)):
                one()
            profiler.stop()
            texts.append(f"=== {label}, {min(n, 100)} calls in process\n"
                         + profiler.output_text(unicode=False, color=False, show_all=False))
        profile_path.write_text("\n".join(texts))
    return result


def measure(tenant, *, n: int, seconds: float, levels=(1, 4, 16), workers: int = 4,
            pairs: int = int(os.environ.get("BENCH_MCP_PAIRS", "2")), server=None) -> dict:
    """On `server` (part 2's, in `make bench`), or on one of its own."""
    from contextlib import nullcontext

    from bench.server import Server

    with nullcontext(server) if server is not None else Server(workers=workers) as server:
        result = {"server": f"gunicorn, {server.workers} sync workers", "per_call": per_call(tenant, server.url, n)}
        p = result["per_call"]
        log(f"mcp: p50 REST {p['rest']['p50']} ms, MCP {p['mcp']['p50']} ms, MCP 2026-07-28 {p['mcp_2026']['p50']} "
            f"ms, no-op {p['noop']['p50']} ms (MCP - REST {p['mcp_minus_rest_p50_ms']} ms, paired "
            f"{p['paired_median_ms']} ms; 2026-07-28 - REST {p['mcp_2026_minus_rest_p50_ms']} ms)")
        result["throughput"] = throughput(tenant, server.url, levels, seconds, server.process.pid, pairs)
    return result


def lines(r: dict) -> list[str]:
    """The part's lines in the bench table."""
    if "per_call" not in r:
        c = r["in_process"]
        modern = f", MCP 2026-07-28 {c['mcp_2026_cpu']['p50']:.2f} ms" if "mcp_2026_cpu" in c else ""
        return [f"6. MCP against REST, process CPU per request in process (p50): REST {c['rest_cpu']['p50']:.2f} ms, "
                f"MCP {c['mcp_cpu']['p50']:.2f} ms{modern}"]
    p = r["per_call"]
    gap = p["mcp_minus_rest_p50_ms"]
    out = [f"6. MCP against REST ({r['server']}, no sticky routing), per call p50: REST propose "
           f"{p['rest']['p50']:.1f} ms, MCP tools/call {p['mcp']['p50']:.1f} ms, no-op {p['noop']['p50']:.1f} ms: "
           f"MCP - REST {gap:+.1f} ms (paired {p['paired_median_ms']:+.1f}); target within 1.5 ms → "
           f"{'met' if gap <= 1.5 else 'NOT met'}"]
    if "mcp_2026" in p:
        modern = p["mcp_2026_minus_rest_p50_ms"]
        out.append(f"   MCP 2026-07-28 (stateless) tools/call {p['mcp_2026']['p50']:.1f} ms: MCP - REST {modern:+.1f} ms "
                   f"→ {'met' if modern <= 1.5 else 'NOT met'}")
    cells = "; ".join(f"{t['agents']} agents REST {t['rest_actions_per_s']:.0f} / MCP {t['mcp_actions_per_s']:.0f} "
                      f"actions/s ({t['mcp_over_rest']:.2f})" for t in r["throughput"])
    top = r["throughput"][-1]
    out.append(f"   throughput (REST, MCP, MCP, REST by turns): {cells}")
    met = "met" if top["mcp_over_rest"] >= 0.9 else "NOT met"
    out.append(f"   at {top['agents']} agents MCP ≥ 90 % of REST → {met}")
    return out


def main() -> None:
    import subprocess
    import sys

    from bench.common import BENCH_DB, ROOT, bench_env, django_setup, recreate_database
    from bench.run import API_N, API_SECONDS

    log(f"fresh database {BENCH_DB}, migrated")
    recreate_database(BENCH_DB)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=str(ROOT), env=bench_env(),
                   check=True)
    django_setup(UNWIND_TASKS_SYNC="0")
    from bench.engine import tenant_with_tools

    tenant, _, _ = tenant_with_tools()
    from pathlib import Path

    result = {"in_process": in_process(tenant, API_N, Path(__file__).resolve().parent / "profile_mcp.txt")}
    log(f"mcp: process CPU per request p50: REST {result['in_process']['rest_cpu']['p50']} ms, MCP "
        f"{result['in_process']['mcp_cpu']['p50']} ms, MCP 2026-07-28 {result['in_process']['mcp_2026_cpu']['p50']} ms")
    if os.environ.get("BENCH_MCP_IN_PROCESS_ONLY") in (None, "", "0"):
        levels = tuple(int(x) for x in os.environ.get("BENCH_MCP_LEVELS", "1,4,16").split(","))
        result.update(measure(tenant, n=API_N, seconds=API_SECONDS, levels=levels))
    result["load"] = os.getloadavg()
    out = os.environ.get("BENCH_MCP_OUT") or Path(__file__).resolve().parent / "results_mcp.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(lines(result)))


if __name__ == "__main__":
    main()
