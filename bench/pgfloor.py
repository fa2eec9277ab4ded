"""The raw floor: the durable writes a saga needs, with plain psycopg and no framework.

As ../shared/anchors/pgfloor.py: each commit is an insert (record) or a conditional update (outcome),
alternating, so `saga(k)` costs exactly k commits, the number Unwind's saga of the same shape makes.
"""
from __future__ import annotations

import time

import psycopg


class Floor:
    def __init__(self, url: str):
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("drop table if exists floor_t")
        self.conn.execute("create table floor_t(id bigserial primary key, k text unique, status text, payload jsonb)")
        self.counter = 0

    def saga(self, commits: int) -> None:
        rid = None
        for c in range(commits):
            if c % 2 == 0:
                self.counter += 1
                rid = self.conn.execute(
                    "insert into floor_t(k,status,payload) values (%s,'planned','{}') returning id",
                    (f"k{self.counter}",)).fetchone()[0]
            else:
                self.conn.execute("update floor_t set status='succeeded' where id=%s and status='planned'", (rid,))

    def timed(self, commits: int, n: int) -> list[float]:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            self.saga(commits)
            times.append(time.perf_counter() - started)
        return times

    def close(self) -> None:
        self.conn.execute("drop table floor_t")
        self.conn.close()
