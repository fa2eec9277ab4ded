"""Count queries and durable commits (transactions that wrote) on the default connection."""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.db import connection, transaction

WRITES = ("INSERT", "UPDATE", "DELETE")
# Every call of the engine's functions is `fastpath.call_statement`'s `SELECT CASE WHEN <guard> THEN
# public.unwind_<name>(...) END`: matched by that shape, not by a list of names, which once missed a renamed writer
# (unwind_outcome) and counted an ok saga's 8 commits as 5, and the floor's with it (tests/test_bench_counting.py).
FASTPATH = re.compile(r"\bTHEN public\.unwind_\w+\(")


@dataclass
class Counts:
    queries: int = 0
    writes: int = 0
    commits: int = 0
    statements: list = field(default_factory=list)
    _pending: bool = False

    def _committed(self):
        self._pending = False
        self.commits += 1


@contextmanager
def counting(keep_sql: bool = False):
    counts = Counts()

    def wrapper(execute, sql, params, many, context):
        counts.queries += 1
        head = sql.lstrip()[:6].upper()
        # A call of one of the engine's functions (ledger/engine/fastpath.py) is a whole transaction that writes.
        writes = head in WRITES or "FOR UPDATE" in sql.upper() or "FOR NO KEY UPDATE" in sql.upper() \
            or FASTPATH.search(sql) is not None
        if keep_sql:
            counts.statements.append(sql[:160])
        result = execute(sql, params, many, context)
        if head in WRITES:
            counts.writes += 1
        if writes:
            if not connection.in_atomic_block:
                counts.commits += 1
            elif not counts._pending:
                counts._pending = True
                transaction.on_commit(counts._committed)
        return result

    with connection.execute_wrapper(wrapper):
        yield counts
