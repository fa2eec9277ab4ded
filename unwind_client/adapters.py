"""What the framework adapters share: tools declared with their compensations, the policy document a person loads,
one Unwind run per agent run, and each tool call's outcome in words a model understands.

    @unwind_tool("hr.create_user", compensation=twin("hr.delete_user", user_id="$result.id"),
                 saga_role="compensatable", risk="low", executor={"kind": "http", "url": "/sandbox/hr/users"})
    def create_user(email: str, name: str) -> dict:
        \"\"\"Create a user in the HR directory.\"\"\"

Declaring a compensation beside a function does not register anything: an agent's key may not write policy
(403 agents_cannot_govern). `policy_document(tools)` writes the document a person reviews and loads
(`manage.py load_tools`, or `Unwind(url, deploy_key).load_policy(document)`).

A tool is executed by Unwind when its policy names an executor (an HTTP tool, say): the function is then only
its signature. Without one the tool is client-executed (`executor: client`): Unwind records and gates the
call, the adapter runs the function's body and reports its outcome, and when the run unwinds it runs the
compensation functions Unwind asks for. `server_tools(unwind)` declares the tenant's registered tools as Unwind
lists them, schema and description included. The adapters (`unwind_client.openai_agents`,
`unwind_client.langgraph`) turn declarations into the framework's tools; this module needs neither framework.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from unwind_client.client import Run, Unwind
from unwind_client.errors import (
    ApprovalPending,
    InFlight,
    Refused,
    Rejected,
    ReportRequired,
    UnwindClientError,
    Unwound,
)

log = logging.getLogger("unwind_client.adapters")

# Problems that mean the agent is misconfigured (wrong key, a person's endpoint), not that a call needs changing:
# they end the agent's run rather than go back to the model.
FATAL_STATUSES = {401, 403}
# A 403 the model can act on: the tool's policy refused these arguments (a rule or a limit), which it reads and
# answers like any refusal, with other arguments or by telling the user.
MODEL_CAN_ANSWER = {"policy_denied"}
SETTLED_RUN = {"completed", "compensated", "closed", "needs_attention"}
ENDED_BY = {"failed", "lost"}  # a step in these states ended its run (failed, or its outcome is unknown)
MODEL_NAME = re.compile(r"[^a-zA-Z0-9_-]")


def model_name(tool_name: str) -> str:
    """The name a model sees: OpenAI function names allow only letters, digits, `_` and `-` (`hr.create_user` →
    `hr_create_user`)."""
    return MODEL_NAME.sub("_", tool_name)[:64]


class Compensation(dict):
    """A policy's compensation block; remembers the declared function that undoes the step, if one was given."""

    undo: UnwindTool | None = None


def twin(tool: str | UnwindTool, **args: Any) -> Compensation:
    """A compensation that calls another tool: `twin("hr.delete_user", user_id="$result.id")`, or `twin(delete_user,
    …)` with a declared function, which the agent then runs itself when the step must be undone."""
    block = Compensation(strategy="twin", tool=tool.name if isinstance(tool, UnwindTool) else tool, args=args)
    block.undo = tool if isinstance(tool, UnwindTool) else None
    return block


