"""A small upstream MCP server for the proxy tests (tests/test_mcp_proxy.py), built with the `mcp` SDK's MCPServer.

    python tests/mcp_upstream_server.py http PORT EFFECTS_FILE    # streamable HTTP on 127.0.0.1:PORT/mcp
    python tests/mcp_upstream_server.py stdio EFFECTS_FILE        # stdio

A seat-booking world: seat 12A is taken, card "declined" has no funds. Every call that acts appends one JSON
line to EFFECTS_FILE (tool, args, the idempotency key Unwind sent in `_meta`), so a test can see what reached
the upstream from another process.
"""
from __future__ import annotations

import json
import sys
import time

from pydantic import BaseModel

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations

EFFECTS = sys.argv[-1]
TAKEN = {"12A"}
app = MCPServer("seats", log_level="WARNING")


def record(tool: str, args: dict, ctx: Context) -> None:
    meta = ctx.request_context.meta or {}
    with open(EFFECTS, "a") as out:
        line = {"tool": tool, "args": args, "key": meta.get("unwind/idempotency_key")}
        if meta.get("traceparent"):  # W3C trace context, when the caller traces (tests/test_tracing.py)
            line["traceparent"] = meta.get("traceparent")
        line["protocol"] = ctx.protocol_version  # the revision the call came in
        out.write(json.dumps(line) + "\n")


class Booking(BaseModel):
    booking_id: str
    seat: str


@app.tool(description="Book a seat on the flight.", annotations=ToolAnnotations(destructive_hint=False))
def book(seat: str, ctx: Context) -> Booking:
    if seat in TAKEN:
        raise ToolError(f"seat {seat} is taken: choose another seat")
    TAKEN.add(seat)
    record("book", {"seat": seat}, ctx)
    return Booking(booking_id=f"bk-{seat}", seat=seat)


@app.tool(description="Cancel a booking.")
def cancel(booking_id: str, ctx: Context) -> str:
    TAKEN.discard(booking_id.removeprefix("bk-"))
    record("cancel", {"booking_id": booking_id}, ctx)
    return json.dumps({"cancelled": booking_id})


@app.tool(description="Charge a card.", annotations=ToolAnnotations(destructive_hint=True))
def charge(card: str, amount: int, ctx: Context) -> dict:
    if card == "declined":
        raise ToolError("insufficient funds: use another card")
    record("charge", {"card": card, "amount": amount}, ctx)
    return {"charge_id": f"ch-{card}"}


@app.tool(description="Take longer than any sensible timeout, after acting.")
def slow(note: str, ctx: Context) -> str:
    record("slow", {"note": note}, ctx)
    time.sleep(5)
    return "done"


@app.tool(description="Answer `size` characters.")
def big(size: int) -> str:
    return "x" * size


@app.tool(description="List the seats still free.", annotations=ToolAnnotations(read_only_hint=True))
def free_seats() -> list[str]:
    return [f"{row}{seat}" for row in (11, 12) for seat in "ABC" if f"{row}{seat}" not in TAKEN]


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        app.run()
    else:
        # Reached as 127.0.0.1 and, in the connect-time test, by another name for loopback ("vm" in /etc/hosts).
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]),
                transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
