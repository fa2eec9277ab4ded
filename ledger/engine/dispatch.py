"""Queueing background work: always after commit, never from inside a transaction that may roll back."""
import os
import socket
import threading
import uuid

from django.db import transaction
from django_q.tasks import async_task


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


HELD = "#"


def new_owner(*, held: bool = False) -> str:
    """A lease owner. A queued claim's owner travels in its task, and the delivery that runs it takes the lease
    over under a name of its own (HELD marks it). A `held` owner belongs to a caller that executes the claim
    itself, right away (the API's fast path, the unwinder): it is never queued, so no delivery may take it."""
    return f"{worker_name()}:{uuid.uuid4().hex[:8]}" + (HELD if held else "")


def enqueue(func: str, *args) -> None:
    transaction.on_commit(lambda: async_task(func, *args, group=func.rsplit(".", 1)[-1]))
