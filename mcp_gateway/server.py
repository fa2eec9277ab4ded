"""The MCP server itself (the official SDK's low-level `Server`): tools/list and tools/call for one caller at a time.

The tool list is built per request from the caller's tenant, so it is always the tenant's current tools. Who the
caller is comes from `identify(ctx)`: over HTTP, what the view authenticated (mcp_gateway/bridge.py); over stdio,
the agent key the command was started with. The ledger work runs in worker threads (`gateway.in_thread`), never
on the event loop.
"""
from __future__ import annotations

from collections.abc import Callable

import anyio
import mcp_types as types
from django.conf import settings
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from mcp_gateway import gateway
from mcp_gateway.gateway import Answer, Caller, in_thread

PROGRESS_EVERY = 1.0
INSTRUCTIONS = (
    "Unwind records every tool call of this session in a run, checks it against the tenant's policy, and undoes the "
    "run's earlier steps if one fails. Call unwind_begin first to state the goal and who you act for (optional), "
    "unwind_commit when the task is done, unwind_rollback to undo it. A step that needs approval answers pending "
    "with the approval URL; wait with unwind_status (action_id, wait) or call the same tool again.")

Identify = Callable[[ServerRequestContext], Caller]


async def thread(work, *args):
    return await anyio.to_thread.run_sync(lambda: in_thread(work, *args))


def result_of(answer: Answer) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=answer.text())],
                                structured_content=answer.payload, is_error=answer.is_error)


async def wait_for(ctx: ServerRequestContext, caller: Caller, answer: Answer, bound: float) -> Answer:
    """Wait up to `bound` seconds for a pending step, sending progress (when the client asked for it) meanwhile."""
    waited = 0.0
    while waited < bound:
        step = min(PROGRESS_EVERY, bound - waited)
        done = await thread(gateway.wait_slice, caller, answer.waiting, step)
        waited += step
        if done:
            return await thread(gateway.answer_for, caller, answer.waiting)
        message = answer.payload.get("message", "waiting")
        await ctx.session.report_progress(waited, bound, message)
    return await thread(gateway.answer_for, caller, answer.waiting)


def waiting_bound(name: str, arguments) -> float:
    if name == "unwind_status":
        return float((arguments or {}).get("wait", 0))  # validated by gateway.status before any answer waits
    if name in gateway.GATEWAY_NAMES:
        return 0.0
    return settings.UNWIND_MCP_APPROVAL_WAIT


def build_server(identify: Identify) -> Server:
    async def list_tools(ctx: ServerRequestContext, params) -> types.ListToolsResult:
        tools = await thread(gateway.tool_list, identify(ctx))
        return types.ListToolsResult(tools=[types.Tool(**tool) for tool in tools])

    async def call_tool(ctx: ServerRequestContext, params: types.CallToolRequestParams) -> types.CallToolResult:
        caller = identify(ctx)
        answer = await thread(gateway.dispatch, caller, params.name, params.arguments)
        bound = waiting_bound(params.name, params.arguments)
        if answer.waiting is not None and bound > 0:
            answer = await wait_for(ctx, caller, answer, bound)
        return result_of(answer)

    return Server("unwind", version="0.1.0", instructions=INSTRUCTIONS, on_list_tools=list_tools,
                  on_call_tool=call_tool)
