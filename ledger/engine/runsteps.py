"""What a proposal decides from the run's steps, written once, in Python, for both databases.

The same-content match (one effect per logical action), the ordering law's conflict (`policy/law`) and the held
steps a proposal must wait for are decided here from a list of the run's actions (`Seen`): on the Python path from
the list read under the run's lock (`read`), on PostgreSQL's one-call proposal from the list the process holds
(kept on the Run it proposes with, or read just before), which the call then checks under its locks is still the
run's (a digest of each action's id and status, in order: `guard`) and answers 'stale' otherwise. The SQL holds none
of these rules: it compares and writes.
"""
from __future__ import annotations

import datetime as dt
import hashlib
from functools import lru_cache
from typing import NamedTuple

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ledger.db import sql
from ledger.engine import attempts
from ledger.models import ActionClass, ActionKind, ActionStatus as A, Run, Tool
from ledger.policy.law import held_roles_it_must_wait_for, roles_it_may_not_follow

# A forward step a new proposal with the same content matches: it took effect, or may still (guarantee 1 across
# keys). A failed, rejected, expired, skipped or compensated step did nothing that stands, so it may be tried again.
CONTENT_IN_FLIGHT = (A.PLANNED, A.AWAITING_APPROVAL, A.APPROVED, A.RUNNING, A.RETRY_SCHEDULED, A.HELD)
CONTENT_MATCHES = (A.SUCCEEDED, *CONTENT_IN_FLIGHT)

GONE = (A.REJECTED, A.EXPIRED, A.SKIPPED)  # steps that never ran: the ordering law does not count them


class Seen(NamedTuple):
    """An action of the run as a proposal decides from it. Everything but `status`, `error_class` (set with the
    status) and `next_attempt_at` (a held step's) is written once, when the action is recorded. A tuple: a proposal
    reads every step of its run, and a frozen dataclass took 4× as long to build (1.0 ms for 1,000 steps)."""

    pk: int
    seq: int
    kind: str
    status: str
    content_key: str
    saga_role: str
    error_class: str
    tool_name: str
    action_class: str
    next_attempt_at: object = None


COLUMNS = ("a.id, a.seq, a.kind, a.status, a.content_key, a.saga_role, a.error_class, t.name, t.action_class,"
           " a.next_attempt_at")


def read(run_id: int) -> list[Seen]:
    """Every action of the run, in order, in one statement."""
    return [Seen(*row) for row in sql.fetch_all(
        f"SELECT {COLUMNS} FROM ledger_action a JOIN ledger_tool t ON t.id = a.tool_id WHERE a.run_id = %s"
        " ORDER BY a.seq", [run_id])]


@lru_cache(maxsize=None)
def _run_with_steps_sql() -> tuple[str, int]:
    """The run's row (part 0) then its steps (part 1) in one result, each padded with NULLs to the other's columns:
    a join would repeat the run's ~22 columns (and decode its JSON ones) on every step's row, several times the cost
    of the steps themselves at 10-20 steps. Column types come from the table on both databases, as in `read`."""
    columns, count = sql.columns(Run, "r")
    return (f"SELECT 0, {columns}, {', '.join(['NULL'] * len(COLUMNS.split(',')))} FROM ledger_run r WHERE r.id = %s"
            f" UNION ALL SELECT 1, {', '.join(['NULL'] * count)}, {COLUMNS} FROM ledger_action a"
            f" JOIN ledger_tool t ON t.id = a.tool_id WHERE a.run_id = %s ORDER BY 1, {count + 3}"), count


def run_with_steps(run_id: int) -> tuple[Run | None, list[Seen]]:
    """The run and every action of it, in order, in one statement (the steps kept on the run: `keep`)."""
    statement, count = _run_with_steps_sql()
    rows = sql.fetch_all(statement, [run_id, run_id])
    if not rows or rows[0][0] != 0:
        return None, []
    run = sql.instance(Run, rows[0][1:count + 1])
    steps = [Seen(*row[count + 1:]) for row in rows[1:]]
    keep(run, steps)
    return run, steps


