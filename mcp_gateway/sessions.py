"""How many MCP sessions an agent holds, and when one is removed.

Each `initialize` over HTTP writes a session row (mcp_gateway/http.py), so one key looping on initialize could grow
the table without end. Two things bound it:

- **A cap per agent.** An agent holds at most UNWIND_MCP_MAX_SESSIONS_PER_AGENT open HTTP sessions. Opening one more
  ends the agent's least recently used session (its row is deleted; so are the sessions it ended with DELETE, so
  rows do not pile up even without a worker): that session's id then answers 404 "Session not
  found", which the MCP spec tells a client to answer with a new `initialize`, and its run, if any, stays as it is
  (take it up with `unwind_begin {run_id}`; the idle sweep unwinds it otherwise). The new session is never refused:
  a client that crashed without ending its sessions (no DELETE) can always reconnect, and whoever loops on
  initialize only ends its own sessions, never another agent's. The count is taken under a lock on the agent's row,
  so two web processes opening sessions for one agent at once cannot both stay under the cap by one.
- **The sweep** (the worker's, through the engine's `sweep` event) removes ended sessions (DELETE) and sessions idle
  longer than UNWIND_MCP_SESSION_IDLE whose run is no longer open. A session whose run still runs or awaits
  approval is kept: its run's idle timeout (at most the same UNWIND_MCP_SESSION_IDLE) or the approval's expiry ends
  the run first, and the next sweep removes the session.

A stdio session (`manage.py mcp`) is one per process, started by someone with a shell: it is not capped, and the sweep
removes it on the same terms (the process writes its row again on its next call, without a run).
"""
from __future__ import annotations

import logging
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from ledger.models import Agent, RunStatus as R
from mcp_gateway.models import McpSession

log = logging.getLogger("unwind.mcp")
OPEN_RUN = (R.RUNNING, R.AWAITING_APPROVAL)  # a run the session may still act in (gateway.OPEN)
BATCH = 1000


def session_open(*, agent: Agent) -> McpSession:
    """A new HTTP session of `agent`; past the agent's cap its least recently used sessions are ended (deleted)."""
    cap = settings.UNWIND_MCP_MAX_SESSIONS_PER_AGENT
    with transaction.atomic():
        # One agent's opens take turns (FOR NO KEY UPDATE; a session's foreign key only takes KEY SHARE on the row).
        Agent.objects.select_for_update(no_key=True).filter(pk=agent.pk).values_list("pk", flat=True).first()
        session = McpSession.objects.create(session_id=secrets.token_hex(16), transport=McpSession.HTTP,
                                            tenant_id=agent.tenant_id, agent=agent)
        held = list(McpSession.objects.filter(agent=agent, transport=McpSession.HTTP, ended_at__isnull=True)
                    .order_by("-last_activity_at", "-pk").values_list("pk", flat=True)[cap:cap + BATCH])
        if held:
            McpSession.objects.filter(pk__in=held).delete()
            log.info("mcp: agent %s opened a session past its cap of %s; ended %s least recently used",
                     agent.pk, cap, len(held))
        # Sessions the agent ended (DELETE) go now too: a loop of initialize and DELETE leaves at most one behind,
        # with or without a worker to sweep.
        McpSession.objects.filter(agent=agent, transport=McpSession.HTTP, ended_at__isnull=False).delete()
    return session


def sessions_sweep(*, now) -> int:
    """Remove ended sessions, and sessions idle past UNWIND_MCP_SESSION_IDLE whose run is not open. How many."""
    idle_since = now - timedelta(seconds=settings.UNWIND_MCP_SESSION_IDLE)
    idle = Q(last_activity_at__lt=idle_since) & (Q(run__isnull=True) | ~Q(run__status__in=OPEN_RUN))
    gone = list(McpSession.objects.filter(Q(ended_at__isnull=False) | idle).values_list("pk", flat=True)[:BATCH])
    if gone:
        McpSession.objects.filter(pk__in=gone).delete()
    return len(gone)


def on_sweep(*, now) -> None:
    removed = sessions_sweep(now=now)
    if removed:
        log.info("sweep: removed %s MCP sessions (ended, or idle with no open run)", removed)
