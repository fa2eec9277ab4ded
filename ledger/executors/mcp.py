"""Upstream MCP servers: tools Unwind calls through the official `mcp` client SDK (executor `kind: mcp`).

A deployer declares the servers in settings only (`UNWIND_MCP_SERVERS`, a JSON object of name → server):

    {"crm":   {"url": "https://crm.example/mcp", "headers": {"Authorization": "Bearer …"}},
     "files": {"command": "/usr/bin/files-mcp", "args": ["--root", "/srv"], "env": {"LOG": "1"}}}

Policy names a server by its name and never carries a URL, a command, arguments or an environment: a policy
can come from an attacker (a leaked deploy key, a careless admin), and a command in it would be code run on
the Unwind host. What is enforced for a streamable HTTP server:

- Its URL must be an absolute http(s) URL at an allowed tool origin (`egress.check_url`: UNWIND_TOOL_ORIGINS
  or the origin of UNWIND_TOOL_BASE_URL), checked when the settings are read (at start), when a policy names
  the server, and before every connection.
- Every TCP connection the MCP client opens goes through `GuardedBackend`: the host must be one of the
  allowed origins' hosts and ports; the name is resolved and only addresses `egress.address_allowed` accepts
  are connected to (public ones, or loopback for `localhost`, the literal for an IP origin, or those inside
  UNWIND_TOOL_PRIVATE_NETWORKS), and the peer address is checked again once connected. A name that resolves,
  or is made to resolve, to loopback, link-local (cloud metadata) or private space is refused before a
  byte is sent.
- Environment proxies and netrc are ignored (`trust_env=False`: a proxy would hide the address connected
  to); the SDK follows a redirect only within the endpoint's origin, and that connection is checked too.

A stdio server is a command the deployer wrote in settings; it is started per call with exactly the
declared arguments and environment (over a minimal default environment, not Unwind's own).

Which revision of the protocol: `"protocol": "auto"` (the default) is the official client's own negotiation: it
probes `server/discover` and speaks 2026-07-28 (stateless: no initialize, no session) to a server that answers it,
else falls back to the `initialize` handshake. `"legacy"` sends `initialize` only (one round trip less for a server
known to speak only the handshake revisions); a modern version (`"2026-07-28"`) is adopted without a probe.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from ledger.executors import egress

SERVER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
SERVER_KEYS = {"url", "headers", "command", "args", "env", "tenants", "protocol"}
PROTOCOLS = ("auto", "legacy", "2026-07-28")
# MCP tool names (spec 2025-11-25): 1 to 128 of letters, digits, _ - . /
UPSTREAM_TOOL_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,128}$")


class NotDeclared(Exception):
    """Policy named a server the deployer did not declare."""


@dataclass(frozen=True)
class Server:
    name: str
    url: str = ""
    headers: dict = field(default_factory=dict)
    command: str = ""
    args: tuple = ()
    env: dict = field(default_factory=dict)
    tenants: tuple | None = None  # the tenants whose policy may name it; None: every tenant
    protocol: str = "auto"  # the SDK client's mode: auto (discover, else initialize), legacy, or a modern version

    def serves(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


def _strings(value: Any, where: str) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ImproperlyConfigured(f"{where} must be an object of strings")
    return dict(value)


def _server(name: Any, spec: Any) -> Server:
    where = f"UNWIND_MCP_SERVERS[{name!r}]"
    if not isinstance(name, str) or not SERVER_NAME.match(name):
        raise ImproperlyConfigured(f"{where}: a server name is 1 to 64 letters, digits, _ and -")
    if not isinstance(spec, dict):
        raise ImproperlyConfigured(f"{where} must be an object with a url or a command")
    unknown = set(spec) - SERVER_KEYS
    if unknown:
        raise ImproperlyConfigured(f"{where}.{sorted(unknown)[0]} is not a server setting "
                                   f"(known: {', '.join(sorted(SERVER_KEYS))})")
    tenants = spec.get("tenants")
    if tenants is not None and (not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants)):
        raise ImproperlyConfigured(f"{where}.tenants must be a list of tenant slugs")
    tenants = tuple(tenants) if tenants is not None else None
    protocol = spec.get("protocol", "auto")
    if protocol not in PROTOCOLS:
        raise ImproperlyConfigured(f"{where}.protocol must be one of {', '.join(PROTOCOLS)}")
    if bool(spec.get("url")) == bool(spec.get("command")):
        raise ImproperlyConfigured(f"{where} needs exactly one of url (streamable HTTP) or command (stdio)")
    if spec.get("url"):
        if set(spec) & {"args", "env"}:
            raise ImproperlyConfigured(f"{where}: args and env belong to a stdio server (command)")
        url = spec["url"]
        try:
            egress.origin_of(url)  # absolute http(s) only: an MCP endpoint is no path under the tool base URL
        except egress.Refused as why:
            raise ImproperlyConfigured(f"{where}.url {why}") from None
        return Server(name=name, url=url, headers=_strings(spec.get("headers", {}), f"{where}.headers"),
                      tenants=tenants, protocol=protocol)
    if "headers" in spec:
        raise ImproperlyConfigured(f"{where}.headers belong to a streamable HTTP server (url)")
    command, args = spec["command"], spec.get("args", [])
    if not isinstance(command, str) or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ImproperlyConfigured(f"{where}: command must be a string and args a list of strings")
    return Server(name=name, command=command, args=tuple(args), env=_strings(spec.get("env", {}), f"{where}.env"),
                  tenants=tenants, protocol=protocol)


def servers() -> dict[str, Server]:
    """The declared upstream servers, as settings say now (read when used, never frozen at import)."""
    declared = settings.UNWIND_MCP_SERVERS
    if not isinstance(declared, dict):
        raise ImproperlyConfigured("UNWIND_MCP_SERVERS must be a JSON object of server name → server")
    return {name: _server(name, spec) for name, spec in declared.items()}


def check_settings() -> None:
    """Fail loudly at start on a malformed server or a URL outside the allowed origins."""
    for declared in servers().values():
        why = origin_refusal(declared)
        if why:
            raise ImproperlyConfigured(f"UNWIND_MCP_SERVERS[{declared.name!r}].url {why}")


def origin_refusal(declared: Server) -> str | None:
    """Why a streamable HTTP server's URL is outside the allowed tool origins now, or None (stdio: always None).
    Checked at start, when policy names the server, and before every connection."""
    if not declared.url:
        return None
    try:
        egress.check_url(declared.url)
    except egress.Refused as why:
        return str(why)
    return None


def server(name: str) -> Server:
    found = servers().get(name)
    if found is None:
        declared = ", ".join(sorted(servers())) or "none"
        raise NotDeclared(f"{name!r} is not a declared MCP server (declared: {declared}); a deployer declares "
                          f"servers in UNWIND_MCP_SERVERS, policy only names them")
    return found


def endpoint(server_name: str, tool: str) -> str:
    """How a `kind: mcp` executor is stored in Tool.endpoint: "server/tool" (a server name has no "/")."""
    return f"{server_name}/{tool}"


def split_endpoint(text: str) -> tuple[str, str]:
    server_name, _, tool = text.partition("/")
    return server_name, tool


# --- the connect-time check ---------------------------------------------------------------------------

class GuardedBackend:
    """An httpcore2 network backend that connects only where `egress` allows: an allowed origin's host and
    port, at an address that host may resolve to, and checks the peer once connected.

    `refused` keeps the first refusal so that the caller can report it (the SDK turns transport exceptions
    into a closed connection)."""

    def __init__(self):
        from httpcore2._backends.anyio import AnyIOBackend

        self._inner = AnyIOBackend()
        self.refused: str | None = None

    def _refuse(self, why: str):
        self.refused = self.refused or why
        raise egress.Refused(why)

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None):
        import anyio

        name = host.strip("[]").rstrip(".").lower()
        if not any((name, port) == (h, p) for _, h, p in egress.allowed_origins()):
            self._refuse(f"{name}:{port} is not an allowed tool origin")
        infos = await anyio.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        addresses = [info[4][0] for info in infos if egress.address_allowed(name, info[4][0])]
        if not addresses:
            self._refuse(f"{name} resolves to {infos[0][4][0] if infos else 'nothing'}, an address tools may not be "
                         f"reached at (loopback, link-local, private or reserved); a deployer allows it with "
                         f"UNWIND_TOOL_PRIVATE_NETWORKS")
        stream = await self._inner.connect_tcp(addresses[0], port, timeout=timeout, local_address=local_address,
                                               socket_options=socket_options)
        peer = stream.get_extra_info("server_addr")
        if not peer or not egress.address_allowed(name, peer[0]):
            await stream.aclose()
            self._refuse(f"{name} connected to {peer[0] if peer else 'an unknown address'}, an address tools may "
                         f"not be reached at")
        return stream

    async def connect_unix_socket(self, *args, **kwargs):
        self._refuse("unix sockets are not tool origins")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def guarded_http_client(server: Server, backend: GuardedBackend, timeout: float):
    """An httpx2 client for the MCP SDK whose every connection passes GuardedBackend; no proxies, no netrc."""
    import httpcore2
    import httpx2

    transport = httpx2.AsyncHTTPTransport(trust_env=False)
    # httpx2's transport takes no network backend, so its pool is replaced by one that has ours (same settings
    # as the default, certificates verified). tests/test_mcp_proxy.py's connect-time test fails if this stops
    # taking effect.
    transport._pool = httpcore2.AsyncConnectionPool(ssl_context=httpx2.create_ssl_context(trust_env=False),
                                                    network_backend=backend)
    return httpx2.AsyncClient(transport=transport, headers=server.headers, trust_env=False, follow_redirects=False,
                              timeout=httpx2.Timeout(timeout))


# --- sessions -------------------------------------------------------------------------------------------

class Unreachable(Exception):
    """No session could be opened (refused, nothing listening, the command would not start): nothing was sent.
    `refused` when the deployer's rules turned it down (it will not change on retry)."""

    def __init__(self, message: str, *, refused: bool = False):
        super().__init__(message)
        self.refused = refused


