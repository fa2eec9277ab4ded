"""django-q2 tasks: thin wrappers that take ids and call the service of the same name."""
from ledger import tracing
from ledger.engine import execution, sweep as sweeping


@tracing.task("unwind.worker execute_action", "unwind.action.id")
def execute_action(action_id: int, owner: str) -> str:
    action = execution.execute(action_id, owner=owner)
    if action.kind == "forward":
        action.run.refresh_from_db()
        if action.run.status == "unwinding":
            execution.unwind(action.run_id)
    return action.status


@tracing.task("unwind.worker unwind_run", "unwind.run.id")
def unwind_run(run_id: int) -> str:
    return execution.unwind(run_id).status


def sweep() -> dict:
    return sweeping.sweep()
