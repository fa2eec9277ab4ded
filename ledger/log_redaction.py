"""What would let a reader act as someone stays out of log lines and spans (issue 39, finding 5).

Approval links and correction-trail share links are bearer tokens in the URL path, stored only as hashes: whoever
has one may decide (or stop a step, or ask) once, as the person it was made for. Django logs the path of every 4xx
(`django.request`: "Forbidden (CSRF cookie not set.): /approvals/link/<token>/"), so a logged link could be
replayed from the logs. `RedactSecrets`, a filter on every handler in config/settings.py's LOGGING (Django's own
included), rewrites each record before any handler formats it; `redact` does the same for the request span's name
(ledger/tracing.py).

What is replaced by `[redacted]`:
- the token segment of every token-bearing route: each `path()` of the URLconf with a `<…:token>` parameter, found
  from the URLconf itself (today `/approvals/link/`, `/console/trail/` and the routes below it), in a path or a
  whole URL, also percent-encoded (`?next=%2Fapprovals%2Flink%2F…`);
- values of query-string parameters named like secrets (`token`, `…_token`, `key`, `api_key`, `secret`, `password`,
  `signature`, `sig`, `code`);
- the secret half of Unwind's agent and deploy keys (`uw_<prefix>_…`, `uwd_<prefix>_…`: the prefix names the key
  and stays);
- Slack's secrets: bot and user tokens (`xoxb-…`) and the path of a `hooks.slack.com` URL (an interaction's
  `response_url` answers in the channel without a signature).
"""
from __future__ import annotations

import logging
import re
import threading

REDACTED = "[redacted]"
TOKEN_PARAMETER = "token"  # the URL parameter that marks a token-bearing route: path("…/<str:token>/", …)

_SEPARATOR = r"(?:/|%2[Ff])"
_SEGMENT = r"[^/\s?#&%\"'<>;,()\[\]]+"
_CONVERTER = re.compile(r"<(?:(?P<kind>[^>:]+):)?(?P<name>[^>]+)>")
_ALWAYS = [
    (re.compile(r"(?i)([?&;](?:[\w.-]*(?:token|secret|password|passwd|signature|api_?key)|key|sig|code)=)"
                r"[^&\s#\"'<>]+"), r"\1" + REDACTED),
    (re.compile(r"\b(uwd?_[0-9a-f]{12}_)[A-Za-z0-9_-]+"), r"\1" + REDACTED),
    (re.compile(r"\bxox[a-z]-[A-Za-z0-9-]+"), "xox-" + REDACTED),
    (re.compile(r"(?i)(hooks\.slack\.com/)[^\s\"'<>]+"), r"\1" + REDACTED),
]

_routes: re.Pattern | None = None
_routes_lock = threading.Lock()


def token_route_prefixes() -> list[str]:
    """The URL prefix of each token-bearing route, up to its token ("console/trail/"), from the root URLconf."""
    from django.urls import URLResolver, get_resolver
    from django.urls.resolvers import RoutePattern

    found = []

    def walk(patterns, prefix: str) -> None:
        for entry in patterns:
            route = prefix + str(entry.pattern)
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, route)
            elif isinstance(entry.pattern, RoutePattern) and TOKEN_PARAMETER in entry.pattern.converters:
                marker = next(m for m in _CONVERTER.finditer(route) if m.group("name") == TOKEN_PARAMETER)
                found.append(route[:marker.start()])

    walk(get_resolver().url_patterns, "")
    return sorted(set(found))


def _route_pattern() -> re.Pattern | None:
    """One expression for every token route's prefix, its token in group `token`; None until the apps are ready."""
    global _routes
    if _routes is not None:
        return _routes
    from django.apps import apps

    if not apps.ready:
        return None
    with _routes_lock:
        if _routes is None:
            alternatives = []
            for prefix in token_route_prefixes():
                parts, at = [], 0
                for converter in _CONVERTER.finditer(prefix):
                    parts.append(re.escape(prefix[at:converter.start()]))
                    parts.append(_SEGMENT)
                    at = converter.end()
                parts.append(re.escape(prefix[at:]))
                alternatives.append("".join(parts).replace("/", _SEPARATOR))
            body = "|".join(alternatives) or r"(?!)"
            _routes = re.compile(rf"({_SEPARATOR}(?:{body}))(?P<token>{_SEGMENT})")
    return _routes


def redact(text: str) -> str:
    """`text` with every secret named in this module's docstring replaced by `[redacted]`."""
    if not text:
        return text
    routes = _route_pattern()
    if routes is not None:
        text = routes.sub(lambda match: match.group(1) + REDACTED, text)
    for pattern, replacement in _ALWAYS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    """On every handler (config/settings.py, LOGGING): the record's message, exception and stack text are redacted
    before any formatter reads them, and a request whose URL holds a secret is taken off the record (Django's
    `mail_admins` would mail its path, query string and headers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - arguments that do not fit the format: the format alone, redacted
            record.msg, record.args = redact(str(record.msg)), ()
        else:
            clean = redact(message)
            if clean != message:
                record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        request = getattr(record, "request", None)
        if request is not None and hasattr(request, "get_full_path"):
            path = request.get_full_path()
            if redact(path) != path:
                record.request = None
        return True
