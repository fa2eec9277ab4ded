"""What an MCP session does in the ledger: the synchronous half of the gateway, shared by both transports (the HTTP
endpoint calls it in the request's thread, the stdio server's SDK handlers in worker threads). The one exception is
`progress_on_loop`: `unwind_status {wait}` under the ASGI server waits on its event loop (ledger/api/waits.py).

Over the handshake revisions an MCP session is one agent's conversation; its tool calls go into one run at a time.
The run is opened on the first call (or by `unwind_begin`), completed by `unwind_commit`, cancelled and unwound by
`unwind_rollback`, and unwound by the worker's sweep once the session has been idle longer than
`UNWIND_MCP_SESSION_IDLE`. Every step is the REST API's: `action_propose`, executed inline within
`UNWIND_INLINE_WAIT` (or by the worker), with the same policy, approvals, ordering law and content matching, so a
call re-sent after a reconnect answers with the recorded outcome (the MCP request id is never an idempotency key: a
reconnecting client sends a new one).

Over 2026-07-28 (stateless, mcp_gateway/modern.py) there is no session: the run is a handle the client carries,
the `run_id` that `unwind_begin` answered, passed back as the `unwind_run` argument of a tool call or under
`dev.unwind/run` in its `_meta` (and as `run_id` to unwind_commit, unwind_rollback and unwind_status). The handle is
checked against the ledger on every call (a run of this agent), never remembered by a process.

Answers are `Answer`s: a JSON payload, and whether it is a tool error (`isError`) carrying a problem's `code`.

Longer than 500 lines: one answer per outcome of a step, in words for a model, shared by both transports; they
are read side by side to keep what an agent is told the same for every outcome.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import mcp_types as types
from django.conf import settings
from django.db import close_old_connections, connections
from django.utils import timezone

from ledger.db import sql
from ledger.engine import decision, runsteps
from ledger.api import selectors
from ledger.audit.chain import ledger_transaction
from ledger.api import inline, links, waits
from ledger.api.serializers import archived_out, erased_out
from ledger.archive import reader as archive_reader
from ledger.errors import NotFound, PermissionDenied, RunArchived, RunNotActive, StateConflict, StillInFlight, \
    UnknownTool, UnwindError, ValidationFailed
from ledger.models import ACTIVE_ACTION_STATUSES, Action, ActionKind, ActionStatus as A, Agent, \
    ApprovalRule, Executor, Run, RunStatus as R, SagaRole, Tool
from ledger.policy.law import approvals_needed
from ledger.engine.proposal import action_propose
from ledger.engine.attempts import REFUSED
from ledger.engine.runs import run_cancel, run_complete, run_open
from mcp_gateway.models import McpSession
from recovery.hold_notices import notice_of

RESERVED_PREFIX = "unwind_"
STATELESS = "stateless"  # the transport of a 2026-07-28 request: no session, the run is the client's handle
RUN_META_KEY = "dev.unwind/run"  # where a 2026-07-28 request's `_meta` carries the run handle
RUN_ARGUMENT = "unwind_run"  # or a tool call's own argument (taken out before the tool sees its arguments)
OPEN = (R.RUNNING, R.AWAITING_APPROVAL)  # a run the session may still act in
DEFAULT_GOAL = "MCP session"
DEFAULT_RUN_GOAL = "MCP run"  # a 2026-07-28 unwind_begin without a goal
MAX_STATUS_WAIT = 30.0
POLL_INTERVAL = 0.1
PROGRESS_EVERY = 1.0
ACTIVITY_GRAIN = timedelta(seconds=60)  # last_activity_at is kept to the minute: no write on every call

ROLE_WORDS = {
    SagaRole.COMPENSATABLE: "compensatable: if a later step fails, Unwind undoes it",
    SagaRole.PIVOT: "pivot: the point of no return; once it succeeds, earlier steps are no longer undone, and a run "
                    "has at most one",
    SagaRole.RETRIABLE: "retriable: comes after the pivot and is retried until it succeeds",
}


@dataclass(frozen=True)
class Caller:
    """Who is on the session: the agent its key authenticated, the session, and where links should point.

    Over HTTP the request has just authenticated the agent and read the session's row (mcp_gateway/http.py): they
    ride along in `agent` and `session` and are not read again. Over stdio they are read on every call."""

    agent_id: int
    session_id: str
    transport: str
    base_url: str
    agent: Agent | None = field(default=None, compare=False)
    session: McpSession | None = field(default=None, compare=False)
    run_handle: object = field(default=None, compare=False)  # stateless: the `_meta` run handle, as sent (hostile)
    tool: Tool | None = field(default=None, compare=False)  # stateless: the tool its Mcp-Name header named, read once
    url_elicitation: bool = field(default=False, compare=False)  # stateless: the request's client takes URL mode

    @property
    def stateless(self) -> bool:
        return self.transport == STATELESS


@dataclass
class Answer:
    """A tool result: `payload` as JSON, `is_error` for a refusal or failure, `waiting` while a step is pending."""

    payload: dict
    is_error: bool = False
    waiting: int | None = field(default=None)  # the action id a caller may wait on

    def text(self) -> str:
        return json.dumps(self.payload, indent=1, default=str, ensure_ascii=False)


def in_thread(work, *args, **kwargs):
    """Run ORM work in a worker thread: that thread's connection is closed after, so none outlives a request."""
    close_old_connections()
    try:
        return work(*args, **kwargs)
    finally:
        connections.close_all()


