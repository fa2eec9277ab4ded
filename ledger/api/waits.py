"""Waiting for a step's outcome without holding a web worker: `GET /api/v1/actions/{id}/wait` and MCP's
`unwind_status {wait}`.

A wait ends when its step settles (`selectors.actions_settled`) or its timeout runs out. Two things keep one agent's
waits from taking the server from everyone else (issue 39):

- **A wait is not a worker, nor a thread.** Under the production command (an ASGI server, docs/production.md) the
  request's thread does the checks (who calls, which step, a slot) and the view returns a `pending` placeholder,
  which the middleware see as any response; then (config/asgi.py, `answered_on_loop`) the request's connection is
  closed and its thread ended, the event loop waits on a future, and a lane (one of LANES threads per process)
  makes the answer. An open wait costs its coroutine and its socket, whatever their number. One task per web
  process (`Watcher`) asks the database every POLL_INTERVAL which of the steps its waits are on have settled, in
  one query on a connection of its own, and wakes those waits. Under a WSGI server (`manage.py runserver`, `make
  demo`, the test client) there is no event loop to wait on: the request's thread polls, as it always did.
- **Each caller has a bound.** An agent key (or a person) may have UNWIND_MAX_WAITS_PER_AGENT waits open at once,
  each holding a numbered slot in the database (`WaitSlot`), so every web process on every machine counts the same
  ones; one more answers 429 `too_many_waits` with Retry-After, and nothing else happens. A slot is taken by
  inserting a free number or by a conditional UPDATE of one whose `until` has passed (the row count says who won),
  and given back when the wait ends (its `until` set in the past); a process killed mid-wait leaves slots that free
  themselves at their `until`.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import random
import secrets
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Callable

from asgiref.sync import SyncToAsync, sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.exception import response_for_exception
from django.db import IntegrityError, close_old_connections, connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from ledger.api import selectors
from ledger.api.problems import DatabaseUnavailableMiddleware
from ledger.engine.leases import db_now
from ledger.errors import UnwindError
from ledger.models import WaitSlot

log = logging.getLogger("unwind.api")
POLL_INTERVAL = 0.05  # how often a web process asks which of its waits' steps settled (one query for all of them)
SLOT_GRACE = timedelta(seconds=5)  # a slot outlives its wait by this much at most: the answer is still being written
FREE = datetime(2000, 1, 1, tzinfo=dt_timezone.utc)  # a given-back slot's `until`


class TooManyWaits(UnwindError):
    code, status, title = "too_many_waits", 429, "Too many waits open"


# --- the bound: slots in the database --------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    holder: str
    number: int
    token: str


def holder_of(caller) -> str:
    """Whose waits count together: an agent key's, or a person's (a caller of the API or of MCP)."""
    return f"agent:{caller.agent_id}" if caller.agent_id is not None else f"user:{caller.user.pk}"


def wait_slot_take(*, holder: str, seconds: float) -> Slot:
    """One of `holder`'s UNWIND_MAX_WAITS_PER_AGENT slots, for a wait of up to `seconds`; TooManyWaits (429, with
    retry_after: when the first of its waits ends at the latest) when every one is taken."""
    limit = settings.UNWIND_MAX_WAITS_PER_AGENT
    now = db_now()
    until = now + timedelta(seconds=seconds) + SLOT_GRACE
    token = secrets.token_hex(16)
    held = dict(WaitSlot.objects.filter(holder=holder, number__lt=limit).values_list("number", "until"))
    start = random.randrange(limit)  # a holder's concurrent takers try different numbers first
    order = (*range(start, limit), *range(start))
    for number in (n for n in order if n in held and held[n] <= now):  # rows given back, or left by a lost process
        if WaitSlot.objects.filter(holder=holder, number=number, until__lte=now).update(until=until, token=token):
            return Slot(holder, number, token)
    for number in (n for n in order if n not in held):
        try:
            with transaction.atomic():
                WaitSlot.objects.create(holder=holder, number=number, until=until, token=token)
            return Slot(holder, number, token)
        except IntegrityError:
            continue  # another wait took this number meanwhile
    live = [ends for ends in held.values() if ends > now]
    retry_after = max(1, math.ceil((min(live) - now).total_seconds())) if live else 1
    who = "this agent key already has" if holder.startswith("agent:") else "you already have"
    raise TooManyWaits(f"{who} {limit} waits open, the most UNWIND_MAX_WAITS_PER_AGENT allows, so this one was not "
                       "started and nothing was done. Ask again once one of them has ended (Retry-After), or read the "
                       "action as it stands without waiting.", limit=limit, retry_after=retry_after)


def wait_slot_release(slot: Slot) -> None:
    """Give the slot back, if it is still this wait's (after its `until`, another wait may hold the number): its
    row stays, free, for the holder's next wait."""
    WaitSlot.objects.filter(holder=slot.holder, number=slot.number, token=slot.token).update(until=FREE)


