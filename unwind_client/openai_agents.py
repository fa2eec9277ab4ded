"""Unwind for the OpenAI Agents SDK (`pip install 'unwind[openai-agents]'`): every function-tool call goes through
one Unwind run per agent run.

    from agents import Agent
    from unwind_client import Unwind
    from unwind_client.adapters import server_tools
    from unwind_client.openai_agents import function_tools, run_agent

    unwind = Unwind(url, api_key="uw_…")
    agent = Agent(name="onboarder", instructions="…", tools=function_tools(server_tools(unwind)))
    result, agent_run = await run_agent(agent, "Onboard Ashu", unwind=unwind, on_behalf_of="carol@company.com")

The run opens on the agent's first tool call, with the agent's input as its goal; `run_agent` completes it when the
agent finishes and cancels it (Unwind undoes its steps) when `Runner.run` raises. A call waiting for a person,
a rejection, a refusal and a failed step come back to the model as tool outputs (JSON with `status` and
`message`, see `unwind_client.adapters.AgentRun.call`); only a wrong key or Unwind being down raise.
Declared functions (`@unwind_tool`) work the same: see `unwind_client.adapters`.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

try:
    from agents import Agent, FunctionTool, RunContextWrapper, Runner
    from agents.function_schema import function_schema
except ImportError as missing:  # pragma: no cover - exercised only without the extra
    raise ImportError("unwind_client.openai_agents needs the OpenAI Agents SDK: "
                      "pip install 'unwind[openai-agents]' (or openai-agents)") from missing

from unwind_client.adapters import AgentRun, UnwindTool
from unwind_client.client import Unwind
from unwind_client.errors import UnwindClientError

__all__ = ["function_tools", "run_agent", "agent_run_of"]


def function_tools(tools: Iterable[UnwindTool], *, run: AgentRun | None = None) -> list[FunctionTool]:
    """The SDK's function tools for these Unwind tools. Each call goes through `run`, or (by default) through the
    AgentRun given to `Runner.run` as its `context` (or found as `context.unwind_run`)."""
    return [_function_tool(tool, run) for tool in tools]


def agent_run_of(context: Any) -> AgentRun | None:
    """The AgentRun a run context carries: the context itself, or its `unwind_run` attribute."""
    if isinstance(context, AgentRun):
        return context
    found = getattr(context, "unwind_run", None)
    return found if isinstance(found, AgentRun) else None


async def run_agent(agent: Agent, input: str | list, *, unwind: Unwind, goal: str = "", on_behalf_of: str = "",
                    intent: dict | None = None, wait: float = 30.0, **runner_kwargs: Any):
    """Run the agent with one Unwind run: completed when the agent finishes, cancelled and unwound if it raises.

    Returns `(result, agent_run)`; `agent_run.run` is None when the agent called no tool. A step still waiting for a
    person when the agent finishes keeps the run open (Unwind refuses to complete it: 409 state_conflict is raised);
    call the tool again later through `AgentRun(unwind, run_id=…)` as the context of the next `Runner.run`."""
    agent_run = AgentRun(unwind, goal=goal or (input if isinstance(input, str) else ""), on_behalf_of=on_behalf_of,
                         intent=intent, wait=wait)
    try:
        result = await Runner.run(agent, input, context=agent_run, **runner_kwargs)
    except BaseException as exc:
        await asyncio.to_thread(_rollback_quietly, agent_run, exc)
        raise
    await asyncio.to_thread(agent_run.commit)
    return result, agent_run


def _rollback_quietly(agent_run: AgentRun, exc: BaseException) -> None:
    agent_run.__exit__(type(exc), exc, None)


def _function_tool(tool: UnwindTool, fixed: AgentRun | None) -> FunctionTool:
    if tool.function is not None:
        schema = function_schema(tool.function, name_override=tool.model_name,
                                 description_override=tool.description or None)
        params, strict = schema.params_json_schema, schema.strict_json_schema
    else:  # a tool Unwind executes: its schema as Unwind has it, which strict mode may not accept (formats, patterns)
        params, strict = tool.args_schema, False

    async def invoke(ctx: RunContextWrapper[Any], raw: str) -> str:
        agent_run = fixed or agent_run_of(ctx.context)
        if agent_run is None:
            raise UnwindClientError(f"{tool.model_name}: no Unwind run; pass context=AgentRun(...) to Runner.run, "
                                    "or use unwind_client.openai_agents.run_agent")
        try:
            args = json.loads(raw or "{}")
        except ValueError:
            return json.dumps({"status": "refused", "code": "invalid_json",
                               "message": "refused: the arguments are not JSON; send a JSON object"})
        if not isinstance(args, dict):
            return json.dumps({"status": "refused", "code": "invalid_json",
                               "message": "refused: the arguments must be a JSON object"})
        answer = await asyncio.to_thread(agent_run.call, tool, args)
        return answer.text

    return FunctionTool(name=tool.model_name, description=tool.description or tool.name, params_json_schema=params,
                        on_invoke_tool=invoke, strict_json_schema=strict)