# --- who may use the session -----------------------------------------------------------------------------

def agent_of(caller: Caller) -> Agent:
    """The session's agent, authenticated by this request or read again on every call: a key revoked mid-session
    stops working at once."""
    if caller.agent is not None:
        return caller.agent
    agent = Agent.objects.select_related("tenant").filter(pk=caller.agent_id).first()
    if agent is None or agent.revoked_at is not None:
        raise PermissionDenied("the agent key of this session was revoked; reconnect with a valid key")
    return agent


def session_of(caller: Caller, agent: Agent) -> McpSession:
    """The session's row (over stdio created on first use); one held by another agent is never used (answered as
    missing)."""
    session = caller.session
    if session is None:
        session, _ = McpSession.objects.get_or_create(
            session_id=caller.session_id,
            defaults={"transport": caller.transport, "tenant_id": agent.tenant_id, "agent": agent})
    if session.agent_id != agent.pk:
        raise NotFound("no such MCP session")
    now = timezone.now()
    if now - session.last_activity_at >= ACTIVITY_GRAIN:
        McpSession.objects.filter(pk=session.pk).update(last_activity_at=now)
        session.last_activity_at = now
    return session


# --- tools/list ------------------------------------------------------------------------------------------

def listed_tools(agent: Agent) -> list[Tool]:
    """The tenant's current tools an MCP client can call: client-executed tools need the agent to run them and
    report (the REST API), and names starting with `unwind_` are the gateway's own."""
    return list(Tool.objects.filter(tenant_id=agent.tenant_id, is_current=True)
                .exclude(executor=Executor.CLIENT).exclude(name__startswith=RESERVED_PREFIX).order_by("name"))


def approval_words(tool: Tool, threshold: str) -> str:
    needed = approvals_needed(rule=tool.approval, risk=tool.risk, required=tool.approvals_required,
                              threshold=threshold)
    if not needed:
        return "runs without approval"
    people = "a person approves" if needed == 1 else f"{needed} people approve"
    why = "always" if tool.approval == ApprovalRule.MANUAL else f"its risk ({tool.risk}) is at the tenant's threshold"
    return f"needs approval ({why}): it waits until {people}; the result then says pending, with the approval URL"


JOINS_SESSION_RUN = "Calls join this session's run (opened on the first call; see unwind_begin)."
JOINS_HANDLE_RUN = (f"Calls join the run named by {RUN_ARGUMENT} (or {RUN_META_KEY} in _meta): the run_id unwind_begin "
                    "answered.")
RUN_HANDLE_SCHEMA = {"type": "integer", "minimum": 1,
                     "description": "The run this call joins: the run_id unwind_begin answered (Unwind takes it out "
                                    "of the arguments before the tool sees them)."}


def description_of(tool: Tool, threshold: str, *, stateless: bool = False) -> str:
    """The tool's own description, then what Unwind adds: its saga role, risk and whether approval may be needed."""
    role = "read-only: changes nothing" if tool.action_class == "read_only" else ROLE_WORDS.get(tool.saga_role,
                                                                                                  tool.saga_role)
    own = (tool.description or tool.name).strip()
    return (f"{own}\n\nThrough Unwind: saga role {role}. Risk {tool.risk}; {approval_words(tool, threshold)}. "
            f"{JOINS_HANDLE_RUN if stateless else JOINS_SESSION_RUN}")


def input_schema_of(tool: Tool, *, stateless: bool = False) -> dict:
    schema = dict(tool.args_schema or {})
    schema.setdefault("type", "object")
    if stateless:
        schema["properties"] = {**(schema.get("properties") or {}), RUN_ARGUMENT: RUN_HANDLE_SCHEMA}
    return schema


