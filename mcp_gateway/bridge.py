"""Streamable HTTP inside the Django app: a WSGI view handing each request to the SDK's ASGI session manager.

The SDK's `StreamableHTTPSessionManager` is an ASGI app that keeps its sessions in an anyio task group, so it needs
one long-lived event loop. Unwind serves WSGI (`runserver` in `make demo`, gunicorn in production, the tests' live
server), so the gateway runs that loop in one background thread per process and bridges each request to it: the
request's body is fed in as ASGI `receive`, and what the SDK `send`s (the status, then SSE events as they come:
progress notifications, then the result) is streamed out as the Django response. Sessions therefore live in the
process that created them: behind a load balancer with several processes, route a session's requests to one
process (sticky on the `Mcp-Session-Id` header); see docs/mcp.md.

Only POST and DELETE are bridged. GET (the optional standalone stream for server-initiated messages) answers 405,
as the spec allows: Unwind's messages (progress, results) ride the response of the request they belong to, and no
thread is held open waiting for messages that never come.
"""
from __future__ import annotations

import asyncio
import queue
import threading

from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from ledger.models import Agent
from mcp_gateway.gateway import Caller
from mcp_gateway.models import McpSession
from mcp_gateway.server import build_server

DONE = object()
START_TIMEOUT = 30.0
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade"}
AGENT_KEY = "unwind.agent_id"
BASE_URL = "unwind.base_url"


def identify_http(ctx: ServerRequestContext) -> Caller:
    """The caller of an HTTP request: the agent the view authenticated, and the session the SDK issued."""
    scope = ctx.request.scope
    session_id = ctx.request.headers.get("mcp-session-id") or ""
    return Caller(agent_id=scope[AGENT_KEY], session_id=session_id, transport=McpSession.HTTP,
                  base_url=scope[BASE_URL])


class Bridge:
    """One per process: the event loop thread and the session manager it runs, started on the first request."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._manager: StreamableHTTPSessionManager | None = None

    def ensure_started(self) -> None:
        with self._lock:
            if self._loop is not None:
                return
            ready = threading.Event()
            threading.Thread(target=self._main, args=(ready,), name="mcp-gateway", daemon=True).start()
            if not ready.wait(10):
                raise RuntimeError("the MCP gateway's event loop did not start")

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._serve(loop, ready))

    async def _serve(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        manager = StreamableHTTPSessionManager(
            app=build_server(identify_http), json_response=False, stateless=False,
            # Host is checked by Django (ALLOWED_HOSTS); a browser cannot send the Bearer key a call needs, so
            # DNS rebinding gains a page nothing.
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            # The SDK forgets an idle session a little after its run's idle deadline has unwound it.
            session_idle_timeout=settings.UNWIND_MCP_SESSION_IDLE + 60)
        async with manager.run():
            self._manager, self._loop = manager, loop
            ready.set()
            await asyncio.Event().wait()

    def serve(self, request, agent: Agent) -> HttpResponse:
        """Run one HTTP request through the SDK and stream its answer back."""
        self.ensure_started()
        loop, manager = self._loop, self._manager
        out: queue.Queue = queue.Queue()
        disconnected = asyncio.Event()
        body = request.body
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            out.put(message)

        future = asyncio.run_coroutine_threadsafe(manager.handle_request(scope_of(request, agent), receive, send), loop)
        future.add_done_callback(lambda _: out.put(DONE))
        start = out.get(timeout=START_TIMEOUT)
        if start is DONE or start.get("type") != "http.response.start":
            loop.call_soon_threadsafe(disconnected.set)
            future.result(timeout=1)  # raises what went wrong, for the server's error log
            raise RuntimeError("the MCP session manager answered without a response")

        def chunks():
            try:
                while True:
                    message = out.get()
                    if message is DONE:
                        return
                    if message.get("type") == "http.response.body":
                        if message.get("body"):
                            yield message["body"]
                        if not message.get("more_body"):
                            return
            finally:
                loop.call_soon_threadsafe(disconnected.set)

        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in start.get("headers", [])]
        streamed = any(name.lower() == "content-type" and value.startswith("text/event-stream")
                       for name, value in headers)
        # An event stream is passed on as it comes (progress, then the result); any other answer is short: whole.
        response = (StreamingHttpResponse(chunks(), status=start["status"]) if streamed else
                    HttpResponse(b"".join(chunks()), status=start["status"]))
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP:
                response[name] = value
        return response


def scope_of(request, agent: Agent) -> dict:
    """The ASGI scope of a Django request, with the agent it authenticated (never its key) for the SDK and us."""
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1"))
               for name, value in request.headers.items() if name.lower() != "authorization"]
    host = request.get_host()
    server_name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": request.scheme, "path": request.path, "raw_path": request.path.encode(), "root_path": "",
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"), "headers": headers,
        "server": (server_name or host, int(port) if port.isdigit() else None),
        "client": (request.META.get("REMOTE_ADDR", ""), 0),
        # The SDK binds each session to this principal: a request for it with another agent's key answers 404.
        "user": AuthenticatedUser(AccessToken(token="agent", client_id=f"agent:{agent.pk}", scopes=[])),
        AGENT_KEY: agent.pk,
        BASE_URL: f"{request.scheme}://{host}",
    }


bridge = Bridge()
