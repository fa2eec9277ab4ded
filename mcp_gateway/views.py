"""POST/DELETE /mcp: the MCP endpoint, for agents only (their key as `Authorization: Bearer uw_…`).

Who may call: an agent with a valid, unrevoked key; it then sees and calls its own tenant's tools in its own runs,
exactly as over the REST API. A person (session cookie or HTTP Basic) or a deploy key is refused, and a missing or
wrong key answers 401 before the protocol is looked at (mcp_gateway/http.py), so no MCP session is ever created
for it.
"""
from __future__ import annotations

import math

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from ledger.api.auth import DEPLOY_KEY_CANNOT_ACT
from ledger.api.problems import problem
from ledger.api.throttle import AgentKeyThrottle
from ledger.tenancy import DEPLOY_KEY_PREFIX, agent_authenticate
from mcp_gateway import http, modern

CHALLENGE = 'Bearer realm="unwind"'


def refusal(request, *, status: int, code: str, title: str, detail: str) -> JsonResponse:
    response = JsonResponse(problem(status=status, code=code, title=title, detail=detail, instance=request.path),
                            status=status, content_type="application/problem+json")
    if status == 401:
        response["WWW-Authenticate"] = CHALLENGE
    return response


def key_of(request) -> str | None:
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


class KeyHolder:
    """What the REST API's per-key throttle reads of a request: the agent (one budget per key, MCP and REST)."""

    def __init__(self, agent):
        self.auth = agent


@csrf_exempt  # no cookie is ever accepted here: the caller is whoever holds the Bearer key
def mcp_endpoint(request):
    """Under the ASGI server an `unwind_status {wait}` waits on the event loop once this has answered, not in a
    thread (ledger/api/waits.py)."""
    token = key_of(request)
    if token is not None and token.startswith(DEPLOY_KEY_PREFIX):
        return refusal(request, status=403, code="deploy_key_cannot_act", title="Not allowed",
                       detail=DEPLOY_KEY_CANNOT_ACT)
    agent = agent_authenticate(token) if token is not None else None
    if agent is None:
        if token is None:
            return refusal(request, status=401, code="not_authenticated", title="Authentication required",
                           detail="send the agent's key as: Authorization: Bearer uw_… (people and deploy keys "
                                  "cannot use MCP)")
        return refusal(request, status=401, code="authentication_failed", title="Authentication failed",
                       detail="unknown or revoked API key")
    throttle = AgentKeyThrottle()
    if not throttle.allow_request(KeyHolder(agent), None):
        response = refusal(request, status=429, code="throttled", title="Too many requests",
                           detail="this agent key is over UNWIND_THROTTLE_RATE (shared with the REST API); retry later")
        response["Retry-After"] = str(max(1, math.ceil(throttle.wait())))
        return response
    if request.method not in ("POST", "DELETE"):
        response = refusal(request, status=405, code="method_not_allowed", title="Method not allowed",
                           detail="this MCP endpoint takes POST (and DELETE to end a session); it offers no "
                                  "standalone GET stream: messages ride the response of the request they belong to")
        response["Allow"] = "POST, DELETE"
        return response
    if modern.is_modern(request):
        return modern.serve(request, agent)  # 2026-07-28: stateless, no session
    return http.serve(request, agent)