GATEWAY_TOOLS = [
    {"name": "unwind_begin",
     "description": "Start this session's run with a goal and who it is for (shown to approvers and kept in the "
                    "ledger), or continue an open run of yours (run_id). Optional: the first tool call opens a run "
                    "with a default goal. Refused while a run is open; finish it with unwind_commit or "
                    "unwind_rollback first.",
     "input_schema": {"type": "object", "additionalProperties": False, "properties": {
         "goal": {"type": "string", "maxLength": 10000, "description": "What the run is for."},
         "on_behalf_of": {"type": "string", "maxLength": 200, "description": "The person the agent acts for."},
         "run_id": {"type": "integer", "minimum": 1,
                    "description": "Instead of a new run, continue this open run of yours (e.g. after reconnecting "
                                   "in a new MCP session): calls it already made answer with their outcome."}}}},
    {"name": "unwind_commit",
     "description": "Complete this session's run: its steps stand. Refused while a step is still in flight.",
     "input_schema": {"type": "object", "additionalProperties": False, "properties": {}}},
    {"name": "unwind_rollback",
     "description": "Cancel this session's run: steps still pending are skipped and what was done is undone, newest "
                    "first (before the pivot; after it, a person is asked).",
     "input_schema": {"type": "object", "additionalProperties": False, "properties": {
         "reason": {"type": "string", "maxLength": 1000, "description": "Why, kept in the ledger."}}}},
    {"name": "unwind_status",
     "description": "The run's status and its steps. With action_id, waits up to wait seconds (at most 30) for that "
                    "step to settle, e.g. while it awaits approval, and answers with its outcome.",
     "input_schema": {"type": "object", "additionalProperties": False, "properties": {
         "action_id": {"type": "integer", "minimum": 1},
         "wait": {"type": "number", "minimum": 0, "maximum": MAX_STATUS_WAIT}}}},
]
GATEWAY_NAMES = {tool["name"] for tool in GATEWAY_TOOLS}
RUN_ID_SCHEMA = {"type": "integer", "minimum": 1, "description": "The run: the run_id unwind_begin answered."}
# Over 2026-07-28 there is no session to hold the run: unwind_begin answers its run_id, the client passes it back.
STATELESS_GATEWAY_TOOLS = [
    {"name": "unwind_begin",
     "description": "Start a run with a goal and who it is for (shown to approvers and kept in the ledger), or take "
                    "up an open run of yours (run_id). Answers the run_id: pass it with every tool call of the run "
                    f"(as {RUN_ARGUMENT}, or {RUN_META_KEY} in _meta) and to unwind_commit or unwind_rollback. A tool "
                    "call without a run is refused.",
     "input_schema": GATEWAY_TOOLS[0]["input_schema"]},
    {"name": "unwind_commit",
     "description": "Complete the run: its steps stand. Refused while a step is still in flight.",
     "input_schema": {"type": "object", "additionalProperties": False, "required": ["run_id"],
                      "properties": {"run_id": RUN_ID_SCHEMA}}},
    {"name": "unwind_rollback",
     "description": "Cancel the run: steps still pending are skipped and what was done is undone, newest first "
                    "(before the pivot; after it, a person is asked).",
     "input_schema": {"type": "object", "additionalProperties": False, "required": ["run_id"], "properties": {
         "run_id": RUN_ID_SCHEMA,
         "reason": {"type": "string", "maxLength": 1000, "description": "Why, kept in the ledger."}}}},
    {"name": "unwind_status",
     "description": "The run's status and its steps (run_id). With action_id, waits up to wait seconds (at most 30) "
                    "for that step to settle, e.g. while it awaits approval, and answers with its outcome.",
     "input_schema": {"type": "object", "additionalProperties": False, "properties": {
         "run_id": RUN_ID_SCHEMA, **GATEWAY_TOOLS[3]["input_schema"]["properties"]}}},
]


def tool_list(caller: Caller) -> list[types.Tool]:
    agent = agent_of(caller)
    threshold = agent.tenant.approval_threshold
    stateless = caller.stateless
    tools = [{"name": t.name, "description": description_of(t, threshold, stateless=stateless),
              "input_schema": input_schema_of(t, stateless=stateless)} for t in listed_tools(agent)]
    return [types.Tool(**tool) for tool in [*tools, *(STATELESS_GATEWAY_TOOLS if stateless else GATEWAY_TOOLS)]]


def plausible_name(name: str) -> bool:
    """A name that could be a tool's (policy allows at most 120 characters); NUL is never one (PostgreSQL refuses
    it in text, so it must not reach a query)."""
    return 0 < len(name) <= 200 and "\x00" not in name


def callable_tool(agent: Agent, name: str) -> Tool | bool:
    """Whether `name` is a tool this agent may call here, decided from the name alone, before a request's arguments
    are read (mcp_gateway/modern.py): True for the gateway's own, the row of a current tool of its tenant that
    tools/list shows, False for anything else."""
    if name in GATEWAY_NAMES:
        return True
    if name.startswith(RESERVED_PREFIX) or not plausible_name(name):
        return False
    tool = sql.get(Tool, tenant_id=agent.tenant_id, name=name, is_current=True)
    return tool if tool is not None and tool.executor != Executor.CLIENT else False


