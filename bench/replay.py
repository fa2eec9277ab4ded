"""The ok saga's database work alone: its 8 calls, sent by a client that does nothing else.

One saga is run through the engine and each call of `ledger/fastpath.py` it makes is recorded as sent (the statement
with its guard, and the arguments). Then, for each saga replayed, the arguments are copied with new ids (run,
actions, checkpoint) and idempotency keys, and serialized, before the clock starts; the clock then times only the 8
statements on a plain psycopg connection in autocommit: the locks, checks, rows, index entries, hashed events and
commits the guarantees need, with no Python around them but the driver's. Timed by turns with the floor's sagas of
the same number of commits and with the engine's own sagas, so the three see the same machine.

What the engine takes beyond the replay is its process's share: building the rows, the fingerprints and the signed
event bodies, validating the arguments, the tool call, the models it answers with.
"""
from __future__ import annotations

import copy
import json
import time

import psycopg
from psycopg.types.json import Jsonb

from bench.common import BENCH_DB, psycopg_url, summary

# Where each call's run id and action id sit among its arguments, and which table each row in JSON is of.
RUN_AT = {"unwind_propose": 1, "unwind_succeed": 1, "unwind_complete": 1}
ACTION_AT = {"unwind_succeed": 2}
ROW_OF = {("unwind_open_run", 1): "run", ("unwind_propose", 2): "action", ("unwind_complete", 12): "checkpoint"}


def record_one(saga, key: int) -> list[tuple[str, str, list]]:
    """The calls of one ok saga: (function, statement as sent, arguments)."""
    from django.db import connections

    from ledger import fastpath

    calls = []
    plain = fastpath._call

    def recording(function, arguments, params):
        answer = plain(function, arguments, params)
        guard = fastpath._trust(connections["default"])
        calls.append((function, f"SELECT CASE WHEN {guard} THEN public.{function}({arguments}) END",
                      copy.deepcopy(params)))
        return answer

    fastpath._call = recording
    try:
        assert saga.onboard(key, False) == "completed"
    finally:
        fastpath._call = plain
    assert [c[0] for c in calls] == ["unwind_open_run", *["unwind_propose", "unwind_succeed"] * 3, "unwind_complete"]
    return calls


def _text(value):
    """Arguments as the statement casts them: JSON as its text (serialized before the clock starts)."""
    return json.dumps(value.obj) if isinstance(value, Jsonb) else value


class Replay:
    def __init__(self, calls: list[tuple[str, str, list]]):
        self.calls = calls
        self.conn = psycopg.connect(psycopg_url(BENCH_DB), autocommit=True)
        opened = calls[0][2][1].obj
        self.run_id = opened["id"]
        self.action_ids = [params[2].obj["id"] for function, _, params in calls if function == "unwind_propose"]
        self.checkpoint_id = calls[-1][2][12].obj["id"]
        self.serial = 0

    def _ids(self, table: str, count: int) -> list[int]:
        return [row[0] for row in self.conn.execute(
            f"SELECT nextval(pg_get_serial_sequence('{table}', 'id')) FROM generate_series(1, %s)", [count])]

    def prepare(self, count: int) -> list[list[tuple[str, list]]]:
        """`count` sagas' statements with fresh ids and keys, every argument serialized."""
        runs = self._ids("ledger_run", count)
        actions = self._ids("ledger_action", 3 * count)
        checkpoints = self._ids("ledger_checkpoint", count)
        sagas = []
        for n in range(count):
            self.serial += 1
            new = {"run": {self.run_id: runs[n]}, "checkpoint": {self.checkpoint_id: checkpoints[n]},
                   "action": dict(zip(self.action_ids, actions[3 * n:3 * n + 3]))}
            statements = []
            for function, statement, params in self.calls:
                params = list(params)
                if function in RUN_AT:
                    params[RUN_AT[function]] = new["run"][params[RUN_AT[function]]]
                if function in ACTION_AT:
                    params[ACTION_AT[function]] = new["action"][params[ACTION_AT[function]]]
                for at, value in enumerate(params):
                    if not (isinstance(value, Jsonb) and isinstance(value.obj, dict)):
                        continue
                    row = dict(value.obj)
                    if (function, at) in ROW_OF:
                        row["id"] = new[ROW_OF[function, at]][row["id"]]
                    if "run_id" in row:
                        row["run_id"] = new["run"][row["run_id"]]
                    for name in ("idempotency_key", "open_key"):
                        if row.get(name):
                            row[name] = f"{row[name]}~{self.serial}"
                    params[at] = Jsonb(row)
                if function == "unwind_propose":
                    params[4] = f"{params[4]}~{self.serial}"  # the key the call checks, as in the row
                statements.append((statement, [_text(p) for p in params]))
            sagas.append(statements)
        return sagas

    def saga(self, statements: list[tuple[str, list]]) -> None:
        for statement, params in statements:
            answer = self.conn.execute(statement, params, prepare=True).fetchone()[0]
            outcome = answer if isinstance(answer, str) else answer["outcome"]
            assert outcome == "ok", (statement.split("public.")[1][:30], answer)

    def close(self) -> None:
        self.conn.close()


def measure(n: int, *, rounds: int = 10, warmup: int = 10) -> dict:
    """The replayed ok saga, the floor's and the engine's, by turns in `rounds`."""
    from bench.engine import Saga, tenant_with_tools
    from bench.pgfloor import Floor

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 200_000
    for i in range(warmup):
        saga.onboard(base - 1000 + i, False)
    replay = Replay(record_one(saga, base - 1))
    floor = Floor(psycopg_url(BENCH_DB))
    commits = len(replay.calls)
    for statements in replay.prepare(warmup):
        replay.saga(statements)
    floor.timed(commits, warmup)
    times = {"replay": [], "floor": [], "engine": []}
    per_round = max(1, n // rounds)
    try:
        for r in range(rounds):
            for statements in replay.prepare(per_round):
                started = time.perf_counter()
                replay.saga(statements)
                times["replay"].append(time.perf_counter() - started)
            times["floor"] += floor.timed(commits, per_round)
            for i in range(per_round):
                started = time.perf_counter()
                saga.onboard(base + r * per_round + i, False)
                times["engine"].append(time.perf_counter() - started)
    finally:
        replay.close()
        floor.close()
    result = {name: summary(values) for name, values in times.items()}
    result["commits"] = commits
    return result
