"""`manage.py worker`: one django-q2 cluster plus the sweep clock, stopped together.

django-q2's own scheduler ticks about every 30 seconds, too coarse for leases and backoffs measured
in seconds, so the sweep runs here on its own clock (UNWIND_SWEEP_INTERVAL). Sweeps on several
machines at once are safe: every claim is a conditional update.
"""
import ctypes
import os
import signal
import subprocess
import sys
import threading

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections
from django.utils import timezone

from ledger.engine.sweep import next_due, sweep


class Command(BaseCommand):
    help = "Run a worker: a django-q2 cluster (qcluster) and the sweep clock, until SIGINT/SIGTERM."

    def add_arguments(self, parser):
        parser.add_argument("--no-cluster", action="store_true", help="only run the sweep clock")
        parser.add_argument("--no-sweep", action="store_true", help="only run the django-q2 cluster")

    def handle(self, *args, no_cluster=False, no_sweep=False, **options):
        stop = threading.Event()
        cluster = None
        if not no_cluster:
            # Its own process group: stopping the group stops the sentinel and every worker it forked.
            cluster = subprocess.Popen([sys.executable, "manage.py", "qcluster"], cwd=str(settings.BASE_DIR),
                                       start_new_session=True, preexec_fn=stop_when_parent_dies)

        def shutdown(signum, frame):
            stop.set()

        signal.signal(signal.SIGTERM, shutdown)
        signal.signal(signal.SIGINT, shutdown)
        self.stderr.write(f"worker: cluster={'off' if no_cluster else cluster.pid} sweep every {settings.UNWIND_SWEEP_INTERVAL}s")
        try:
            while not stop.is_set():
                wait = settings.UNWIND_SWEEP_INTERVAL
                if not no_sweep:
                    try:
                        started = timezone.now()
                        sweep()
                        wait = until_next_sweep(next_due(started), wait)
                    except Exception as exc:  # noqa: BLE001 - one failed sweep must not stop the clock
                        self.stderr.write(f"sweep failed: {exc.__class__.__name__}: {exc}")
                    finally:
                        close_old_connections()
                if cluster is not None and cluster.poll() is not None:
                    self.stderr.write(f"qcluster exited with {cluster.returncode}; stopping")
                    break
                stop.wait(wait)
        finally:
            if cluster is not None:
                stop_group(cluster)
        return None


def until_next_sweep(due, interval: float) -> float:
    """Seconds to sleep: the interval, or less when a lease ends or a retry falls due sooner, waking just after it
    (`due` is later than the sweep's start, so the sweep could not have done it; work the sweep saw and left,
    a full batch or a lost race, waits the interval: the clock never spins)."""
    if due is None:
        return interval
    ahead = (due - timezone.now()).total_seconds()
    return min(interval, max(ahead, 0.0) + JUST_AFTER)


JUST_AFTER = 0.02  # seconds past a lease's end: the sweep then finds it expired


def stop_when_parent_dies() -> None:
    """In the child, before exec: SIGTERM me if this worker dies, even by SIGKILL (Linux), so no cluster is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: a killed worker's cluster then stops when its group is stopped


PR_SET_PDEATHSIG = 1


def stop_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Ask the group's leader to stop (it shuts its own children down), then SIGKILL what is left.

    The leader alone gets SIGTERM: django-q2's sentinel coordinates its workers' shutdown, and signalling
    them directly makes them race it. After `grace` seconds the whole group is killed, so nothing the
    leader forked outlives it.
    """
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
