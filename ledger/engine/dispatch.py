"""Queueing background work: always after commit, never from inside a transaction that may roll back."""
import logging
import os
import socket
import threading
import uuid

from django.db import transaction
from django_q.tasks import async_task
from redis.exceptions import RedisError

log = logging.getLogger("unwind.engine")


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


HELD = "#"


def new_owner(*, held: bool = False) -> str:
    """A lease owner. A queued claim's owner travels in its task, and the delivery that runs it takes the lease
    over under a name of its own (HELD marks it). A `held` owner belongs to a caller that executes the claim
    itself, right away (the API's fast path, the unwinder): it is never queued, so no delivery may take it."""
    return f"{worker_name()}:{uuid.uuid4().hex[:8]}" + (HELD if held else "")


def enqueue(func: str, *args) -> None:
    transaction.on_commit(lambda: _send(func, *args))


def _send(func: str, *args) -> None:
    """Queue after the commit. A broker that does not answer (Redis stopped) loses nothing: what the task would do
    is in the ledger already (a step claimed with a lease, a run left unwinding without one), and the sweep queues it
    again once the broker answers (a lease that ran out, a stalled unwind). So the request that committed it answers
    what it committed instead of a 500, which would tell the agent nothing was done (issue 39, finding 4)."""
    try:
        async_task(func, *args, group=func.rsplit(".", 1)[-1])
    except RedisError as exc:
        log.error("the broker did not take %s%r (%s): the sweep queues it again when the broker answers",
                  func, args, exc)
