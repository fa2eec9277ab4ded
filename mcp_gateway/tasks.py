"""A step that waits for a person, as an MCP task (the Tasks extension, `io.modelcontextprotocol/tasks`, 2026-07-28).

When a 2026-07-28 client declares the extension in its request's capabilities, a tools/call whose step waits (for an
approval, or held in an undo window) answers a task handle instead of today's pending result: `input_required` while
a person must approve (the approval happens on Unwind's pages, not in the client: the status message names the
approval page, and `inputRequests` asks the client to open it only when the person the tenant maps to the agent may
decide it, `approval_page_requests`), `working` while the step is held or still running. `tasks/get` answers the step as it stands: `completed` with the tool's result (a rejection or a
failure is a result with isError, as the spec says), or `cancelled` once the step was stopped and never executed.
`tasks/cancel` is the agent's cancel of the step's run, the same move as unwind_rollback (ledger/engine/moves.py
decides whether it is offered, and what it undoes), so a held step is never executed and, before the pivot, what the
run did is undone. `tasks/update` is acknowledged: what the client answers (the page was opened) decides nothing.

The handle is the step's id signed, with the project's secret key, together with the agent and its key that made it:
nothing is stored and any web process answers it. Another agent's key, an altered handle and an unknown step are all
answered "task not found", told apart to no one.
"""
from __future__ import annotations

from django.core import signing

from approvals.selectors import approval_for, decision_state
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
                    "inputRequests": approval_page_requests(caller, action)}
        return {**task, "status": "working", "statusMessage": answer.payload["message"]}
    if action.status == A.SKIPPED:
        who = f" by the {action.stopped_by}" if action.stopped_by else ""
        return {**task, "status": "cancelled",
                "statusMessage": f"{action.tool.name} was stopped{who} and never executed; its run is "
                                 f"{action.run.status.replace('_', ' ')}."}
    result = gateway.result_of(answer).model_dump(by_alias=True, mode="json", exclude_none=True)
    return {**task, "status": "completed", "statusMessage": answer.payload.get("message") or
            f"{action.tool.name} {action.status.replace('_', ' ')}", "result": result}


def approval_page_requests(caller: Caller, action: Action) -> dict:
    """The approval page as a URL-mode elicitation, for a step awaiting approval, when the request's client takes URL
    elicitation and the person the tenant maps to this agent (`Agent.person`) may decide it now; else none.

    The URL is the approval page itself, which asks the person to sign in and shows the exact arguments: an
    agent that reads it can do nothing with it. "Accepted" only means the page was opened."""
    agent = gateway.agent_of(caller)
    if not caller.url_elicitation or agent.person_id is None:
        return {}
    approval = gateway.approval_of(caller, action)
    person = agent.person
    found = approval_for(person, approval["id"]) if approval and person.is_active else None
    if found is None or not decision_state(found, person).can_decide:
        return {}
    message = (f"{action.tool.name} waits for your approval. Open the approval page to decide: you decide there, "
               "signed in as yourself, for exactly these arguments.")
    return {f"approval-{approval['id']}": {"method": "elicitation/create", "params": {
        "mode": "url", "message": message, "url": approval["url"]}}}


def input_required(caller: Caller, answer: Answer) -> dict | None:
    """Without the Tasks extension: for a step awaiting approval that the person at the client may decide, an
    InputRequiredResult asking the client to open the approval page (once: the client's retry carries the
    `requestState`, and is answered as the step stands, pending until the person decided on the page)."""
    agent = gateway.agent_of(caller)
    action = selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=answer.waiting)
    if action.status != A.AWAITING_APPROVAL:
        return None
    requests = approval_page_requests(caller, action)
    if not requests:
        return None
    return {"resultType": "input_required", "inputRequests": requests, "requestState": f"approval-page:{action.pk}"}


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
