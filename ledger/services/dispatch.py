"""Queueing background work: always after commit, never from inside a transaction that may roll back."""
import os
import socket
import threading
import uuid

from django.db import transaction
from django_q.tasks import async_task


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


def new_owner() -> str:
    return f"{worker_name()}:{uuid.uuid4().hex[:8]}"


def enqueue(func: str, *args) -> None:
    transaction.on_commit(lambda: async_task(func, *args, group=func.rsplit(".", 1)[-1]))
