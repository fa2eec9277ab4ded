"""Where Unwind's own links and relative tool URLs point, checked against the port a server is started on.

`UNWIND_BASE_URL` (links in emails and share links) and `UNWIND_TOOL_BASE_URL` (what a relative tool URL such
as `/sandbox/hr/users` resolves against) default to http://127.0.0.1:8000. A development server started on
another port would then send its relative tool calls to whatever listens on 8000 — another Unwind, another
demo — and nothing would say so. So `manage.py runserver` (config/management/commands/runserver.py) calls
`follow_serving_port`: without those variables in the environment, both follow the port it serves on; with an
UNWIND_BASE_URL on this machine but another port, and no UNWIND_TOOL_BASE_URL saying where the tools live, it
refuses to start and says why.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from django.conf import settings

LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}


class PortMismatch(Exception):
    """UNWIND_BASE_URL names this machine on another port than the server listens on."""


def _url_host(host: str) -> str:
    host = host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _port_of(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        port = None
    return (parts.hostname or "").lower(), port


def follow_serving_port(host: str, port: int | str, environ=os.environ) -> str:
    """Point the base URLs at the served port when the environment does not name them; refuse a mismatch.

    Returns the base URL in force. Sets the environment too, so a process started from this one (the
    autoreloader's child, a worker) agrees with it.
    """
    port = int(port)
    served = f"http://{_url_host(host)}:{port}"
    base_given = bool(environ.get("UNWIND_BASE_URL", "").strip())
    tool_given = bool(environ.get("UNWIND_TOOL_BASE_URL", "").strip())
    if not base_given:
        settings.UNWIND_BASE_URL = environ["UNWIND_BASE_URL"] = served
        if not tool_given:
            settings.UNWIND_TOOL_BASE_URL = environ["UNWIND_TOOL_BASE_URL"] = served
        return served
    base_host, base_port = _port_of(settings.UNWIND_BASE_URL)
    if not tool_given and base_host in LOOPBACK and base_port != port:
        raise PortMismatch(
            f"UNWIND_BASE_URL is {settings.UNWIND_BASE_URL}, but this server listens on port {port}: its links and "
            f"its relative tool URLs (/sandbox/…) would go to whatever listens on port {base_port}, not to this "
            f"server. Set UNWIND_BASE_URL={served} (or leave it unset, and it follows the port), or set "
            f"UNWIND_TOOL_BASE_URL to where the tools really live.")
    return settings.UNWIND_BASE_URL
