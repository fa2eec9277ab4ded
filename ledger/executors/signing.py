"""Tool requests signed by Unwind, so a tool can tell Unwind's calls, and on whose behalf, from anyone else's.

Every HTTP request Unwind sends to a tool (a call, a snapshot read, a lookup) carries:

    Unwind-Tenant:    the tenant's slug
    Unwind-Timestamp: seconds since the epoch
    Unwind-Signature: v1=<hex HMAC-SHA256 over "v1.<timestamp>.<tenant>.<METHOD>.<path?query>.<sha256(body)>">

keyed with `UNWIND_TOOL_SIGNING_KEY`. A tool that shares the key checks the signature and the age, like a
webhook receiver does; the sandbox does so to keep each tenant's world apart.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlsplit

from django.conf import settings

VERSION = "v1"
TENANT_HEADER = "Unwind-Tenant"
TIMESTAMP_HEADER = "Unwind-Timestamp"
SIGNATURE_HEADER = "Unwind-Signature"
MAX_AGE_SECONDS = 300


def _key() -> bytes:
    return settings.UNWIND_TOOL_SIGNING_KEY.encode()


def _message(*, timestamp: str, tenant: str, method: str, path: str, body: bytes) -> bytes:
    return ".".join([VERSION, timestamp, tenant, method.upper(), path, hashlib.sha256(body).hexdigest()]).encode()


def _path_of(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def sign(*, tenant: str, method: str, url: str, body: bytes = b"", now: float | None = None) -> dict[str, str]:
    """The headers that sign one request to `url` made for `tenant`."""
    timestamp = str(int(now if now is not None else time.time()))
    mac = hmac.new(_key(), _message(timestamp=timestamp, tenant=tenant, method=method, path=_path_of(url), body=body),
                   hashlib.sha256).hexdigest()
    return {TENANT_HEADER: tenant, TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: f"{VERSION}={mac}"}


def verify(*, headers, method: str, path: str, body: bytes, now: float | None = None) -> str | None:
    """The tenant a signed request was made for, or None when it is unsigned, forged, or too old.

    `headers` is any mapping with case-insensitive lookups (a Django request's `headers`); `path` includes
    the query string as sent (`request.get_full_path()`).
    """
    tenant = headers.get(TENANT_HEADER, "")
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    scheme, _, mac = headers.get(SIGNATURE_HEADER, "").partition("=")
    if not (tenant and timestamp.isdigit() and scheme == VERSION and mac):
        return None
    if abs((now if now is not None else time.time()) - int(timestamp)) > MAX_AGE_SECONDS:
        return None
    expected = hmac.new(_key(), _message(timestamp=timestamp, tenant=tenant, method=method, path=path, body=body),
                        hashlib.sha256).hexdigest()
    return tenant if hmac.compare_digest(expected, mac) else None