# --- kept on the Run in hand: the one-call proposal decides from them, and the call checks them ------------------

def keep(run: Run, steps: list[Seen] | None) -> None:
    run._steps_seen = steps


def kept(run: Run) -> list[Seen] | None:
    return getattr(run, "_steps_seen", None)


def moved(run: Run, pk: int, status: str) -> None:
    """One kept step's new status, as a one-call write recorded it."""
    steps = kept(run)
    if steps is not None:
        keep(run, [s._replace(status=status) if s.pk == pk else s for s in steps])


# A run's actions as its guard names them, (id, status) in order: what a writer digests under its lock.
GUARD_SQL = "SELECT a.id, a.status FROM ledger_action a WHERE a.run_id = %s ORDER BY a.seq"


def guard_now(run_id: int) -> str:
    """`guard` of the run's actions as they stand now (the Python writers call it under the run's lock), reading only
    the two columns it digests."""
    return digest(sql.fetch_all(GUARD_SQL, [run_id]))


def guard(steps: list[Seen]) -> str:
    """What a writer compares with the run's actions under its locks (`unwind_run_steps` on PostgreSQL): a digest of
    [id, status] of each, in order (`digest`), so that what is sent and compared does not grow with the run
    (bench/README.md, long runs)."""
    return digest((s.pk, s.status) for s in steps)


def digest(pairs) -> str:
    """The SHA-256 of "id:status" of each (id, status) pair, joined by ",", in hex: what `unwind_run_steps` computes."""
    return hashlib.sha256(",".join(f"{pk}:{status}" for pk, status in pairs).encode()).hexdigest()


# --- the rules ----------------------------------------------------------------------------------------------------

def same_content(steps: list[Seen], content_key: str) -> Seen | None:
    """The newest step of the run with this content that succeeded or is in flight (`CONTENT_MATCHES`), or None; a
    read-only call ("" content) matches nothing."""
    if not content_key:
        return None
    found = [s for s in steps if s.content_key == content_key and s.status in CONTENT_MATCHES]
    return found[-1] if found else None


def order_conflicts(steps: list[Seen], tool: Tool) -> list[tuple[int, str, str]]:
    """The earliest earlier step that `law.check_order` would refuse `tool` after, if any, as (seq, tool, role).

    Only a step of a later saga role (or a second pivot) can break the ordering law, and the law names the first.
    A step that never ran (`GONE`), one its tool refused and a read-only one are no earlier step."""
    roles = roles_it_may_not_follow(tool)
    for s in steps:
        if s.kind == ActionKind.FORWARD and s.saga_role in roles and s.status not in GONE \
                and not (s.status == A.FAILED and s.error_class == attempts.REFUSED) \
                and s.action_class != ActionClass.READ_ONLY:
            return [(s.seq, s.tool_name, s.saga_role)]
    return []


def held_it_waits_for(steps: list[Seen], tool: Tool) -> list[tuple[int, str, str, str]]:
    """The run's held steps of a role `tool` must wait for (law.held_roles_it_must_wait_for), earliest first."""
    roles = held_roles_it_must_wait_for(tool)
    return [(s.seq, s.tool_name, s.saga_role, when_it_runs(s.next_attempt_at)) for s in steps
            if s.kind == ActionKind.FORWARD and s.status == A.HELD and s.saga_role in roles]


def any_held(steps: list[Seen]) -> bool:
    return any(s.status == A.HELD for s in steps)


def when_it_runs(when) -> str:
    """A held step's time as a person reads it (SQLite hands the column back as text)."""
    if isinstance(when, str):
        when = parse_datetime(when)
    if when is None:
        return "its window ends"
    if timezone.is_naive(when):
        when = timezone.make_aware(when, dt.timezone.utc)
    return f"{when.astimezone(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
