#!/usr/bin/env python
"""A LangGraph agent whose every tool call goes through the Unwind run of its thread, against `make demo`.

    make demo                                   # in one terminal
    .venv/bin/pip install -q -e '.[langgraph]'    # the framework (make test installs it too)
    .venv/bin/python examples/langgraph_agent.py

The graph is the usual agent loop (a model node, a ToolNode, `tools_condition` between them); its chat model is
scripted (`ScriptedChatModel`, no API key, no network to a model provider) and reads the tool outputs the
adapter gives it. The tasks are those of examples/openai_agents_agent.py: onboard (the run completes), unwind
(the email service is down: the email step fails, Unwind revokes the license and deletes the user) and
approval (the charge waits for a person; once approved, the thread's agent runs again and its repeated calls
get the recorded outcomes).

With a real model, replace `ScriptedChatModel(plan=…)` by e.g. `ChatOpenAI(model="…")` from langchain-openai
(and set OPENAI_API_KEY); `model.bind_tools(tools)` and the rest stay the same.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

try:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import tools_condition
except ImportError as missing:  # the adapter's extra is not installed: say which, not a traceback
    raise SystemExit(f"This example needs LangGraph ({missing.name} is not installed): "
                     "pip install '.[langgraph]' (or .venv/bin/pip install -e '.[langgraph]')") from None

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.agent_loop import credentials, outage  # noqa: E402
from examples.scripted_brain import EXPECTED, TOOLS, Seen, onboarding, parse  # noqa: E402
from unwind_client import Unwind  # noqa: E402
from unwind_client.adapters import UnwindTool, server_tools  # noqa: E402
from unwind_client.langgraph import UnwindThreads, langchain_tools, tool_node  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class ScriptedChatModel(BaseChatModel):
    """A chat model answering from a Plan: one tool call per turn, then a final message."""

    plan: Any
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self  # the plan names the tools itself

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        decision = self.plan.next(history(messages))
        self.calls += 1
        if isinstance(decision, str):
            message = AIMessage(content=decision)
        else:
            name, args = decision
            message = AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call-{self.calls}"}])
        return ChatResult(generations=[ChatGeneration(message=message)])


def history(messages: list[BaseMessage]) -> list[Seen]:
    """The tool calls in the conversation, each with the ToolMessage it got."""
    calls: dict[str, Seen] = {}
    for message in messages:
        if isinstance(message, AIMessage):
            for call in message.tool_calls:
                calls[call["id"]] = Seen(call["name"], call["args"], None)
        elif isinstance(message, ToolMessage) and message.tool_call_id in calls:
            calls[message.tool_call_id].output = parse(message.content)
    return [call for call in calls.values() if call.output is not None]


def build_graph(model: BaseChatModel, tools: list[UnwindTool], threads: UnwindThreads):
    """The agent loop: the model proposes tool calls, the ToolNode puts them through Unwind, until the model stops."""
    bound = model.bind_tools(langchain_tools(tools, threads))
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [bound.invoke(state["messages"])]})
    graph.add_node("tools", tool_node(tools, threads))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def ask(graph, config: dict, text: str) -> str:
    state = graph.invoke({"messages": [("user", text)]}, config)
    return state["messages"][-1].content


def run_task(name: str, unwind: Unwind, tools: list[UnwindTool], base_url: str, people: dict,
             say: Callable[[str], None] = print) -> str:
    say(f"\n[{name}]")
    threads = UnwindThreads(unwind)
    config = {"configurable": {"thread_id": f"{name}-{time.time_ns()}"}}
    if name == "approval":
        return approval_task(threads, config, tools, base_url, people, say)
    email, person = ("sam@company.com", "Sam Lee") if name == "unwind" else ("ashu@company.com", "Ashu Kumar")
    graph = build_graph(ScriptedChatModel(plan=onboarding(email, person)), tools, threads)
    with outage(base_url, "email.send" if name == "unwind" else "", people.get("operator")):
        with threads.run(config, goal=f"Onboard {person}") as agent_run:
            say(f"  model: {ask(graph, config, f'Onboard {person}')}")
    return settled(agent_run.run, say)


def approval_task(threads: UnwindThreads, config: dict, tools: list[UnwindTool], base_url: str, people: dict,
                  say: Callable[[str], None]) -> str:
    def graph() -> Any:
        return build_graph(ScriptedChatModel(plan=onboarding("zoe@company.com", "Zoë Martin", charge=True)), tools,
                           threads)

    with threads.run(config, goal="Onboard Zoë Martin on the annual plan") as agent_run:
        say(f"  model: {ask(graph(), config, 'Onboard Zoë on the annual plan')}")
    run = agent_run.run.refresh()
    if run.status != "awaiting_approval":
        return settled(run, say)
    approval = next(a["approval"] for a in run.data["actions"] if a["status"] == "awaiting_approval")
    if people.get("approver") is None:
        say(f"  a person decides at {approval['url']}; then run this task again")
        return run.status
    requests.post(f"{base_url}/api/v1/approvals/{approval['id']}/approve", json={"reason": "annual plan as agreed"},
                  auth=people["approver"], timeout=30).raise_for_status()
    say(f"  {people['approver'][0]} approved; the thread's agent runs again in run {run.id}")
    with threads.run(config):  # the same thread: the same run, kept open while the charge waited
        say(f"  model: {ask(graph(), config, 'Carry on')}")
    return settled(run, say)


def settled(run, say: Callable[[str], None]) -> str:
    for _ in range(300):
        if run.refresh().status in ("completed", "compensated", "needs_attention", "closed"):
            break
        time.sleep(0.2)
    say(f"  run {run.id}: {run.status}. {run.trail()['headline']}")
    return run.status


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("UNWIND_URL", "http://127.0.0.1:8000"),
                        help="the Unwind server (default: $UNWIND_URL, which `. var/demo.env` sets)")
    parser.add_argument("--key", help="the agent's key (default: var/demo-agent.key, written by make demo)")
    parser.add_argument("--operator", default="operator:operator-demo", help="who injects the sandbox outage")
    parser.add_argument("--approver", default="approver:approver-demo",
                        help="who approves the charge ('' to approve in the browser yourself)")
    parser.add_argument("--task", choices=list(EXPECTED), action="append", help="run only this task (repeatable)")
    options = parser.parse_args(argv)
    key = options.key or os.environ.get("UNWIND_AGENT_KEY") or (ROOT / "var" / "demo-agent.key").read_text().strip()
    unwind = Unwind(options.url, key)
    tools = server_tools(unwind, TOOLS)
    people = {"operator": credentials(options.operator), "approver": credentials(options.approver)}
    outcomes = {name: run_task(name, unwind, tools, options.url.rstrip("/"), people, say)
                for name in options.task or EXPECTED}
    say("")
    for name, status in outcomes.items():
        say(f"{name:<10} {status:<16} {'as expected' if status == EXPECTED[name] else 'expected ' + EXPECTED[name]}")
    return 0 if all(status == EXPECTED[name] for name, status in outcomes.items()) else 1


if __name__ == "__main__":
    sys.exit(main())

