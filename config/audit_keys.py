"""The audit chain's HMAC keys, read from the environment (never from the database).

Someone who can write to the database can recompute a plain hash chain; they cannot recompute an HMAC
without its key, so the key lives in the environment or in a file the settings name. Each event records
the id of the key it was made with (the first 8 hex digits of the key's SHA-256), so keys can be rotated:
the current key signs new events, old keys stay listed for verification only.

- UNWIND_AUDIT_KEY / UNWIND_AUDIT_KEY_FILE: the current key (text, at least 32 characters), or a file
  holding it (surrounding whitespace and the trailing newline are ignored). Not both.
- UNWIND_AUDIT_OLD_KEYS: older keys, separated by commas (a key holding a comma goes in a file instead).
- UNWIND_AUDIT_OLD_KEY_FILES: files holding older keys, one key per file, paths separated by commas.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

MIN_KEY_LENGTH = 32


def key_id(key: bytes) -> str:
    """A short public name for a key: enough to tell keys apart, useless for recovering one."""
    return hashlib.sha256(key).hexdigest()[:8]


def _read_key_file(path: str, *, variable: str) -> bytes:
    try:
        return Path(path).read_bytes().strip()
    except OSError as exc:
        raise ImproperlyConfigured(f"{variable}: cannot read the audit key file {path!r} ({exc.strerror}).") from None


def _checked(key: bytes, *, variable: str) -> bytes:
    if len(key) < MIN_KEY_LENGTH:
        raise ImproperlyConfigured(
            f"{variable} must be at least {MIN_KEY_LENGTH} characters long (for example `openssl rand -hex 32`).")
    return key


def _split(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def load_audit_keys(*, secret_key: str, allow_dev_key: bool) -> tuple[str, dict[str, bytes]]:
    """(id of the current key, {key id: key} for the current and every old key), or ImproperlyConfigured."""
    inline, named = os.environ.get("UNWIND_AUDIT_KEY", ""), os.environ.get("UNWIND_AUDIT_KEY_FILE", "")
    if inline and named:
        raise ImproperlyConfigured("Set UNWIND_AUDIT_KEY or UNWIND_AUDIT_KEY_FILE, not both.")
    if inline:
        current = _checked(inline.strip().encode(), variable="UNWIND_AUDIT_KEY")
    elif named:
        current = _checked(_read_key_file(named, variable="UNWIND_AUDIT_KEY_FILE"), variable="UNWIND_AUDIT_KEY_FILE")
    elif allow_dev_key:
        # Development and tests only: derived from SECRET_KEY, so anyone who knows that key can rewrite the chain.
        current = hashlib.sha256(b"unwind-audit-chain-dev-key:" + secret_key.encode()).hexdigest().encode()
    else:
        raise ImproperlyConfigured(
            "UNWIND_AUDIT_KEY (or UNWIND_AUDIT_KEY_FILE) must be set when DEBUG is off: it keys the audit chain "
            "so that someone with database access cannot rewrite it (for example `openssl rand -hex 32`).")
    keys = {key_id(current): current}
    for old in _split(os.environ.get("UNWIND_AUDIT_OLD_KEYS", "")):
        key = _checked(old.encode(), variable="UNWIND_AUDIT_OLD_KEYS")
        keys.setdefault(key_id(key), key)
    for path in _split(os.environ.get("UNWIND_AUDIT_OLD_KEY_FILES", "")):
        key = _checked(_read_key_file(path, variable="UNWIND_AUDIT_OLD_KEY_FILES"),
                       variable="UNWIND_AUDIT_OLD_KEY_FILES")
        keys.setdefault(key_id(key), key)
    return key_id(current), keys
