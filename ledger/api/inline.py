"""The fast path: run a claimed action inside the API request, for at most a bounded wait.

Agents wait on each tool result, so an action that needs no approval is executed right away in a
thread of this process while the request waits up to UNWIND_INLINE_WAIT seconds. If the tool
outlives the wait, the request answers 202 and the thread carries on and records the outcome; if
this process dies meanwhile, the action's lease expires and the worker's sweep reclaims it with the
same idempotency key. A step that fails before the pivot starts the unwind, which this thread also
drives within what is left of the wait (the worker queue has it too; the run's lease keeps it to one).

Fair share: the pool is shared by every tenant, so one tenant's slow tools could hold all its threads
and make every other tenant's proposals queue behind them. Each tenant may hold at most
UNWIND_INLINE_TENANT_SHARE of the pool (default 0.5: half the threads) at once in this process; a
tenant at its share has its next step handed to the worker (the proposal answers 202, as after a
long inline wait) instead of waiting for a thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitExpired
from contextlib import contextmanager

from django.conf import settings
from django.db import close_old_connections

from ledger.models import Action, ActionStatus, Run, RunStatus
from ledger.engine import execution, unwinding
from ledger.engine.dispatch import enqueue

log = logging.getLogger("unwind.api")
THREADS = 32
_pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="unwind-inline")
LATE = object()  # what `_within` answers for work still going on after the wait


# --- fair share ----------------------------------------------------------------------------------------------

_held_lock = threading.Lock()
_held: dict[int, int] = {}  # tenant id → pool work of that tenant submitted and not finished, in this process


def tenant_cap() -> int:
    """How many pool threads one tenant may hold at once: its share of the pool, at least one."""
    return max(1, int(settings.UNWIND_INLINE_TENANT_SHARE * THREADS))


def held_by(tenant_id: int) -> int:
    with _held_lock:
        return _held.get(tenant_id, 0)


class Slot:
    """One of a tenant's places in the pool, from before its work is submitted until the work ends."""

    def __init__(self, tenant_id: int):
        self.tenant_id = tenant_id
        self.in_pool = False  # once submitted, the pool thread gives the place back when the work ends
        self._released = False

    def release(self) -> None:
        with _held_lock:
            if self._released:
                return
            self._released = True
            left = _held[self.tenant_id] - 1
            if left:
                _held[self.tenant_id] = left
            else:
                del _held[self.tenant_id]


@contextmanager
def tenant_slot(tenant_id: int) -> Iterator[Slot | None]:
    """A place in the pool for this tenant, or None when the tenant already holds its share.

    The place is given back on leaving the block, unless work was submitted with it (`execute_within`,
    `unwind_within`): then it is given back when that work ends, which may be long after the answer.
    """
    with _held_lock:
        if _held.get(tenant_id, 0) >= tenant_cap():
            slot = None
        else:
            _held[tenant_id] = _held.get(tenant_id, 0) + 1
            slot = Slot(tenant_id)
    try:
        yield slot
    finally:
        if slot is not None and not slot.in_pool:
            slot.release()


def hand_to_worker(claimed: Action, *, owner: str) -> None:
    """Queue a step claimed for a worker (not held: see `new_owner`) instead of running it here."""
    log.info("tenant %s holds its share of the inline pool: action %s goes to the worker", claimed.tenant_id,
             claimed.pk)
    enqueue("ledger.tasks.execute_action", claimed.pk, owner)


# --- the pool ----------------------------------------------------------------------------------------------------

def _log_failure(future: Future) -> None:
    error = future.exception()
    if error is not None:
        log.error("inline execution failed; the sweep will pick the work up", exc_info=error)


def _within(slot: Slot, wait: float, work, *args):
    """Run `work(deadline, *args)` in the pool; its answer if it finished within `wait` seconds, else `LATE`. The pool
    thread gives the tenant's `slot` back when the work ends."""
    slot.in_pool = True
    try:
        future = _pool.submit(_closing, slot, work, time.monotonic() + wait, *args)
    except BaseException:
        slot.release()  # never submitted (the pool is shutting down): nothing will give it back
        raise
    future.add_done_callback(_log_failure)
    try:
        return future.result(timeout=wait)
    except WaitExpired:
        return LATE
    except Exception:  # noqa: BLE001 - logged by _log_failure; the answer is whatever the ledger now records
        return None


def _closing(slot: Slot, work, deadline: float, *args):
    """Run in a pool thread, which keeps its database connection between actions as a request thread does:
    up to CONN_MAX_AGE (`?conn_max_age=` on DATABASE_URL), and never one left broken by an error."""
    try:
        close_old_connections()
        try:
            return work(deadline, *args)
        finally:
            close_old_connections()  # this thread's connections only: they are per thread
    finally:
        slot.release()


def _execute_then_unwind(deadline: float, claimed: Action, owner: str) -> Action | None:
    """Execute, then drive the unwind a failure started. The executed action when it ends succeeded: its run is then
    as the transaction that recorded the success left it (`outcomes.record_success`), so the answer needs no
    second read."""
    action = execution.execute(claimed.pk, owner=owner, budget=max(0.0, deadline - time.monotonic()), sole_owner=True,
                               claimed=claimed)
    if action.status == ActionStatus.SUCCEEDED and Action.run.is_cached(action) \
            and action.run.status != RunStatus.UNWINDING:
        return action  # nothing to unwind (a cancel that comes later unwinds on its own)
    _unwind_if_needed(deadline, action.run_id)
    return None


def _unwind_if_needed(deadline: float, run_id: int) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        unwinding.unwind_elsewhere(run_id)
        return
    tenant_id = Run.objects.filter(pk=run_id, status=RunStatus.UNWINDING).values_list("tenant_id", flat=True).first()
    if tenant_id is not None:
        execution.unwind(run_id, budget=remaining, tenant_id=tenant_id)


def execute_within(claimed: Action, *, owner: str, wait: float, slot: Slot) -> Action | None:
    """Execute an action this request claimed (and the unwind its failure starts) with the tenant's `slot`. The
    action, with its run, when it succeeded within `wait`; otherwise None: the ledger says how it stands."""
    done = _within(slot, wait, _execute_then_unwind, claimed, owner)
    return None if done is LATE else done


def unwind_within(run_id: int, *, tenant_id: int, wait: float) -> bool:
    """Drive a run's unwind for up to `wait` seconds (after an agent reported a failure or a compensation).
    A tenant at its share of the pool leaves it to the worker, which has it queued already."""
    with tenant_slot(tenant_id) as slot:
        if slot is None:
            return False
        return _within(slot, wait, _unwind_if_needed, run_id) is not LATE
