"""The fast path: run a claimed action inside the API request, for at most a bounded wait.

Agents wait on each tool result, so an action that needs no approval is executed right away in a
thread of this process while the request waits up to UNWIND_INLINE_WAIT seconds. If the tool
outlives the wait, the request answers 202 and the thread carries on and records the outcome; if
this process dies meanwhile, the action's lease expires and the worker's sweep reclaims it with the
same idempotency key. A step that fails before the pivot starts the unwind, which this thread also
drives within what is left of the wait (the worker queue has it too; the run's lease keeps it to one).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitExpired

from django.db import close_old_connections

from ledger.models import Action, Run, RunStatus
from ledger.services import execution

log = logging.getLogger("unwind.api")
THREADS = 32
_pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="unwind-inline")


def _log_failure(future: Future) -> None:
    error = future.exception()
    if error is not None:
        log.error("inline execution failed; the sweep will pick the work up", exc_info=error)


def _within(wait: float, work, *args) -> bool:
    """Run `work(deadline, *args)` in the pool; True if it finished within `wait` seconds."""
    future = _pool.submit(_closing, work, time.monotonic() + wait, *args)
    future.add_done_callback(_log_failure)
    try:
        future.result(timeout=wait)
    except WaitExpired:
        return False
    except Exception:  # noqa: BLE001 - logged by _log_failure; the answer is whatever the ledger now records
        return True
    return True


def _closing(work, deadline: float, *args) -> None:
    """Run in a pool thread, which keeps its database connection between actions as a request thread does:
    up to CONN_MAX_AGE (`?conn_max_age=` on DATABASE_URL), and never one left broken by an error."""
    close_old_connections()
    try:
        work(deadline, *args)
    finally:
        close_old_connections()  # this thread's connections only: they are per thread


def _execute_then_unwind(deadline: float, claimed: Action, owner: str) -> None:
    action = execution.execute(claimed.pk, owner=owner, budget=max(0.0, deadline - time.monotonic()), sole_owner=True,
                               claimed=claimed)
    _unwind_if_needed(deadline, action.run_id)


def _unwind_if_needed(deadline: float, run_id: int) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0 and Run.objects.filter(pk=run_id, status=RunStatus.UNWINDING).exists():
        execution.unwind(run_id, budget=remaining)


def execute_within(claimed: Action, *, owner: str, wait: float) -> bool:
    """Execute an action this request claimed (and the unwind its failure starts); True if it settled within `wait`."""
    return _within(wait, _execute_then_unwind, claimed, owner)


def unwind_within(run_id: int, *, wait: float) -> bool:
    """Drive a run's unwind for up to `wait` seconds (after an agent reported a failure or a compensation)."""
    return _within(wait, _unwind_if_needed, run_id)