def _unreachable(exchange: "Exchange", fallback: str) -> Unreachable:
    refused = exchange.backend.refused
    return Unreachable(refused, refused=True) if refused else Unreachable(fallback)


class Exchange:
    """One session's progress: `opened` once the client negotiated (discover or initialize succeeded: before that,
    no tools/call was sent)."""

    def __init__(self):
        self.opened = False
        self.backend = GuardedBackend()


async def _with_session(server: Server, exchange: Exchange, use: Callable[[Any], Awaitable[Any]], timeout: float):
    """Connect to `server` as its `protocol` says, and return `use(session)`; Unreachable when none opened."""
    import anyio
    from mcp import Client, StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    if server.url:
        why = origin_refusal(server)
        if why:
            raise Unreachable(f"{server.url} {why}", refused=True)
        http = guarded_http_client(server, exchange.backend, timeout)
        transport = streamable_http_client(server.url, http_client=http)
    else:
        http = None
        params = StdioServerParameters(command=server.command, args=list(server.args), env=server.env or None)
        transport = stdio_client(params, errlog=_errlog())
    try:
        # No response cache: a client lives for one call, and a listing must be read as the server has it now.
        async with Client(transport, mode=server.protocol, cache=None) as client:
            exchange.opened = True
            return await use(client.session)
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:
        if not exchange.opened:
            raise _unreachable(exchange, _describe(exc)) from exc
        raise
    finally:
        if http is not None:
            await http.aclose()