# --- waiting in a thread (WSGI) ------------------------------------------------------------------------------

def served_async(request) -> bool:
    """Whether the request came through the ASGI server, where the event loop does the waiting (a DRF request wraps
    Django's)."""
    return isinstance(getattr(request, "_request", request), ASGIRequest)


def poll_until_settled(action_id: int, deadline: float) -> bool:
    """Under WSGI: poll in the request's thread until the step settled (True) or `deadline` (time.monotonic())."""
    settled = selectors.action_settled(action_id)
    while not settled and time.monotonic() < deadline:
        time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
        settled = selectors.action_settled(action_id)
    return settled


# --- waiting on the event loop (ASGI) ------------------------------------------------------------------------

# The threads that do a wait's database work under ASGI, each keeping its connection between waits (CONN_MAX_AGE),
# as a WSGI worker's thread does: what 200 waits ending at once ask of the database queues here, on LANES
# connections per web process, instead of opening 200 (PostgreSQL refuses connections past max_connections).
LANES = 4
_lanes = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="unwind-wait")
# And one thread per web process asks which steps settled, for every wait of the process; its connection is closed
# when nobody waits.
_poller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unwind-waits-poll")


def _in_lane(work, *args, **kwargs):
    close_old_connections()  # none past CONN_MAX_AGE, none left broken
    try:
        return work(*args, **kwargs)
    finally:
        close_old_connections()


def in_lane(work):
    """`work` (synchronous, using the database) as a coroutine function that runs it in one of the LANES."""
    return sync_to_async(functools.partial(_in_lane, work), thread_sensitive=False, executor=_lanes)


def _settled_among(action_ids: list[int]) -> set[int]:
    try:
        return selectors.actions_settled(action_ids)
    except Exception:
        connections.close_all()  # never ask on a connection that failed: the next poll opens another
        raise


