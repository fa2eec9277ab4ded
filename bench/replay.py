"""A saga's database work alone: its statements, sent by a client that does nothing else.

One saga of each kind is run through the engine and every statement it sends is recorded as sent (the functions'
calls of `ledger/engine/fastpath.py` with their guard, the failing saga's read before the unwind, and each undo's
read of its seal), with its arguments.
Then, for each saga replayed, the arguments are copied with new ids (run, actions, checkpoints), idempotency keys
and lease, and serialized, before the clock starts; the clock then times only the statements, on a plain psycopg
connection in autocommit: the locks, checks, rows, index entries, hashed events and commits the guarantees need, with
no Python around them but the driver's. Timed by turns with the floor's sagas of the same number of commits and with
the engine's own sagas, so that the three see the same machine.

What the engine takes beyond the replay is its process's share: building the rows, the fingerprints and the signed
event bodies, validating the arguments, the tool calls, deciding the unwind, the models it answers with.
"""
from __future__ import annotations

import copy
import datetime
import json
import re
import time

import psycopg
from psycopg.types.json import Jsonb

from bench.common import BENCH_DB, psycopg_url, summary

# Where the ids sit among each statement's arguments: plain ids by position, rows in JSON by position (the table
# their "id" is of), the steps' guard (a digest of [action id, status]) the calls check, the lease the first undo takes.
SPEC = {
    "unwind_open_run": {"rows": {1: "run"}},
    "unwind_propose": {"ids": {1: "run"}, "rows": {2: "action"}, "key": 4, "steps": 9},
    "unwind_outcome": {"ids": {1: "run", 12: "action"}, "steps": 9, "rows": {17: "checkpoint"}},
    "unwind_complete": {"ids": {1: "run"}, "steps": 9, "rows": {11: "checkpoint"}},
    "unwind_compensated": {"ids": {1: "run", 14: "action", 18: "action", 21: "action"}, "steps": 9, "lease": 13,
                           "rows": {24: "action", 27: "checkpoint"}},
    "read for the unwind": {"ids": {1: "run", 4: "run"}},  # fastpath.run_for_unwind
    # ledger/audit/sealed.recorded_undo_seal, before each undo leaves: the step's success as the chain recorded it. Its
    # arguments are kept as recorded: the replayed events keep the recorded saga's `action_ref` (the function's event
    # rows are not remapped), so the read finds those rows, through the same index, as the engine's read finds its own.
    "read the undo seal": {},
    # ledger/audit/sealed.RUN_SEALS_READ, at an unwind's first undo: every seal of the run, once (kept as recorded,
    # as the read above, for the same reason).
    "read the run's undo seals": {},
}
ROW_KEYS = {"run_id": "run", "compensates_id": "action", "action_id": "action"}  # ids a row holds of other tables
SEQUENCES = {"run": "ledger_run", "action": "ledger_action", "checkpoint": "ledger_checkpoint"}


def _kind(sql: str) -> str | None:
    from ledger.audit.sealed import RUN_SEALS_READ, UNDO_SEAL_READ

    called = re.search(r"public\.(unwind_[a-z_]+)\(", sql)
    if called:
        return called.group(1)
    if sql.startswith("WITH ids AS MATERIALIZED"):
        return "read for the unwind"
    if sql == UNDO_SEAL_READ:
        return "read the undo seal"
    if sql == RUN_SEALS_READ:
        return "read the run's undo seals"
    return None


def record(saga, key: int, fail: bool) -> list[tuple[str, str, list]]:
    """Every statement one saga sends: (kind, statement, arguments)."""
    from django.db import connection

    statements = []

    def recording(execute, sql, params, many, context):
        kind = _kind(sql)
        assert kind is not None, f"a statement the replay does not know: {sql[:80]}"
        kept = copy.deepcopy(list(params or []))
        at = SPEC[kind].get("steps")
        if at is not None and kept[at] is not None:
            kept[at] = _steps_digested(connection, kept[1], kept[at])
        statements.append((kind, sql, kept))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(recording):
        assert saga.onboard(key, fail) == ("compensated" if fail else "completed")
    return statements


def digest(pairs) -> Jsonb:
    """The guard as the engine sends it (`runsteps.guard`)."""
    from ledger.engine import runsteps

    return Jsonb(runsteps.digest(pairs))


def _steps_digested(connection, run_id: int, sent: Jsonb) -> list[tuple[int, str]]:
    """The run's steps, (action id, status) in order, as the call's guard digested them (kept in its place, so that a
    replay digests them again with its own ids): read just before the call (one saga at a time: nothing else moves
    them), checked against the digest sent."""
    from ledger.engine import runsteps

    with connection.connection.cursor() as cursor:  # the driver's own cursor: not recorded
        cursor.execute(runsteps.GUARD_SQL, [run_id])
        pairs = cursor.fetchall()
    assert digest(pairs).obj == sent.obj, "the run's steps are not those the call's guard digested"
    return pairs


