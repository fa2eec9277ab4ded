"""Unwind for LangGraph (`pip install 'unwind[langgraph]'`): tools, or a ToolNode, whose every call goes through the
Unwind run of the graph's thread.

    from unwind_client import Unwind
    from unwind_client.adapters import server_tools
    from unwind_client.langgraph import UnwindThreads, tool_node

    unwind = Unwind(url, api_key="uw_…")
    threads = UnwindThreads(unwind, on_behalf_of="carol@company.com")
    tools = server_tools(unwind)
    graph = …  # a StateGraph with tool_node(tools, threads) as its "tools" node (or langchain_tools(…) anywhere)
    config = {"configurable": {"thread_id": "onboard-ashu"}}
    with threads.run(config, goal="Onboard Ashu"):   # completed at the end, cancelled (unwound) on an exception
        graph.invoke({"messages": [("user", "Onboard Ashu")]}, config)

A thread's run opens on its first tool call (goal: `threads.run(goal=…)`, else the config's
`configurable.unwind_goal`, else the thread id). Waiting for a person and a rejection come back as ToolMessages
the model reads; a refusal too ("refused: …; try other arguments"); a failed step that unwinds the run, and any
call after it, as a ToolMessage with `status="error"`. See `unwind_client.adapters.AgentRun.call`.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

try:
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import StructuredTool, ToolException
    from langgraph.prebuilt import ToolNode
except ImportError as missing:  # pragma: no cover - exercised only without the extra
    raise ImportError("unwind_client.langgraph needs LangGraph: pip install 'unwind[langgraph]' "
                      "(or langgraph and langchain-core)") from missing

from unwind_client.adapters import AgentRun, UnwindTool
from unwind_client.client import Unwind
from unwind_client.errors import UnwindClientError

__all__ = ["UnwindThreads", "langchain_tools", "tool_node"]


class UnwindThreads:
    """The Unwind run of each graph thread (`config["configurable"]["thread_id"]`), one at a time per thread."""

    def __init__(self, unwind: Unwind, *, on_behalf_of: str = "", intent: dict | None = None, wait: float = 30.0):
        self.unwind = unwind
        self.on_behalf_of = on_behalf_of
        self.intent = intent
        self.wait = wait
        self._runs: dict[str, AgentRun] = {}
        self._lock = threading.Lock()

    def agent_run(self, config: RunnableConfig | None, *, goal: str = "") -> AgentRun:
        """The thread's AgentRun, made now if the thread has none (its Unwind run opens on the first call)."""
        thread_id = thread_of(config)
        with self._lock:
            if thread_id not in self._runs:
                configurable = (config or {}).get("configurable") or {}
                self._runs[thread_id] = AgentRun(
                    self.unwind, goal=goal or configurable.get("unwind_goal") or f"thread {thread_id}",
                    on_behalf_of=configurable.get("unwind_on_behalf_of") or self.on_behalf_of, intent=self.intent,
                    wait=self.wait)
            return self._runs[thread_id]

    def commit(self, config: RunnableConfig | None) -> Any:
        """Complete the thread's run and let the thread's next task open a new one. A run with a step waiting for a
        person stays the thread's run (call that tool again once a person decided, then commit)."""
        agent_run = self.agent_run(config)
        run = agent_run.commit()
        if run is None or run.status != "awaiting_approval":
            self.forget(config)
        return run

    def rollback(self, config: RunnableConfig | None, reason: str = "") -> Any:
        """Cancel the thread's run (Unwind undoes its steps) and let the thread's next task open a new one."""
        run = self.agent_run(config).rollback(reason)
        self.forget(config)
        return run

    def forget(self, config: RunnableConfig | None) -> None:
        with self._lock:
            self._runs.pop(thread_of(config), None)

    @contextmanager
    def run(self, config: RunnableConfig, *, goal: str = "") -> Iterator[AgentRun]:
        """The thread's run for one task: committed when the block ends, rolled back if it raises."""
        agent_run = self.agent_run(config, goal=goal)
        try:
            yield agent_run
        except BaseException as exc:
            try:
                self.rollback(config, f"{type(exc).__name__}: {exc}")
            except UnwindClientError:  # the exception that ended the block wins
                pass
            raise
        self.commit(config)


def thread_of(config: RunnableConfig | None) -> str:
    thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
    if thread_id in (None, ""):
        raise UnwindClientError("the graph's config has no configurable.thread_id: Unwind ties a run to a thread")
    return str(thread_id)


def langchain_tools(tools: Iterable[UnwindTool], threads: UnwindThreads) -> list[StructuredTool]:
    """LangChain tools for these Unwind tools; each call goes through the run of the calling graph's thread."""
    return [_structured_tool(tool, threads) for tool in tools]


def tool_node(tools: Iterable[UnwindTool], threads: UnwindThreads, **kwargs: Any) -> ToolNode:
    """A ToolNode running these tools through Unwind (kwargs go to ToolNode)."""
    return ToolNode(langchain_tools(tools, threads), **kwargs)


def _structured_tool(tool: UnwindTool, threads: UnwindThreads) -> StructuredTool:
    def call(config: RunnableConfig, **args: Any) -> str:
        answer = threads.agent_run(config).call(tool, args)
        if answer.error:
            raise ToolException(answer.text)  # a ToolMessage with status="error" (handle_tool_error below)
        return answer.text

    return StructuredTool.from_function(func=call, name=tool.model_name, description=tool.description or tool.name,
                                        args_schema=tool.args_schema, handle_tool_error=True)
