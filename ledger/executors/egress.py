"""Where HTTP tools may be reached, checked when a policy is written and again on every connection.

A tool URL in policy (an executor endpoint, a snapshot, lookup or verify reader) names a place Unwind
will send signed requests to and whose answers it stores. Policy can come from an attacker (a leaked
key, an injected prompt, a careless admin), so it is held to what the deployer allowed:

- Only `http` and `https`, and only the origins (scheme, host, port) listed in `UNWIND_TOOL_ORIGINS`,
  plus the origin of `UNWIND_TOOL_BASE_URL`, against which relative URLs ("/sandbox/...") resolve.
  Both are read from settings when used, never frozen at import.
- At connect time, the address actually connected to is checked: a DNS name must resolve to a public
  address (or one inside `UNWIND_TOOL_PRIVATE_NETWORKS`), so a name that resolves, or is later made to
  resolve, to loopback, link-local (cloud metadata), private, multicast, unspecified or reserved space
  is refused before a byte is sent. An allowed origin whose host is an IP literal allows exactly that
  address; one whose host is `localhost` allows loopback.
- No redirects are followed, bodies are read up to `UNWIND_TOOL_MAX_RESPONSE_BYTES`, and environment
  proxies are ignored (a proxy would hide the address connected to).
"""
from __future__ import annotations

import ipaddress
import re
import socket
import time
import unicodedata
from urllib.parse import urlsplit

import requests
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

SCHEMES = {"http": 80, "https": 443}
MAX_MESSAGE = 300
_UNSAFE_URL_CHARS = re.compile(r"[\s\x00-\x1f\x7f\\]")


class Refused(Exception):
    """A URL or an address outside what the deployer allowed. Never an OSError, so that no HTTP library
    mistakes it for a network failure worth retrying."""


# --- origins ------------------------------------------------------------------------------------

def _host_of(parts) -> str:
    host = (parts.hostname or "").rstrip(".").lower()
    return host