def result_of(answer: Answer) -> types.CallToolResult:
    """An answer as MCP's tool result: the payload as JSON text and as structuredContent, isError for an error."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=answer.text())],
                                structured_content=answer.payload, is_error=answer.is_error)


# --- answers -----------------------------------------------------------------------------------------------

def problem(error: UnwindError, **more) -> Answer:
    return Answer({"code": error.code, "message": error.detail, **error.extra, **more}, is_error=True)


def absolute(caller: Caller, path: str) -> str:
    return caller.base_url.rstrip("/") + path


def approval_of(caller: Caller, action: Action) -> dict | None:
    found = links.approvals_for([action]).get(action.pk)
    if found is None:
        return None
    return {"id": found["id"], "status": found["status"], "expires_at": found["expires_at"],
            "url": absolute(caller, found["page"])}


def undone_steps(run: Run, steps: list[Action] | None = None) -> list[dict]:
    """The run's compensations in the order they ran (newest step first): what was taken back, and how it went.
    `steps`: the run's steps already read (an archived run's, from its segment)."""
    if steps is None:
        steps = Action.objects.filter(run=run, kind=ActionKind.COMPENSATION).select_related("tool", "compensates")
    compensations = sorted((c for c in steps if c.kind == ActionKind.COMPENSATION), key=lambda c: c.seq)
    by_id = {step.pk: step for step in steps}
    undone = [by_id.get(c.compensates_id) or c.compensates if c.compensates_id else None for c in compensations]
    return [{"step": forward.seq if forward else None, "undone_by": c.tool.name, "status": c.status}
            for c, forward in zip(compensations, undone)]


def marked(run: Run, answer: dict) -> dict:
    """`answer` with the markers REST carries where they apply: `erased` (the person's data was erased at their
    request: ledger/api/serializers.py) and `archived` (read from the archive: docs/archive.md)."""
    erased = erased_out(selectors.erased_on(run))
    if erased is not None:
        answer["erased"] = {**erased, "on": erased["on"].isoformat()}
    if getattr(run, "archived", None) is not None:
        answer["archived"] = run.archived
    return answer


def action_answer(caller: Caller, action: Action, *, replayed: bool = False, matched_by: str | None = None,
                  fresh: bool = False, steps: list[Action] | None = None) -> Answer:
    """The answer for a step as it stands (read again unless `fresh`: just recorded by this thread, with its run):
    done, pending (with how to wait), or a tool error with its code. `steps`: its run's, already read (archived)."""
    if not fresh:
        action = selectors.action_reload(action)
    run = action.run
    base = marked(run, {"action_id": action.pk, "tool": action.tool.name, "status": action.status, "run_id": run.pk,
                        "run_status": run.status, "replayed": replayed, "matched_by": matched_by or None})
    if action.status == A.SUCCEEDED:
        return Answer({**base, "result": action.result})
    if action.status == A.FAILED and action.error_class == REFUSED and (action.policy_decision or {}).get("denied"):
        return Answer({"code": "policy_denied", "message": f"Unwind's policy for {action.tool.name} refused the call, "
                                                           f"so nothing was done ({action.error_message}). The run "
                                                           "stays open: call again with other arguments, or "
                                                           "unwind_rollback.",
                       "reason": action.error_message, **base}, is_error=True)
    if action.status == A.FAILED and action.error_class == REFUSED:
        return Answer({"code": "tool_refused", "message": f"{action.tool.name} refused the call, so nothing was done "
                                                          f"({action.error_message}). The run stays open: call again "
                                                          "with other arguments, or unwind_rollback.",
                       "reason": action.error_message, **base}, is_error=True)
    if action.status in (A.FAILED, A.LOST):
        unwound = run.status in (R.UNWINDING, R.COMPENSATED)
        what = ("Unwind undid the run's earlier steps (undone)" if run.status == R.COMPENSATED else
                "Unwind is undoing the run's earlier steps" if unwound else
                "the run needs a person's attention")
        return Answer({"code": "step_failed", "message": f"{action.tool.name} failed ({action.error_message or action.status}); "
                                                         f"{what}. This run takes no more steps: call unwind_begin to "
                                                         "start a new one.",
                       "error_class": action.error_class, "undone": undone_steps(run, steps), **base}, is_error=True)
    if action.status in (A.REJECTED, A.EXPIRED):
        code = "rejected" if action.status == A.REJECTED else "approval_expired"
        return Answer({"code": code, "message": f"{action.tool.name} was not approved ({action.decision_reason or action.status}) "
                                                f"and was not done. The run stays open unless it says otherwise.",
                       "reason": action.decision_reason, **base}, is_error=True)
    if action.status == A.HELD:
        at = action.next_attempt_at.isoformat(timespec="seconds")
        notice = notice_of(action.pk)  # the customer may stop it: were they told? (recovery/hold_notices.py)
        told = f" {notice['why']}" if notice else ""
        return Answer({**base, "pending": True, "executes_at": at,
                       "message": f"{action.tool.name} is held until {at} (an undo window): it runs then unless "
                                  f"someone stops it. To stop it, call unwind_rollback before then: the step is never "
                                  f"executed. Call unwind_status with action_id {action.pk} to wait for the "
                                  f"outcome.{told}", **({"customer_notice": notice} if notice else {})},
                      waiting=action.pk)
    if action.status in ACTIVE_ACTION_STATUSES:
        approval = approval_of(caller, action) if action.status == A.AWAITING_APPROVAL else None
        how = (f"call unwind_status with action_id {action.pk} (and wait, up to {MAX_STATUS_WAIT:g} s), or call this "
               "tool again with the same arguments: both answer with the outcome once it is known, and the step is "
               "done at most once")
        why = decision.summary(action.policy_decision, display=action.tool.display, args=action.args)
        because = f" ({why})" if why and approval else ""
        message = (f"{action.tool.name} is waiting for a person's approval{because}: {approval['url']}; {how}."
                   if approval else f"{action.tool.name} is still {action.status.replace('_', ' ')}; {how}.")
        return Answer({**base, "pending": True, "approval": approval, "message": message,
                       **({"why": why} if because else {})}, waiting=action.pk)
    return Answer({"code": "not_done", "message": f"{action.tool.name} is {action.status.replace('_', ' ')} and was not "
                                                  "done as asked.", **base}, is_error=True)


