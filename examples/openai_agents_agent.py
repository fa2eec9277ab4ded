#!/usr/bin/env python
"""An OpenAI Agents SDK agent whose every tool call goes through Unwind, against `make demo`.

    make demo                                   # in one terminal
    .venv/bin/pip install -q -e '.[openai-agents]'    # the framework (make test installs it too)
    .venv/bin/python examples/openai_agents_agent.py

The agent's model is scripted (`ScriptedModel`, no API key, no network to a model provider): it follows each
task's plan and reads the tool outputs the adapter gives it. Three tasks:

  onboard   create a user, provision a license, send the welcome email: the run completes.
  unwind    the same while the email service is down (a fault an operator injects into the sandbox): the
            email step fails, the model reads the error, and Unwind revokes the license and deletes the user.
  approval  create a user, charge the annual plan: the charge waits for a person, the model reads "pending
            approval at URL" and stops; the approver approves (--approver) and the agent runs again in the same
            Unwind run: its repeated calls get the recorded outcomes, the charge's result included, and the run
            completes with one user and one charge.

With a real model, drop `model=ScriptedModel(...)` from the Agent (and set OPENAI_API_KEY): the tools, the run
and the outputs stay the same.

    agent = Agent(name="onboarder", instructions="Onboard new hires.", tools=function_tools(server_tools(unwind)))
    result, agent_run = asyncio.run(run_agent(agent, "Onboard Ashu Kumar", unwind=unwind))
"""
from __future__ import annotations

import argparse
import os
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import requests

try:
    from agents import Agent, Model, ModelResponse, Runner, Usage, set_tracing_disabled
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
except ImportError as missing:  # the adapter's extra is not installed: say which, not a traceback
    raise SystemExit(f"This example needs the OpenAI Agents SDK ({missing.name} is not installed): "
                     "pip install '.[openai-agents]' (or .venv/bin/pip install -e '.[openai-agents]')") from None

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.agent_loop import credentials, outage  # noqa: E402
from examples.scripted_brain import EXPECTED, TOOLS, Plan, Seen, onboarding, parse  # noqa: E402
from unwind_client import Unwind  # noqa: E402
from unwind_client.adapters import AgentRun, server_tools  # noqa: E402
from unwind_client.openai_agents import function_tools, run_agent  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class ScriptedModel(Model):
    """The SDK's Model interface, answering from a Plan: one function call per turn, then a final message."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.calls = 0

    async def get_response(self, system_instructions, input, model_settings, tools, output_schema, handoffs,
                           tracing, *, previous_response_id=None, conversation_id=None, prompt=None,
                           **kwargs: Any) -> ModelResponse:
        decision = self.plan.next(history(input))
        self.calls += 1
        if isinstance(decision, str):
            item = ResponseOutputMessage(id=f"msg-{self.calls}", type="message", role="assistant", status="completed",
                                         content=[ResponseOutputText(text=decision, type="output_text",
                                                                     annotations=[])])
        else:
            name, args = decision
            item = ResponseFunctionToolCall(id=f"fc-{self.calls}", call_id=f"call-{self.calls}", type="function_call",
                                            name=name, arguments=json.dumps(args))
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream; use Runner.run")


def history(items: str | list) -> list[Seen]:
    """The function calls in the model's input, each with the output it got (in the Responses input format)."""
    if isinstance(items, str):
        return []
    calls: dict[str, Seen] = {}
    for item in items:
        item = item if isinstance(item, dict) else item.model_dump()
        if item.get("type") == "function_call":
            calls[item["call_id"]] = Seen(item["name"], json.loads(item.get("arguments") or "{}"), None)
        elif item.get("type") == "function_call_output" and item["call_id"] in calls:
            calls[item["call_id"]].output = parse(item["output"])
    return [call for call in calls.values() if call.output is not None]


def agent_for(plan: Plan, tools: list) -> Agent:
    return Agent(name="onboarder", instructions="Onboard new hires with the tools; stop when a tool says so.",
                 tools=tools, model=ScriptedModel(plan))


async def run_task(name: str, unwind: Unwind, tools: list, base_url: str, people: dict,
                   say: Callable[[str], None] = print) -> str:
    say(f"\n[{name}]")
    if name == "approval":
        return await approval_task(unwind, tools, base_url, people, say)
    plan = onboarding("sam@company.com" if name == "unwind" else "ashu@company.com",
                      "Sam Lee" if name == "unwind" else "Ashu Kumar")
    with outage(base_url, "email.send" if name == "unwind" else "", people.get("operator")):
        result, agent_run = await run_agent(agent_for(plan, tools), f"Onboard ({name})", unwind=unwind)
    say(f"  model: {result.final_output}")
    return settled(agent_run, say)


async def approval_task(unwind: Unwind, tools: list, base_url: str, people: dict, say: Callable[[str], None]) -> str:
    agent_run = AgentRun(unwind, goal="Onboard Zoë Martin on the annual plan")
    plan = onboarding("zoe@company.com", "Zoë Martin", charge=True)
    first = await Runner.run(agent_for(plan, tools), "Onboard Zoë on the annual plan", context=agent_run)
    say(f"  model: {first.final_output}")
    await asyncio.to_thread(agent_run.commit)  # a step waits for a person: the run stays open
    waiting = [a for a in agent_run.run.refresh().data["actions"] if a["status"] == "awaiting_approval"]
    if not waiting:
        return settled(agent_run, say)
    approval = waiting[0]["approval"]
    if people.get("approver") is None:
        say(f"  a person decides at {approval['url']}; then run this task again")
        return agent_run.run.status
    requests.post(f"{base_url}/api/v1/approvals/{approval['id']}/approve", json={"reason": "annual plan as agreed"},
                  auth=people["approver"], timeout=30).raise_for_status()
    say(f"  {people['approver'][0]} approved; the agent runs again in run {agent_run.run.id}")
    second = await Runner.run(agent_for(onboarding("zoe@company.com", "Zoë Martin", charge=True), tools),
                              "Carry on", context=agent_run)
    say(f"  model: {second.final_output}")
    await asyncio.to_thread(agent_run.commit)
    return settled(agent_run, say)


def settled(agent_run: AgentRun, say: Callable[[str], None]) -> str:
    run = agent_run.run
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
    set_tracing_disabled(True)  # the SDK's tracing exports to OpenAI: not for a scripted model
    unwind = Unwind(options.url, key)
    tools = function_tools(server_tools(unwind, TOOLS))
    people = {"operator": credentials(options.operator), "approver": credentials(options.approver)}
    outcomes = {name: asyncio.run(run_task(name, unwind, tools, options.url.rstrip("/"), people, say))
                for name in options.task or EXPECTED}
    say("")
    for name, status in outcomes.items():
        say(f"{name:<10} {status:<16} {'as expected' if status == EXPECTED[name] else 'expected ' + EXPECTED[name]}")
    return 0 if all(status == EXPECTED[name] for name, status in outcomes.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
