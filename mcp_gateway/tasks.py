"""A step that waits for a person, as an MCP task (the Tasks extension, `io.modelcontextprotocol/tasks`, 2026-07-28).

When a 2026-07-28 client declares the extension in its request's capabilities, a tools/call whose step waits (for an
approval, or held in an undo window) answers a task handle instead of today's pending result: `input_required` while
a person must approve (the approval happens on Unwind's pages, not in the client: there is no input the client could
send, so `inputRequests` is empty and the status message names the approval page), `working` while the step is held
or still running. `tasks/get` answers the step as it stands: `completed` with the tool's result (a rejection or a
failure is a result with isError, as the spec says), or `cancelled` once the step was stopped and never executed.
`tasks/cancel` is the agent's cancel of the step's run, the same move as unwind_rollback (ledger/engine/moves.py
decides whether it is offered, and what it undoes), so a held step is never executed and, before the pivot, what the
run did is undone. `tasks/update` has nothing to take (no input is ever asked of the client) and is acknowledged.

The handle is the step's id signed, with the project's secret key, together with the agent and its key that made it:
nothing is stored and any web process answers it. Another agent's key, an altered handle and an unknown step are all
answered "task not found", told apart to no one.
"""
from __future__ import annotations

from django.core import signing

from ledger.api import selectors
from ledger.errors import NotFound, StateConflict
from ledger.models import Action, ActionStatus as A, Agent
from mcp_gateway import gateway
from mcp_gateway.gateway import Answer, Caller

EXTENSION = "io.modelcontextprotocol/tasks"
SALT = "unwind.mcp.task"
POLL_INTERVAL_MS = 1000
MAX_HANDLE = 400  # a handle is about 80 characters; anything far longer is not one of ours


class TaskNotFound(Exception):
    """The handle names no task of this agent key."""


def declared(capabilities) -> bool:
    """Whether the request's client capabilities declare the Tasks extension (per request: never inferred)."""
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and EXTENSION in extensions


def handle_for(agent: Agent, action_id: int) -> str:
    return signing.dumps({"a": agent.pk, "k": agent.key_prefix, "s": action_id}, salt=SALT, compress=False)


def action_of(agent: Agent, task_id) -> Action:
    """The step a handle names, if this agent key made it; TaskNotFound otherwise."""
    if not isinstance(task_id, str) or len(task_id) > MAX_HANDLE:
        raise TaskNotFound
    try:
        named = signing.loads(task_id, salt=SALT)
    except signing.BadSignature:
        raise TaskNotFound from None
    if not isinstance(named, dict) or named.get("a") != agent.pk or named.get("k") != agent.key_prefix or \
            not isinstance(named.get("s"), int):
        raise TaskNotFound
    try:
        return selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=named["s"])
    except NotFound:
        raise TaskNotFound from None


def stamp(value) -> str:
    return value.isoformat().replace("+00:00", "Z")


def task_of(caller: Caller, action: Action, task_id: str) -> dict:
    """The task as the step stands now: its status and, once it ended, its result (tasks/get's `DetailedTask`)."""
    action = selectors.action_reload(action)
    answer = gateway.action_answer(caller, action, fresh=True)
    task = {"taskId": task_id, "createdAt": stamp(action.created_at), "lastUpdatedAt": stamp(action.updated_at),
            "ttlMs": None, "pollIntervalMs": POLL_INTERVAL_MS}
    if answer.waiting is not None:
        if action.status == A.AWAITING_APPROVAL:
            return {**task, "status": "input_required", "statusMessage": answer.payload["message"],
                    "inputRequests": {}}
        return {**task, "status": "working", "statusMessage": answer.payload["message"]}
    if action.status == A.SKIPPED:
        who = f" by the {action.stopped_by}" if action.stopped_by else ""
        return {**task, "status": "cancelled",
                "statusMessage": f"{action.tool.name} was stopped{who} and never executed; its run is "
                                 f"{action.run.status.replace('_', ' ')}."}
    result = gateway.result_of(answer).model_dump(by_alias=True, mode="json", exclude_none=True)
    return {**task, "status": "completed", "statusMessage": answer.payload.get("message") or
            f"{action.tool.name} {action.status.replace('_', ' ')}", "result": result}


def created(caller: Caller, answer: Answer) -> dict:
    """The CreateTaskResult for a call whose step waits: the task, durable before it is answered (it is the step)."""
    agent = gateway.agent_of(caller)
    action = selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=answer.waiting)
    task = task_of(caller, action, handle_for(agent, action.pk))
    task.pop("inputRequests", None)
    return {**task, "resultType": "task"}


def cancel(caller: Caller, action: Action) -> None:
    """tasks/cancel: the agent's cancel of the step's run, while the step has not ended (StateConflict after)."""
    agent = gateway.agent_of(caller)
    if selectors.action_settled(action.pk):
        action = selectors.action_reload(action)
        raise StateConflict(f"the task's step ({action.tool.name}) already ended ({action.status.replace('_', ' ')});"
                            " there is nothing to cancel")
    gateway.cancel_as_agent(action.run, agent, "tasks/cancel over MCP")