def run_answer(run: Run, *, message: str = "", steps: list[Action] | None = None) -> dict:
    """The run and its steps (`steps`: already read, an archived run's from its segment)."""
    if steps is None:
        steps = Action.objects.filter(run=run).select_related("tool").order_by("seq")
    return marked(run, {
        "run_id": run.pk, "run_status": run.status, "goal": run.goal, "on_behalf_of": run.on_behalf_of,
        "idle_timeout": run.idle_timeout_seconds, "message": message,
        "steps": [{"action_id": s.pk, "seq": s.seq, "kind": s.kind, "tool": s.tool.name, "status": s.status}
                  for s in steps]})


def archived_view(view: archive_reader.ArchivedRunView) -> archive_reader.ArchivedRunView:
    """An archived run read back, its run marked `archived` for `marked`."""
    view.run.archived = archived_out(view)
    return view


def refuse_if_archived(agent: Agent, run_id: int) -> None:
    """A run of this agent that was archived takes no more calls: run_archived, saying so (the index alone is read;
    another agent's archived run stays a run that never was)."""
    entry = archive_reader.archived_entry(tenant_ids=[agent.tenant_id], agent_id=agent.pk, run_id=run_id)
    if entry is not None:
        raise RunArchived(f"run {run_id} was archived on {entry.archived_at:%Y-%m-%d}: it is settled and takes no "
                          "more calls; unwind_status reads it, unwind_begin starts a new run", run_id=run_id,
                          archived=archived_out(entry))


# --- the session's run ---------------------------------------------------------------------------------------

def idle_timeout(agent: Agent) -> int:
    return min(settings.UNWIND_MCP_SESSION_IDLE, agent.tenant.run_idle_timeout_seconds)


def open_run(session: McpSession, agent: Agent, *, goal: str, on_behalf_of: str) -> Run:
    run = run_open(tenant=agent.tenant, agent=agent, goal=goal, on_behalf_of=on_behalf_of,
                   actor=f"agent:{agent.name}", idle_timeout=idle_timeout(agent))
    McpSession.objects.filter(pk=session.pk).update(run=run)
    session.run = run
    return run


def run_for_call(session: McpSession, agent: Agent) -> Run:
    """The session's run, opened with the documented defaults on the first call (and after a commit or rollback)."""
    if session.run_id is not None:
        return runsteps.run_with_steps(session.run_id)[0]  # with its steps, which the proposal decides from
    # Two first calls of one session at once (a client may pipeline) must not open two runs: the session's row is
    # locked (after the tenant's chain head, like every ledger write) and read again.
    with ledger_transaction(agent.tenant_id):
        locked = McpSession.objects.select_for_update().get(pk=session.pk)
        if locked.run_id is not None:
            return Run.objects.get(pk=locked.run_id)
        return open_run(locked, agent, goal=f"{DEFAULT_GOAL} {session.session_id[:8]}", on_behalf_of="")


def text_arg(args: dict, name: str, limit: int) -> str:
    value = args.get(name, "")
    if not isinstance(value, str) or len(value) > limit:
        raise ValidationFailed(f"{name} must be a string of at most {limit} characters", field=name)
    return value


def check_only(args: dict, allowed: set[str]) -> None:
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValidationFailed(f"{unknown[0]!r} is not an argument of this tool", field=unknown[0])


# --- the run as a handle (2026-07-28) ---------------------------------------------------------------------------