def origin_of(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an absolute http(s) URL; Refused with a sentence when it is not one."""
    if not isinstance(url, str) or _UNSAFE_URL_CHARS.search(url):
        raise Refused("must not contain spaces, control characters or backslashes")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise Refused(f"must be an http or https URL (or a path starting with /), not {_clip(url, 80)!r}")
    if parts.username is not None or parts.password is not None:
        raise Refused("must not carry a user name or password")
    host = _host_of(parts)
    if not host:
        raise Refused("must name a host")
    try:
        port = parts.port
    except ValueError:
        raise Refused("has a port that is not a number from 0 to 65535") from None
    return scheme, host, port or SCHEMES[scheme]


def _origin_text(origin: tuple[str, str, int]) -> str:
    scheme, host, port = origin
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def allowed_origins() -> set[tuple[str, str, int]]:
    """The origins tools may live at, as settings say now: UNWIND_TOOL_ORIGINS and the tool base URL's."""
    origins = set()
    for text in [*settings.UNWIND_TOOL_ORIGINS, settings.UNWIND_TOOL_BASE_URL]:
        try:
            origins.add(origin_of(text))
        except Refused as why:
            raise ImproperlyConfigured(f"tool origin {text!r} {why}") from None
    return origins


def private_networks() -> list:
    try:
        return [ipaddress.ip_network(text, strict=False) for text in settings.UNWIND_TOOL_PRIVATE_NETWORKS]
    except ValueError as exc:
        raise ImproperlyConfigured(f"UNWIND_TOOL_PRIVATE_NETWORKS: {exc}") from None


def check_settings() -> None:
    """Fail loudly at start on a malformed origin or network, rather than on the first tool call."""
    allowed_origins()
    private_networks()


def is_url(text: str) -> bool:
    """Policy names a reader by URL ("/path" or "http(s)://…") or by registry key (anything else)."""
    return isinstance(text, str) and (text.startswith("/") or text.lower().startswith(("http://", "https://")))


def check_url(url: str) -> None:
    """Refused unless `url` is relative (resolved against the tool base URL) or at an allowed origin."""
    if not isinstance(url, str) or not url:
        raise Refused("must be an http(s) URL or a path starting with /")
    if url.startswith("/"):
        if _UNSAFE_URL_CHARS.search(url):
            raise Refused("must not contain spaces, control characters or backslashes")
        return
    origin = origin_of(url)
    allowed = allowed_origins()
    if origin not in allowed:
        listed = ", ".join(sorted(_origin_text(o) for o in allowed))
        raise Refused(f"{_origin_text(origin)} is not an allowed tool origin (allowed: {listed}; "
                      f"a deployer adds origins with UNWIND_TOOL_ORIGINS)")


# --- addresses ----------------------------------------------------------------------------------

def _ip(text: str):
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _literal(host: str):
    try:
        return _ip(host.strip("[]"))
    except ValueError:
        return None


def address_allowed(host: str, address: str) -> bool:
    """May a connection for `host` (an allowed origin's host) go to `address`?"""
    ip = _ip(address)
    literal = _literal(host)
    if literal is not None:
        return ip == literal
    if host == "localhost":
        return ip.is_loopback
    if ip.is_global and not ip.is_multicast:
        return True
    return any(ip in network for network in private_networks())


def _guarded_new_conn(conn, scheme: str) -> socket.socket:
    """Resolve, keep only the addresses this origin may reach, connect to one of those, check the peer."""
    host = conn.host.strip("[]").rstrip(".").lower()
    if (scheme, host, conn.port) not in allowed_origins():
        raise Refused(f"{_origin_text((scheme, host, conn.port))} is not an allowed tool origin")
    try:
        infos = socket.getaddrinfo(host, conn.port, 0, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NameResolutionError(conn.host, conn, exc) from exc
    allowed = [info for info in infos if address_allowed(host, info[4][0])]
    if not allowed:
        raise Refused(f"{host} resolves to {infos[0][4][0]}, an address tools may not be reached at "
                      f"(loopback, link-local, private or reserved); a deployer allows it with "
                      f"UNWIND_TOOL_PRIVATE_NETWORKS")
    timeout = conn.timeout
    last: OSError | None = None
    for family, kind, proto, _, address in allowed:
        sock = socket.socket(family, kind, proto)
        try:
            for option in conn.socket_options or ():
                sock.setsockopt(*option)
            if isinstance(timeout, (int, float)):
                sock.settimeout(timeout)
            sock.connect(address)
        except socket.timeout as exc:
            sock.close()
            raise ConnectTimeoutError(conn, f"connection to {conn.host} timed out") from exc
        except OSError as exc:
            sock.close()
            last = exc
            continue
        peer = sock.getpeername()[0]
        if not address_allowed(host, peer):
            sock.close()
            raise Refused(f"{host} connected to {peer}, an address tools may not be reached at")
        return sock
    raise NewConnectionError(conn, f"failed to establish a new connection: {last}")


class GuardedHTTPConnection(HTTPConnection):
    def _new_conn(self) -> socket.socket:
        return _guarded_new_conn(self, "http")


class GuardedHTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:
        return _guarded_new_conn(self, "https")


class GuardedHTTPPool(HTTPConnectionPool):
    ConnectionCls = GuardedHTTPConnection


class GuardedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = GuardedHTTPSConnection


class GuardedAdapter(HTTPAdapter):
    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": GuardedHTTPPool, "https": GuardedHTTPSPool}


def session() -> requests.Session:
    """A session that reaches only allowed addresses and takes nothing from the environment (proxies, netrc)."""
    guarded = requests.Session()
    guarded.trust_env = False
    guarded.adapters.clear()
    adapter = GuardedAdapter()
    guarded.mount("https://", adapter)
    guarded.mount("http://", adapter)
    return guarded


# --- answers --------------------------------------------------------------------------------------

class TooLarge(Exception):
    pass


class TooSlow(Exception):
    pass


def read_capped(response: requests.Response, *, deadline: float) -> bytes:
    """The body, or TooLarge past UNWIND_TOOL_MAX_RESPONSE_BYTES, or TooSlow past `deadline` (monotonic):
    a per-read timeout alone lets a tool that drips a byte at a time hold a worker for ever."""
    cap = settings.UNWIND_TOOL_MAX_RESPONSE_BYTES
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > cap:
        response.close()
        raise TooLarge(f"{cap} bytes")
    chunks, total = [], 0
    for chunk in response.iter_content(64 * 1024):
        total += len(chunk)
        if total > cap:
            response.close()
            raise TooLarge(f"{cap} bytes")
        if time.monotonic() > deadline:
            response.close()
            raise TooSlow()
        chunks.append(chunk)
    return b"".join(chunks)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clean_message(text: object, limit: int = MAX_MESSAGE) -> str:
    """What an agent may see of a tool's error: one line of printable text, at most `limit` characters."""
    text = "".join(" " if unicodedata.category(ch)[0] in "CZ" and ch != " " else ch for ch in str(text))
    return _clip(" ".join(text.split()), limit)