def _errlog():
    """Where a stdio server's stderr goes: the process's own stderr (a worker's log), never a captured stream."""
    return sys.__stderr__ if sys.__stderr__ is not None else open(os.devnull, "w")  # noqa: SIM115


def _describe(exc: BaseException) -> str:
    """One line about an exception, looking inside the exception groups anyio's task groups raise."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def run(server: Server, use: Callable[[Any], Awaitable[Any]], timeout: float):
    """Run one MCP exchange from synchronous code (the worker, the inline path) within `timeout` seconds.

    A fresh event loop per call, in this thread: the engine's callers are synchronous, and a session is opened
    and closed per call so that no connection (or stdio process) outlives the step that needed it. Raises
    Unreachable when no session opened (within the time, too), TimeoutError when the exchange itself ran out.
    """
    import anyio

    exchange = Exchange()

    async def bounded():
        with anyio.fail_after(timeout):
            return await _with_session(server, exchange, use, timeout)

    try:
        return anyio.run(bounded)
    except TimeoutError:
        if not exchange.opened:
            raise _unreachable(exchange, f"no session opened within {timeout:g}s") from None
        raise


def call_tool(server: Server, tool: str, args: dict, *, meta: dict, timeout: float):
    """tools/call on `server`; the SDK's CallToolResult. Raises Unreachable, TimeoutError, or the SDK's errors."""
    return run(server, lambda session: session.call_tool(tool, args, meta=meta), timeout)


def list_tools(server: Server, *, timeout: float = 30.0) -> list:
    """Every tool the server lists (following pagination), as the SDK's Tool objects."""
    async def listing(session):
        from mcp.types import PaginatedRequestParams

        tools, cursor = [], None
        while True:
            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools

    return run(server, listing, timeout)


# --- results --------------------------------------------------------------------------------------------

def result_value(result) -> Any:
    """What Unwind keeps as the step's result: structuredContent, else the text content parsed as JSON, else
    the text itself (several text blocks are joined by newlines); non-text blocks are kept as they came."""
    if result.structured_content is not None:
        return result.structured_content
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        text = "\n".join(texts)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return text
        if isinstance(value, float) and not math.isfinite(value):
            return text
        return value
    if result.content:
        return {"content": [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content]}
    return {}


def error_text(result) -> str:
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        return " ".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content)[:300]
    return "the upstream tool answered isError without a message"