def run_of_handle(agent: Agent, handle) -> Run:
    """The run a stateless request names: one of this agent's runs; another agent's is answered as missing."""
    if isinstance(handle, bool) or not isinstance(handle, int) or not 1 <= handle < 2 ** 63:
        raise ValidationFailed("the run handle must be the run_id unwind_begin answered (a positive integer)",
                               field="run_id")
    run, _ = runsteps.run_with_steps(handle)  # with its steps, which the proposal decides from
    if run is None or run.tenant_id != agent.tenant_id or run.agent_id != agent.pk:
        refuse_if_archived(agent, handle)
        raise NotFound(f"there is no run {handle}")
    return run


def handle_in(caller: Caller, args: dict):
    """The run handle of a stateless call of a gateway tool: its run_id argument, else the one in `_meta`."""
    handle = args.get("run_id", caller.run_handle)
    if handle is None:
        raise ValidationFailed("pass run_id: the run_id unwind_begin answered", field="run_id")
    return handle


def handle_words(run: Run) -> str:
    return (f"pass run_id {run.pk} with every tool call of the run (as {RUN_ARGUMENT}, or {RUN_META_KEY} in _meta) "
            "and to unwind_commit or unwind_rollback")


def begin_stateless(agent: Agent, args: dict) -> Answer:
    """Open a run and answer its handle, or (`run_id`) take up an open run of this agent: nothing is remembered
    here, the client passes the handle back."""
    if args.get("run_id") is not None:
        run = run_of_handle(agent, args["run_id"])
        if run.status != R.RUNNING:
            raise RunNotActive(f"run {run.pk} is {run.status.replace('_', ' ')}; only a running run can be taken up",
                               run_status=run.status)
        return Answer(run_answer(run, message=f"run {run.pk} is taken up: {handle_words(run)}; a call it already "
                                              "made answers with its recorded outcome"))
    goal, on_behalf_of = text_arg(args, "goal", 10000), text_arg(args, "on_behalf_of", 200)
    run = run_open(tenant=agent.tenant, agent=agent, goal=goal or DEFAULT_RUN_GOAL,
                   on_behalf_of=on_behalf_of, actor=f"agent:{agent.name}", idle_timeout=idle_timeout(agent))
    return Answer(run_answer(run, message=f"run {run.pk} is open: {handle_words(run)}. It is unwound if it stays "
                                          f"idle {run.idle_timeout_seconds} s."))


def begin(caller: Caller, args: dict) -> Answer:
    """Open the session's run with a goal, or (`run_id`) take up an open run of this agent, e.g. after the client
    started a new MCP session: its calls then join that run, and a re-sent call answers with the recorded outcome."""
    agent = agent_of(caller)
    check_only(args, {"goal", "on_behalf_of", "run_id"})
    if caller.stateless:
        return begin_stateless(agent, args)
    session = session_of(caller, agent)
    goal, on_behalf_of = text_arg(args, "goal", 10000), text_arg(args, "on_behalf_of", 200)
    if session.run_id is not None and session.run.status in OPEN:
        raise StateConflict(f"this session's run {session.run_id} is {session.run.status.replace('_', ' ')}; finish "
                            "it with unwind_commit or unwind_rollback before beginning another", run_id=session.run_id)
    if args.get("run_id") is not None:
        return resume(session, agent, args["run_id"])
    run = open_run(session, agent, goal=goal or f"{DEFAULT_GOAL} {session.session_id[:8]}", on_behalf_of=on_behalf_of)
    return Answer(run_answer(run, message=f"run {run.pk} is open; tool calls of this session go into it. It is unwound "
                                          f"if the session stays idle {run.idle_timeout_seconds} s."))


def resume(session: McpSession, agent: Agent, run_id) -> Answer:
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        raise ValidationFailed("run_id must be the id of an open run of this agent", field="run_id")
    run = Run.objects.filter(pk=run_id, tenant_id=agent.tenant_id, agent=agent).first()
    if run is None:
        refuse_if_archived(agent, run_id)
        raise NotFound(f"there is no run {run_id}")  # another agent's run is not told apart from a missing one
    if run.status != R.RUNNING:
        raise RunNotActive(f"run {run.pk} is {run.status.replace('_', ' ')}; only a running run can be taken up",
                           run_status=run.status)
    McpSession.objects.filter(pk=session.pk).update(run=run)
    return Answer(run_answer(run, message=f"this session now continues run {run.pk}; a call it already made answers "
                                          "with its recorded outcome"))


def session_run(caller: Caller) -> tuple[McpSession, Agent, Run]:
    agent = agent_of(caller)
    session = session_of(caller, agent)
    if session.run_id is None:
        raise StateConflict("this session has no open run: call a tool (or unwind_begin) first")
    return session, agent, Run.objects.get(pk=session.run_id)


