"""The threads that run ASGI requests' synchronous code (middleware, views), kept from one request to the next.

Django runs each ASGI request in a `ThreadSensitiveContext`, whose first synchronous call starts a thread of its own
for the request; when the request ends, another thread is started to join it. Under load that was the largest cost
of the production command's event loop (issue 40): two threads started and ended per request, and each start stops
the loop until the new thread has run (`Thread.start` waits for it). Here each request still has one thread to
itself for as long as it runs synchronous code, as Django requires (its database connections, its transaction),
but the thread comes from the process's idle ones and goes back to them after the request.

Only the event loop's thread takes and gives back threads, so the idle list needs no lock. A thread whose call
outlived its request (the client left and Django cancelled the request's task while the view ran) is not given to
anyone else: it ends once that call returns. At most IDLE_KEPT idle threads are kept; a burst past that starts
threads that end after their request, as before.
"""
from __future__ import annotations

import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

IDLE_KEPT = 16  # what one web process may serve at once at 16 agents (they are not spread evenly)


class RequestThread(ThreadPoolExecutor):
    """One thread, one call at a time, which knows whether a call is still running on it."""

    def __init__(self):
        super().__init__(max_workers=1, thread_name_prefix="unwind-request")
        self._lock = threading.Lock()
        self._calls = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self._lock:
            self._calls += 1
        future = super().submit(fn, *args, **kwargs)
        # Registered before asyncio's own callback (added when submit returns), so the count is down by the time the
        # awaiting coroutine is woken.
        future.add_done_callback(self._call_done)
        return future

    def _call_done(self, _future: Future) -> None:
        with self._lock:
            self._calls -= 1

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._calls > 0


class RequestThreads:
    """A process's idle request threads."""

    def __init__(self, kept: int = IDLE_KEPT):
        self.kept = kept
        self._idle: list[RequestThread] = []

    def take(self) -> RequestThread:
        return self._idle.pop() if self._idle else RequestThread()

    def give_back(self, thread: RequestThread) -> None:
        if thread.busy or len(self._idle) >= self.kept:
            thread.shutdown(wait=False)  # it ends when its last call returns
        else:
            self._idle.append(thread)

    def idle(self) -> int:
        return len(self._idle)


class RequestLane(Executor):
    """What one request's `ThreadSensitiveContext` runs its synchronous calls on: a thread of `threads`, taken at the
    first call and given back by `let_go` (when the request ends, or when a wait lets go of its thread: the call
    after the wait then takes one again)."""

    def __init__(self, threads: RequestThreads):
        self.threads = threads
        self.thread: RequestThread | None = None

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self.thread is None:
            self.thread = self.threads.take()
        return self.thread.submit(fn, *args, **kwargs)

    def let_go(self) -> None:
        if self.thread is not None:
            self.threads.give_back(self.thread)
            self.thread = None