class Watcher:
    """The waits of one event loop (a web process), each a future woken when its step settles."""

    def __init__(self):
        self.waiting: dict[int, set[asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    async def until_settled(self, action_id: int, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.setdefault(action_id, set()).add(future)
        if self.task is None:
            # Not in the first waiter's context: that request's thread-sensitive executor ends with it.
            self.task = loop.create_task(self.watch(), context=contextvars.Context())
        try:
            return await asyncio.wait_for(future, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        finally:
            futures = self.waiting.get(action_id)
            if futures is not None:
                futures.discard(future)
                if not futures:
                    del self.waiting[action_id]

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                await asyncio.sleep(POLL_INTERVAL)
                if not self.waiting:
                    break
                try:
                    settled = await loop.run_in_executor(_poller, _settled_among, list(self.waiting))
                except Exception:  # noqa: BLE001 - a database that does not answer: waits run out and are answered
                    log.warning("could not ask which waited-on steps settled; asking again", exc_info=True)
                    continue
                for action_id in settled:
                    for future in self.waiting.pop(action_id, ()):
                        if not future.done():
                            future.set_result(True)
        finally:
            self.task = None
            loop.run_in_executor(_poller, connections.close_all)


_watchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop → its Watcher


async def until_settled(action_id: int, deadline: float) -> bool:
    """Wait on the event loop until the step settled (True) or `deadline` (time.monotonic()) passed (False)."""
    loop = asyncio.get_running_loop()
    watcher = _watchers.get(loop)
    if watcher is None:
        watcher = _watchers[loop] = Watcher()
    return await watcher.until_settled(action_id, deadline)


@dataclass
class Pending:
    """A wait the request's thread agreed to (its slot taken): the loop waits, then `answer(settled)` answers in a
    lane."""

    action_id: int
    deadline: float
    slot: Slot
    answer: Callable[[bool], HttpResponseBase]
    request: HttpRequest | None = None  # set by config.asgi.Handler: what an answer that fails is made for

    def answered(self, settled: bool) -> HttpResponseBase:
        wait_slot_release(self.slot)
        return self.answer(settled)


def pending(*, action_id: int, deadline: float, slot: Slot, answer: Callable[[bool], HttpResponseBase]) -> HttpResponse:
    """What a view returns, under the ASGI server, to have the step waited for once the request's synchronous code
    is done (`answered_on_loop`) and then answered by `answer`."""
    response = HttpResponse(status=202)
    response.pending = Pending(action_id, deadline, slot, answer)
    return response


# What the answer to a wait takes from its placeholder: the headers the middleware added (security, CSP, framing,
# Vary), not those that describe a body.
BODY_HEADERS = {"content-length", "content-type"}


async def answered_on_loop(placeholder: HttpResponseBase) -> HttpResponseBase:
    """Wait for the step of a `pending` response on the event loop, then answer it (config/asgi.py calls this as it
    sends the response of a request whose view returned one). The request's synchronous code, its middleware
    included, ran to its end before: the request holds no thread and no database connection while it waits, only
    its coroutine and its socket. The answer is made in a lane and takes the headers and cookies the middleware gave
    the placeholder."""
    wait: Pending = placeholder.pending
    await sync_to_async(connections.close_all)()  # in the request's own thread, which opened them
    let_go_of_the_request_thread()
    try:
        settled = await until_settled(wait.action_id, wait.deadline)
    except BaseException:
        await in_lane(wait_slot_release)(wait.slot)  # the client left (Django cancels the request's task)
        raise
    try:
        answer = await in_lane(wait.answered)(settled)
    except Exception as error:  # noqa: BLE001 - answered as the view's own exception would have been
        answer = await in_lane(unanswered)(wait.request, error)
    if hasattr(answer, "render") and not getattr(answer, "is_rendered", True):
        answer = await in_lane(answer.render)()
    for name, value in placeholder.items():
        if name.lower() not in BODY_HEADERS and not answer.has_header(name):
            answer[name] = value
    for name, cookie in placeholder.cookies.items():
        answer.cookies.setdefault(name, cookie)
    if not answer.streaming:
        answer["Content-Length"] = str(len(answer.content))
    return answer


def unanswered(request, error: Exception) -> HttpResponseBase:
    """The answer to a wait whose answer failed, the middleware having run already: a database that stopped
    answering is 503 with Retry-After, as for any request (ledger/api/problems.py); anything else what Django
    answers a view's exception."""
    return DatabaseUnavailableMiddleware(None).process_exception(request, error) \
        or response_for_exception(request, error)


def let_go_of_the_request_thread() -> None:
    """Before an ASGI request waits: give up the thread that ran its synchronous code (its middleware's and view's),
    so that an open wait holds no thread at all.

    The production handler (config/asgi.py) runs each request on a `RequestLane`: the thread goes back to the
    process's idle request threads now, and what the request still runs after the wait (closing the response:
    `request_finished`) takes one again for the moment it runs. Django's own handler starts a thread for the request
    that would live, idle, until the request ends: its work is done and its database connections are closed, so it
    is ended now, and the call after the wait starts another."""
    context = SyncToAsync.thread_sensitive_context.get(None)
    if context is None:
        return
    executor = SyncToAsync.context_to_thread_executor.get(context)
    let_go = getattr(executor, "let_go", None)  # a RequestLane (config/request_threads.py, above the ledger)
    if let_go is not None:
        let_go()
        return
    executor = SyncToAsync.context_to_thread_executor.pop(context, None)
    if executor is not None:
        executor.shutdown(wait=False)


def wait_started() -> None:
    """Called by a view before it hands a streamed wait to the event loop (MCP's progress events): the thread's
    connection is not held while the loop waits."""
    connections.close_all()
