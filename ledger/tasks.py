"""django-q2 tasks: thin wrappers that take ids and call the service of the same name.

Each starts on a database connection that works (`fresh_connections`): a worker keeps its connection between tasks
(`?conn_max_age=` on DATABASE_URL), and after PostgreSQL restarts, or a pooler or an administrator ends it, the next
task would die on its first statement, leaving its claimed step to wait out a whole lease before the sweep takes
it over.
"""
import functools

from django.conf import settings
from django.db import close_old_connections, connections

from ledger import tracing
from ledger.engine import execution, sweep as sweeping


def fresh_connections(task):
    """Before the task: Django's `close_old_connections` (connections past their age, or left broken by an error), then
    each connection still open is asked whether it works (`is_usable`, one round trip) and closed if not, so the
    task's first statement opens a new one. A connection ended from the server's side since the last task shows no
    error until it is used, which is why the first step alone is not enough. A task run in its caller's context
    (django-q2's `sync`, the tests) leaves the caller's connection alone, as django-q2 does."""
    @functools.wraps(task)
    def wrapped(*args, **kwargs):
        if not settings.Q_CLUSTER.get("sync"):
            close_old_connections()
            for connection in connections.all(initialized_only=True):
                if connection.connection is not None and not connection.is_usable():
                    connection.close()
        return task(*args, **kwargs)
    return wrapped


@fresh_connections
@tracing.task("unwind.worker execute_action", "unwind.action.id")
def execute_action(action_id: int, owner: str) -> str:
    action = execution.execute(action_id, owner=owner)
    if action.kind == "forward":
        action.run.refresh_from_db()
        if action.run.status == "unwinding":
            execution.unwind(action.run_id)
    return action.status


@fresh_connections
@tracing.task("unwind.worker unwind_run", "unwind.run.id")
def unwind_run(run_id: int) -> str:
    return execution.unwind(run_id).status


@fresh_connections
def sweep() -> dict:
    return sweeping.sweep()
