"""The MCP server over stdio (`manage.py mcp`): the official SDK's low-level `Server`, for one caller.

Each handler is the gateway's (mcp_gateway/gateway.py), as over HTTP (mcp_gateway/http.py): the tool list built per
request from the caller's tenant, tools/call answered at once (pending when a person must decide), and
`unwind_status {wait}` the only call that waits, sending progress while it does. The ledger work runs in worker
threads (`gateway.in_thread`), never on the event loop.
"""
from __future__ import annotations

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from mcp_gateway import gateway
from mcp_gateway.gateway import Caller, in_thread

INSTRUCTIONS = (
    "Unwind records every tool call of this session in a run, checks it against the tenant's policy, and undoes the "
    "run's earlier steps if one fails. Call unwind_begin first to state the goal and who you act for (optional), "
    "unwind_commit when the task is done, unwind_rollback to undo it. A step that needs approval answers pending "
    "at once, with the approval URL; wait for the person with unwind_status (action_id, wait) or call the same tool "
    "again later.")
NAME, VERSION = "unwind", "0.1.0"


async def thread(work, *args):
    return await anyio.to_thread.run_sync(lambda: in_thread(work, *args))


def build_server(caller: Caller) -> Server:
    async def list_tools(ctx: ServerRequestContext, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=await thread(gateway.tool_list, caller))

    async def call_tool(ctx: ServerRequestContext, params: types.CallToolRequestParams) -> types.CallToolResult:
        answer = await thread(gateway.dispatch, caller, params.name, params.arguments)
        bound = gateway.waiting_bound(params.name, params.arguments)
        if answer.waiting is not None and bound > 0:
            steps = gateway.progress(caller, answer, bound)
            while (step := await thread(next, steps, None)) is not None:
                await ctx.session.report_progress(*step)
            answer = await thread(gateway.answer_for, caller, answer.waiting)
        return gateway.result_of(answer)

    return Server(NAME, version=VERSION, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                  on_call_tool=call_tool)