def commit(caller: Caller, args: dict) -> Answer:
    if caller.stateless:
        check_only(args, {"run_id"})
        agent = agent_of(caller)
        run = run_complete(run=run_of_handle(agent, handle_in(caller, args)), actor=f"agent:{agent.name}")
        return Answer(run_answer(run, message=f"run {run.pk} is completed."))
    check_only(args, set())
    session, agent, run = session_run(caller)
    run = run_complete(run=run, actor=f"agent:{agent.name}")
    McpSession.objects.filter(pk=session.pk).update(run=None)
    return Answer(run_answer(run, message=f"run {run.pk} is completed; the next tool call opens a new run."))


def cancel_as_agent(run: Run, agent: Agent, reason: str) -> Run:
    """The agent's cancel (the engine's move, ledger/engine/moves.py), and its unwind within the inline wait."""
    run = run_cancel(run=run, actor=f"agent:{agent.name}", reason=reason)
    if run.status == R.UNWINDING:
        inline.unwind_within(run.pk, tenant_id=run.tenant_id, wait=settings.UNWIND_INLINE_WAIT)
    run.refresh_from_db()
    return run


def rollback(caller: Caller, args: dict) -> Answer:
    reason_words = "unwind_rollback over MCP"
    if caller.stateless:
        check_only(args, {"reason", "run_id"})
        agent = agent_of(caller)
        run = run_of_handle(agent, handle_in(caller, args))
        run = cancel_as_agent(run, agent, text_arg(args, "reason", 1000) or reason_words)
        return Answer({**run_answer(run, message=f"run {run.pk} was cancelled: it is "
                                                 f"{run.status.replace('_', ' ')}."), "undone": undone_steps(run)})
    check_only(args, {"reason"})
    reason = text_arg(args, "reason", 1000)
    session, agent, run = session_run(caller)
    run = cancel_as_agent(run, agent, reason or reason_words)
    McpSession.objects.filter(pk=session.pk).update(run=None)
    return Answer({**run_answer(run, message=f"run {run.pk} was cancelled: it is {run.status.replace('_', ' ')}; the "
                                             "next tool call opens a new run."), "undone": undone_steps(run)})


def status(caller: Caller, args: dict) -> Answer:
    """The run, or (with action_id) one of the agent's steps; waiting is the caller's (see server.wait_for)."""
    check_only(args, {"action_id", "wait", *({"run_id"} if caller.stateless else ())})
    status_wait(args)
    agent = agent_of(caller)
    action_id = args.get("action_id")
    if action_id is not None:
        if isinstance(action_id, bool) or not isinstance(action_id, int):
            raise ValidationFailed("action_id must be an integer", field="action_id")
        try:
            action = selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=action_id)
        except NotFound:
            view, action = archive_reader.archived_action(tenant_ids=[agent.tenant_id], agent_id=agent.pk,
                                                          action_id=action_id)
            return action_answer(caller, action, fresh=True, steps=archived_view(view).actions)
        return action_answer(caller, action)
    if caller.stateless:
        handle = args.get("run_id", caller.run_handle)
        if handle is None:
            return Answer({"run_id": None, "message": "pass run_id: the run_id unwind_begin answered"})
        try:
            return Answer(run_answer(run_of_handle(agent, handle)))
        except RunArchived:
            view = archived_view(archive_reader.archived_run(tenant_ids=[agent.tenant_id], agent_id=agent.pk,
                                                             run_id=handle))
            return Answer(run_answer(view.run, message=f"run {handle} is archived: read from its archive segment",
                                     steps=view.actions))
    session = session_of(caller, agent)
    if session.run_id is None:
        return Answer({"run_id": None, "message": "no run is open; the next tool call (or unwind_begin) opens one"})
    return Answer(run_answer(Run.objects.get(pk=session.run_id)))