class UnwindTool:
    """A function declared as an Unwind tool. Calling it calls the function itself (no Unwind involved)."""

    def __init__(self, function: Callable[..., Any] | None, *, name: str, description: str = "",
                 compensation: dict | None = None, args_schema: dict | None = None, policy: dict | None = None):
        self.function = function
        self.name = name
        self.description = description or (inspect.getdoc(function) if function else "") or ""
        self.compensation = compensation
        self._args_schema = args_schema
        self.policy_fields = dict(policy or {})
        self.model_name = model_name(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.function is None:
            raise TypeError(f"{self.name} is executed by Unwind; call it through a run")
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"UnwindTool({self.name!r}, {'client' if self.client_executed else 'server'}-executed)"

    @property
    def client_executed(self) -> bool:
        """Whether the agent runs the body (no executor declared, or `executor: client`)."""
        executor = self.policy_fields.get("executor")
        kind = executor.get("kind") if isinstance(executor, dict) else executor
        return kind in (None, "client")

    @property
    def undo(self) -> UnwindTool | None:
        """The declared function that compensates this tool, when its compensation named one."""
        return getattr(self.compensation, "undo", None)

    def execute(self, args: dict) -> Any:
        """Run the body with the arguments as the model sent them (keyword arguments). An `async def` body runs to
        its end here: the adapters call this from a worker thread, which has no event loop of its own."""
        if inspect.iscoroutinefunction(self.function):
            return asyncio.run(self.function(**args))
        return self(**args)

    @property
    def args_schema(self) -> dict:
        """The JSON Schema of the arguments: as declared, or from the function's signature (needs pydantic)."""
        if self._args_schema is None:
            self._args_schema = signature_schema(self.function)
        return self._args_schema

    def policy(self) -> dict:
        """This tool's entry in a policy document."""
        entry: dict[str, Any] = {"description": self.description, "args_schema": self.args_schema}
        entry.update(self.policy_fields)
        if self.client_executed:
            entry["executor"] = "client"
        if self.compensation is not None:
            entry["compensation"] = dict(self.compensation)
        return entry


def unwind_tool(name: str | None = None, *, compensation: dict | None = None, description: str = "",
                args_schema: dict | None = None, **policy: Any) -> Callable[[Callable[..., Any]], UnwindTool]:
    """Declare a function as the Unwind tool `name` (default: the function's name), with its compensation and any
    other policy fields (saga_role, risk, approval, executor, timeout, …) beside it."""

    def declare(function: Callable[..., Any]) -> UnwindTool:
        return UnwindTool(function, name=name or function.__name__, description=description,
                          compensation=compensation, args_schema=args_schema, policy=policy)

    return declare


def policy_document(tools: Iterable[UnwindTool], *, defaults: dict | None = None) -> dict:
    """The policy document for these tools, for a person to review and load: agents cannot load it themselves."""
    declared: dict[str, UnwindTool] = {}
    for tool in tools:  # a compensation declared as a function is a tool too
        for each in (tool, tool.undo):
            if each is not None:
                declared.setdefault(each.name, each)
    document: dict[str, Any] = {"tools": {name: tool.policy() for name, tool in declared.items()}}
    if defaults:
        document = {"defaults": defaults, **document}
    return document


def server_tools(unwind: Unwind, names: Iterable[str] | None = None) -> list[UnwindTool]:
    """The tenant's tools as Unwind lists them (optionally only `names`), executed by Unwind."""
    wanted = set(names) if names is not None else None
    listed = [tool for tool in unwind.tools() if wanted is None or tool["name"] in wanted]
    if wanted is not None and (missing := wanted - {tool["name"] for tool in listed}):
        raise LookupError(f"Unwind has no tool named {', '.join(sorted(missing))} for this agent")
    return [UnwindTool(None, name=tool["name"], description=_described(tool["name"], tool["policy"]),
                       args_schema=tool["policy"].get("args_schema") or {"type": "object"},
                       policy={"executor": tool["policy"].get("executor") or "http"}) for tool in listed]


def _described(name: str, policy: dict) -> str:
    """The tool's description, and whether a call may wait for a person (so a model expects a pending answer)."""
    text = policy.get("description") or name
    if policy.get("approval") == "manual" or policy.get("risk") in ("high", "critical"):
        text += " A call may wait for a person's approval."
    return text


def signature_schema(function: Callable[..., Any]) -> dict:
    """A JSON Schema of a function's keyword arguments, from its type hints (pydantic comes with both frameworks)."""
    try:
        import pydantic
    except ImportError as missing:  # pragma: no cover - both adapters' frameworks depend on pydantic
        raise ImportError("deriving an args schema needs pydantic; pass args_schema= instead") from missing
    fields = {}
    for parameter in inspect.signature(function).parameters.values():
        annotation = Any if parameter.annotation is inspect.Parameter.empty else parameter.annotation
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = (annotation, default)
    model = pydantic.create_model(function.__name__, __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    return _untitled(model.model_json_schema())


def _untitled(schema: Any) -> Any:
    """Drop pydantic's generated titles: noise in a policy file a person reviews."""
    if isinstance(schema, dict):
        return {key: _untitled(value) for key, value in schema.items() if key != "title" or not isinstance(value, str)}
    if isinstance(schema, list):
        return [_untitled(item) for item in schema]
    return schema


# --- one run per agent run ------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolAnswer:
    """What a tool call answers the model: `text` (JSON), whether it is an error, and which outcome it was."""

    text: str
    kind: str  # ok | pending_approval | in_progress | rejected | refused | failed | run_over
    error: bool = False

    @property
    def data(self) -> Any:
        return json.loads(self.text)


class AgentRun:
    """One Unwind run for one agent run: opened on the first tool call, completed by `commit()`, cancelled (unwound)
    by `rollback()`. As a context manager: committed when the block ends normally, rolled back on an exception.

    `tools` are declarations whose compensations the agent runs itself (client-executed tools; the tools it calls
    and their declared compensations are added as they are called): after a failure or a rollback, the adapter
    runs the compensations Unwind asks for, newest first, and reports them. `run_id` attaches to an open run (the
    next agent run after a person decided, say)."""

    def __init__(self, unwind: Unwind, *, goal: str = "", on_behalf_of: str = "", plan: list[str] | None = None,
                 intent: dict | None = None, wait: float = 30.0, tools: Iterable[UnwindTool] = (),
                 run_id: int | None = None):
        self.unwind = unwind
        self.goal = goal
        self.on_behalf_of = on_behalf_of
        self.plan = plan
        self.intent = intent
        self.wait = wait
        self.tools = {tool.name: tool for tool in tools}
        self._run: Run | None = unwind.get_run(run_id) if run_id is not None else None
        self._lock = threading.Lock()
        self.over: str = ""  # why the run can take no more steps, once it cannot

    @property
    def run(self) -> Run | None:
        """The Unwind run, once a tool call opened it."""
        return self._run

    def open(self) -> Run:
        """The run, opened now if no call opened it yet (with the agent's goal)."""
        with self._lock:
            if self._run is None:
                self._run = self.unwind.run(goal=self.goal, on_behalf_of=self.on_behalf_of, plan=self.plan,
                                            intent=self.intent)
            return self._run

    def register(self, tools: Iterable[UnwindTool]) -> None:
        """Know these tools' functions (and their compensations'), to run the compensations Unwind asks for."""
        for tool in tools:
            self.tools.setdefault(tool.name, tool)
            if tool.undo is not None:
                self.tools.setdefault(tool.undo.name, tool.undo)

    def call(self, tool: UnwindTool, args: dict) -> ToolAnswer:
        """Put one call through the run and say what became of it, as the model should read it."""
        self.register([tool])
        if self.over:
            return _answer("run_over", error=True, message=f"not done: {self.over} Do not call more tools for this "
                                                           "task; tell the user what happened.")
        run = self.open()
        execute = tool.execute if tool.client_executed and tool.function is not None else None
        try:
            result = run.act(tool.name, args, intent=self.intent, execute=execute, timeout=self.wait)
        except ApprovalPending as pending:
            return _answer("pending_approval", approval_url=pending.url, action_id=pending.action_id,
                           message=f"pending approval at {pending.url}: a person must approve this {tool.name} call. "
                                   f"Call {tool.model_name} again later with the same arguments to get its result.")
        except InFlight as busy:
            return _answer("in_progress", action_id=busy.action_id,
                           message=f"{tool.name} is still running; call {tool.model_name} again later with the same "
                                   "arguments to get its result.")
        except Rejected as rejected:
            return self._rejected(rejected.action)
        except Unwound as unwound:
            if unwound.action.get("status") in ENDED_BY:
                return self._failed(unwound.action)
            return self._run_ended(str(unwound))  # an earlier step replayed, since undone: say what ended the run
        except ReportRequired:
            raise  # a client-executed tool declared without a body: a wiring mistake, not the model's
        except Refused as refused:
            if refused.status in FATAL_STATUSES and refused.code not in MODEL_CAN_ANSWER:
                raise
            return self._refusal(tool, refused)
        return ToolAnswer(result if isinstance(result, str) else json.dumps(result, ensure_ascii=False), "ok")

    def _rejected(self, action: dict) -> ToolAnswer:
        reason = action.get("decision_reason") or "no reason given"
        self._ended(action, f"a person rejected {action.get('tool')}: {reason}; Unwind undoes the run's steps.")
        return _answer("rejected", reason=action.get("decision_reason"), tool=action.get("tool"),
                       run_status=action.get("run_status"),
                       message=f"rejected: {reason}. A person turned down {action.get('tool')} and Unwind is undoing "
                               "this task's earlier steps; do not retry it, tell the user.")

    def _failed(self, action: dict) -> ToolAnswer:
        error = action.get("error") or {}
        why = error.get("message") or action.get("status")
        self._ended(action, f"{action.get('tool')} failed ({why}) and Unwind undid the run's earlier steps.")
        return _answer("failed", error=True, tool=action.get("tool"), error_message=error.get("message"),
                       error_class=error.get("error_class"), run_status=action.get("run_status"),
                       message=f"error: {action.get('tool')} failed ({why}); Unwind is undoing this task's earlier "
                               f"steps (run {action.get('run_status')}). The task cannot go on; tell the user.")

    def _run_ended(self, detail: str) -> ToolAnswer:
        """The run took no new step: say why, from the step that ended it (a rejection or a failure decided while
        the model was not calling, say), or the run's own state."""
        run = self._run.refresh()
        for action in reversed(run.data.get("actions", [])):
            if action.get("kind") == "forward" and action["status"] in ("rejected", "expired"):
                return self._rejected({**action, "run_status": run.status})
            if action.get("kind") == "forward" and action["status"] in ENDED_BY:
                return self._failed({**action, "run_status": run.status})
        self.over = f"the run is {run.status.replace('_', ' ')}: {detail}"
        return _answer("run_over", error=True, run_status=run.status,
                       message=f"not done: {self.over} Do not call more tools for this task; tell the user.")

    def _refusal(self, tool: UnwindTool, refused: Refused) -> ToolAnswer:
        if refused.code in ("run_not_active", "run_cancelled", "run_archived"):
            return self._run_ended(refused.message)
        if refused.code == "tool_refused":
            reason = refused.problem.get("reason") or refused.message
            return _answer("refused", code=refused.code, reason=reason,
                           message=f"refused: {reason}; try other arguments")
        return _answer("refused", code=refused.code, field=refused.problem.get("field"),
                       message=f"refused ({refused.code}): {refused.message}; fix the call and try again")

    def _ended(self, action: dict, why: str) -> None:
        self.over = why
        if action.get("run_status") == "unwinding":
            self.compensate()

    def compensate(self) -> int:
        """Run the compensations of client-executed steps Unwind asks this agent for, newest first; return how many.

        Unwind plans them one at a time (the next once the previous is reported), so this loops until none is
        waiting. A compensation whose function is unknown here is left for a person (the run needs attention)."""
        if self._run is None:
            return 0
        done, failed = 0, set()
        while pending := self.unwind.pending_compensations(run=self._run.id):
            compensation = pending[0]
            if compensation["id"] in failed:
                return done  # it failed here once already: Unwind retries it later or asks a person
            undo = self.tools.get(compensation["tool"])
            if undo is None or undo.function is None:
                log.warning("run %s: no function for compensation %s (%s)", self._run.id, compensation["id"],
                            compensation["tool"])
                return done
            try:
                result = undo.execute(compensation["args"])
            except Exception as exc:  # the compensation failed: Unwind retries it or asks a person
                failed.add(compensation["id"])
                self.unwind.report(compensation["id"], ok=False, error=f"{type(exc).__name__}: {exc}"[:4000])
            else:
                self.unwind.report(compensation["id"], ok=True, result=result)
            done += 1
        return done

    def commit(self) -> Run | None:
        """Complete the run. Nothing to do if no call opened it or a failure already ended it; and a run with a step
        waiting for a person stays open (its status says so): the agent calls that tool again once it is decided,
        in this AgentRun or in `AgentRun(unwind, run_id=…)`, and commits then."""
        if self._run is None:
            return None
        run = self._run.refresh()
        if self.over or run.status in SETTLED_RUN or run.status == "awaiting_approval":
            return run
        return run.complete()

    def rollback(self, reason: str = "") -> Run | None:
        """Cancel the run: Unwind undoes its steps, newest first (client-executed ones through `compensate`)."""
        if self._run is None:
            return None
        if not self.over and self._run.refresh().status not in SETTLED_RUN:
            self._run.cancel(reason=reason[:1000])
        self.over = self.over or f"the run was rolled back{': ' + reason if reason else ''}."
        self.compensate()
        return self._run.refresh()

    def __enter__(self) -> AgentRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
            return False
        try:
            self.rollback(f"{exc_type.__name__}: {exc}")
        except UnwindClientError as failed:  # the exception that ended the block wins
            log.warning("rollback after %s failed: %s", exc_type.__name__, failed)
        return False


def _answer(kind: str, *, error: bool = False, message: str, **fields: Any) -> ToolAnswer:
    body = {"status": kind, **{key: value for key, value in fields.items() if value not in (None, "")},
            "message": message}
    return ToolAnswer(json.dumps(body, ensure_ascii=False), kind, error)