def _text(value):
    """Arguments as the statements cast them: JSON as its text (serialized before the clock starts)."""
    return json.dumps(value.obj) if isinstance(value, Jsonb) else value


class Replay:
    def __init__(self, statements: list[tuple[str, str, list]]):
        self.statements = statements
        self.conn = psycopg.connect(psycopg_url(BENCH_DB), autocommit=True)
        self.serial = 0
        self.old = {table: [] for table in SEQUENCES}  # every id the recorded saga wrote, by table, in order
        for kind, _, params in statements:
            spec = SPEC[kind]
            for at, table in spec.get("rows", {}).items():
                row = params[at].obj if isinstance(params[at], Jsonb) else None
                if row and row["id"] not in self.old[table]:
                    self.old[table].append(row["id"])

    @property
    def commits(self) -> int:
        return sum(1 for kind, _, _ in self.statements if kind.startswith("unwind_"))

    def _ids(self, table: str, count: int) -> list[int]:
        return [row[0] for row in self.conn.execute(
            f"SELECT nextval(pg_get_serial_sequence('{SEQUENCES[table]}', 'id')) FROM generate_series(1, %s)",
            [count])]

    def prepare(self, count: int) -> list[list[tuple[str, list]]]:
        """`count` sagas' statements with fresh ids, keys and lease, every argument serialized."""
        drawn = {table: self._ids(table, len(old) * count) for table, old in self.old.items() if old}
        lease = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=10)
        sagas = []
        for n in range(count):
            self.serial += 1
            new = {table: dict(zip(old, drawn[table][len(old) * n:len(old) * (n + 1)]))
                   for table, old in self.old.items() if old}
            sagas.append([(sql, [_text(p) for p in self._fresh(kind, params, new, lease)])
                          for kind, sql, params in self.statements])
        return sagas

    def _fresh(self, kind: str, params: list, new: dict, lease) -> list:
        spec, params = SPEC[kind], list(params)
        for at, table in spec.get("ids", {}).items():
            if params[at] is not None:
                params[at] = new[table][params[at]]
        if "steps" in spec and params[spec["steps"]] is not None:  # (None: a decision that read no step)
            params[spec["steps"]] = digest((new["action"][i], status) for i, status in params[spec["steps"]])
        if "lease" in spec and params[spec["lease"]] is not None:
            params[spec["lease"]] = lease
        if "key" in spec:
            params[spec["key"]] = f"{params[spec['key']]}~{self.serial}"  # as in the row
        for at, value in enumerate(params):
            if not (isinstance(value, Jsonb) and isinstance(value.obj, dict)):
                continue
            row = dict(value.obj)
            if at in spec.get("rows", {}):
                row["id"] = new[spec["rows"][at]][row["id"]]
            for name, table in ROW_KEYS.items():
                if row.get(name) is not None:
                    row[name] = new[table][row[name]]
            for name in ("idempotency_key", "open_key"):
                if row.get(name):
                    row[name] = f"{row[name]}~{self.serial}"
            params[at] = Jsonb(row)
        return params

    def saga(self, statements: list[tuple[str, list]]) -> None:
        for sql, params in statements:
            rows = self.conn.execute(sql, params, prepare=True).fetchall()
            if sql.startswith("SELECT CASE WHEN"):
                answer = rows[0][0]
                outcome = answer if isinstance(answer, str) else answer["outcome"]
                assert outcome == "ok", (_kind(sql), answer)
            else:
                assert rows, f"{_kind(sql)} found nothing"

    def close(self) -> None:
        self.conn.close()


def measure(n: int, *, rounds: int = 10, warmup: int = 10) -> dict:
    """Each saga replayed, the floor's and the engine's, by turns in `rounds`."""
    from bench.engine import Saga, tenant_with_tools
    from bench.pgfloor import Floor

    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 200_000
    for i in range(warmup):
        saga.onboard(base - 1000 + i, False)
        saga.onboard(base - 2000 + i, True)
    floor = Floor(psycopg_url(BENCH_DB))
    result = {}
    try:
        for case, fail in (("ok", False), ("fail", True)):
            replay = Replay(record(saga, base - 1 - fail, fail))
            for statements in replay.prepare(warmup):
                replay.saga(statements)
            floor.timed(replay.commits, warmup)
            times = {"replay": [], "floor": [], "engine": []}
            per_round = max(1, n // rounds)
            try:
                for r in range(rounds):
                    for statements in replay.prepare(per_round):
                        started = time.perf_counter()
                        replay.saga(statements)
                        times["replay"].append(time.perf_counter() - started)
                    times["floor"] += floor.timed(replay.commits, per_round)
                    for i in range(per_round):
                        started = time.perf_counter()
                        saga.onboard(base + (500_000 if fail else 0) + r * per_round + i, fail)
                        times["engine"].append(time.perf_counter() - started)
            finally:
                replay.close()
            result[case] = {name: summary(values) for name, values in times.items()}
            result[case].update(commits=replay.commits, statements=len(replay.statements))
    finally:
        floor.close()
    return result