def status_wait(args: dict) -> float:
    wait = args.get("wait", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_STATUS_WAIT:
        raise ValidationFailed(f"wait must be a number of seconds from 0 to {MAX_STATUS_WAIT:g}", field="wait")
    return float(wait)


# --- tools/call ----------------------------------------------------------------------------------------------

def call(caller: Caller, name: str, args: dict) -> Answer:
    """A tool call of the session: a proposed action in its run, executed as the REST API does."""
    agent = agent_of(caller)
    session = None if caller.stateless else session_of(caller, agent)
    tool = caller.tool if caller.tool is not None and caller.tool.name == name else \
        sql.get(Tool, tenant_id=agent.tenant_id, name=name, is_current=True)
    if tool is not None and (tool.executor == Executor.CLIENT or name.startswith(RESERVED_PREFIX)):
        return Answer({"code": "not_callable_over_mcp",
                       "message": f"{name} is executed by the agent itself (executor: client); use the REST API, "
                                  "which lets the agent report its outcome"}, is_error=True)
    if session is not None:
        run = run_for_call(session, agent)
    else:
        args = dict(args)
        handle = args.pop(RUN_ARGUMENT, None)
        if handle is None:
            handle = caller.run_handle
        if handle is None:
            return Answer({"code": "run_required",
                           "message": f"{name} was not called: a call joins a run, and this one named none. Call "
                                      f"unwind_begin, then pass its run_id as {RUN_ARGUMENT} (or {RUN_META_KEY} in "
                                      "_meta)."}, is_error=True)
        run = run_of_handle(agent, handle)
    succeeded = None
    try:
        with inline.tenant_slot(run.tenant_id) as slot:
            proposal = action_propose(run=run, tool_name=name, args=args, actor=f"agent:{agent.name}",
                                      intent={"goal": run.goal}, inline=slot is not None, queued=slot is None)
            if proposal.claimed and slot is not None:
                succeeded = inline.execute_within(proposal.action, owner=proposal.owner,
                                                  wait=settings.UNWIND_INLINE_WAIT, slot=slot)
            elif proposal.claimed:
                inline.hand_to_worker(proposal.action, owner=proposal.owner)
    except StillInFlight as busy:
        # The same call re-sent (after a reconnect, or to wait): answer as the step already recorded.
        action = selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=busy.extra["action_id"])
        return action_answer(caller, action, replayed=True, matched_by=busy.extra.get("matched_by", "key"))
    except RunNotActive as stopped:
        return problem(stopped, run_id=run.pk, hint="call unwind_begin to start a new run")
    # Executed here and succeeded: the action and its run as the success was recorded (as the REST API answers).
    return action_answer(caller, succeeded or proposal.action, replayed=proposal.replayed,
                         matched_by=proposal.matched_by, fresh=succeeded is not None)


def settled(caller: Caller, action_id: int) -> bool:
    agent = agent_of(caller)
    selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk, action_id=action_id)
    return selectors.action_settled(action_id)


def answer_for(caller: Caller, action_id: int) -> Answer:
    try:
        agent = agent_of(caller)
        return action_answer(caller, selectors.action_get(tenant_ids=[agent.tenant_id], agent_id=agent.pk,
                                                          action_id=action_id))
    except UnwindError as error:
        return problem(error)


def dispatch(caller: Caller, name: str, args) -> Answer:
    """Any tools/call: the gateway's own tools, or a tenant tool; an Unwind refusal becomes a tool error."""
    if args is None:
        args = {}
    try:
        if not isinstance(args, dict):
            raise ValidationFailed("arguments must be an object")
        if not plausible_name(name):
            raise UnknownTool(f"there is no tool {name[:200].replace(chr(0), '?')!r}")
        if name == "unwind_begin":
            return begin(caller, args)
        if name == "unwind_commit":
            return commit(caller, args)
        if name == "unwind_rollback":
            return rollback(caller, args)
        if name == "unwind_status":
            return status(caller, args)
        return call(caller, name, args)
    except UnwindError as error:
        return problem(error)


def waiting_bound(name: str, arguments) -> float:
    """How long a tools/call waits for its step before answering: only unwind_status waits, for the `wait` the
    agent asked (at most MAX_STATUS_WAIT). Any other call answers at once, pending if a person must decide."""
    if name != "unwind_status" or not isinstance(arguments, dict):
        return 0.0
    try:
        return status_wait(arguments)
    except ValidationFailed:
        return 0.0  # status() refuses it and nothing waits


def progress(caller: Caller, answer: Answer, bound: float) -> Iterator[tuple[float, float, str]]:
    """Wait up to `bound` seconds for a pending step: (waited, bound, message) after each second without an outcome,
    for the transport to send as progress; ends when the step settled or the bound is reached (then ask answer_for)."""
    waited = 0.0
    while waited < bound:
        step = min(PROGRESS_EVERY, bound - waited)
        if wait_slice(caller, answer.waiting, step):
            return
        waited += step
        yield waited, bound, answer.payload.get("message", "waiting")


async def progress_on_loop(answer: Answer, bound: float) -> AsyncIterator[tuple[float, float, str]]:
    """`progress` on the event loop (the ASGI server): the step's settling is watched with every other wait of the
    web process (ledger/api/waits.py), so waiting holds no thread and no database connection."""
    waited = 0.0
    while waited < bound:
        step = min(PROGRESS_EVERY, bound - waited)
        if await waits.until_settled(answer.waiting, time.monotonic() + step):
            return
        waited += step
        yield waited, bound, answer.payload.get("message", "waiting")


def wait_slice(caller: Caller, action_id: int, seconds: float) -> bool:
    """Poll for up to `seconds` whether the step settled (the caller sends progress between slices)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            done = settled(caller, action_id)
        except UnwindError:
            return True  # answer_for says why
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
