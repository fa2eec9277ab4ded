"""The keys the chain's fingerprints of a person's data are made under (issue 42, erasure).

A run acted for someone (`Run.on_behalf_of`) gets a random key when it opens (`Run.fingerprint_key`). The fingerprints
and seals of the run, of its steps and of the rows that belong to it (approval requests, recovery items) are recorded
as HMAC-SHA256 under that key instead of the bare SHA-256 digest: the chain covers a keyed digest of the person's
data, never a digest anyone could test a guess against once the key is gone. Erasing the person (recovery/erasure.py)
blanks the key of each of their runs (crypto-shredding of the digests), while the chain still verifies: the erasure's
event vouches for the rows as erasure left them.

One key per run rather than per person: the key travels with the run's row, which the engine reads anyway, so keying
costs no query on the hot path; and two runs of one person are not linked by their digests. A run acted for nobody,
and one opened before keys existed, has none: its fingerprints stay bare digests (`verify_chain` accepts either form,
so chains written before keys existed verify as written).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from contextlib import contextmanager

from ledger.db import sql
from ledger.models import Run

_local = threading.local()


def new_key() -> str:
    return secrets.token_hex(32)


@contextmanager
def cache_scope(tenant_id: int | None = None):
    """Cache the keys of runs looked up inside (re-entrant). With `tenant_id`, read every run's key of the tenant in
    one query first (a verification reads them all)."""
    if getattr(_local, "cache", None) is not None:
        yield
        return
    _local.cache = {}
    if tenant_id is not None:
        _local.cache.update({pk: key for pk, key in sql.fetch_all(
            "SELECT id, fingerprint_key FROM ledger_run WHERE tenant_id = %s", [tenant_id])})
    try:
        yield
    finally:
        _local.cache = None


def remember(keys: dict[int, str]) -> None:
    """Runs' keys known from elsewhere than the hot table (an archived run's row, ledger/archive): in a scope, the
    digests of its steps and rows are then made under it as they were recorded."""
    cache = getattr(_local, "cache", None)
    if cache is not None:
        cache.update(keys)


def forget() -> None:
    """Drop the cached keys (erasure, which blanks them, calls it)."""
    if getattr(_local, "cache", None) is not None:
        _local.cache.clear()


def _run_key(run_id: int | None) -> str:
    if run_id is None:
        return ""
    cache = getattr(_local, "cache", None)
    if cache is not None and run_id in cache:
        return cache[run_id]
    found = sql.fetch_one("SELECT fingerprint_key FROM ledger_run WHERE id = %s", [run_id])
    key = found[0] if found else ""
    if cache is not None:
        cache[run_id] = key
    return key


def key_of(obj) -> bytes | None:
    """The key a fingerprinted row's digests are made under: its run's (the run itself, or the run it belongs to),
    from the run in memory when there is one, else read (cached in a scope); None for a run with no key."""
    if isinstance(obj, Run):
        key = obj.fingerprint_key if "fingerprint_key" in obj.__dict__ else _run_key(obj.pk)
    else:
        run = obj._state.fields_cache.get("run")
        if run is not None and "fingerprint_key" in run.__dict__:
            key = run.fingerprint_key
        elif "run_fingerprint_key" in obj.__dict__:  # read with the row (ledger/engine/execution.py)
            key = obj.run_fingerprint_key
        else:
            key = _run_key(getattr(obj, "run_id", None))
    return bytes.fromhex(key) if key else None


def keyed(key: bytes | None, plain: str) -> str:
    """A digest as the chain records it for a row under `key` (None: as it is)."""
    return plain if key is None else hmac.new(key, plain.encode(), hashlib.sha256).hexdigest()
