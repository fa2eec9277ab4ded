"""The per-person keys the chain's fingerprints of a person's runs are made under (issue 42, erasure).

A run acted for someone (`Run.on_behalf_of`) has its fingerprints and seals, and those of its steps and of the rows
that belong to it (approval requests, recovery items), recorded as HMAC-SHA256 under that person's key instead of
the bare SHA-256 digest: the chain covers a keyed digest of what the person's data was, never a digest anyone could
test a guess against. Erasing the person (recovery/erasure.py) deletes the key, so the digests the chain keeps of
their data are unlinkable from then on, while the chain itself still verifies (the erasure's event vouches for the
rows as erasure left them).

Keys live in the database (`SubjectKey`), one per tenant and person as written, made by the first event recorded for
one of the person's runs. A run acted for nobody has no key: its fingerprints stay bare digests, as every run's were
before keys existed (`verify_chain` accepts either form).

Lookups are cached only inside a scope (a ledger transaction, one verification): a key erased by another process is
never used from a cache that outlived it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from contextlib import contextmanager

from ledger.db import sql
from ledger.models import Run, SubjectKey

_local = threading.local()


@contextmanager
def cache_scope():
    """Cache the lookups made inside (re-entrant: an inner scope shares the outer one's cache)."""
    if getattr(_local, "cache", None) is not None:
        yield
        return
    _local.cache = {}
    try:
        yield
    finally:
        _local.cache = None


def forget() -> None:
    """Drop the cached lookups (erasure, which deletes keys, calls it)."""
    if getattr(_local, "cache", None) is not None:
        _local.cache.clear()


def _cached(name, compute):
    cache = getattr(_local, "cache", None)
    if cache is None:
        return compute()
    if name not in cache:
        cache[name] = compute()
    return cache[name]


def key_for(tenant_id: int, subject: str) -> bytes | None:
    if not subject:
        return None

    def lookup():
        found = SubjectKey.objects.filter(tenant_id=tenant_id, subject=subject).values_list("key", flat=True).first()
        return bytes.fromhex(found) if found else None
    return _cached(("key", tenant_id, subject), lookup)


def ensure_key(tenant_id: int, subject: str) -> None:
    """Make the person's key if they have none (inside the tenant's ledger transaction, which serialises it with
    every other writer of the tenant, erasure included)."""
    if not subject or key_for(tenant_id, subject) is not None:
        return
    key = secrets.token_bytes(32)
    SubjectKey.objects.create(tenant_id=tenant_id, subject=subject, key=key.hex())
    cache = getattr(_local, "cache", None)
    if cache is not None:
        cache[("key", tenant_id, subject)] = key


def run_subject(run_id: int | None) -> tuple[int, str] | None:
    """(tenant id, on_behalf_of) of a run."""
    if run_id is None:
        return None

    def lookup():
        found = sql.fetch_one("SELECT tenant_id, on_behalf_of FROM ledger_run WHERE id = %s", [run_id])
        return (found[0], found[1]) if found else None
    return _cached(("run", run_id), lookup)


def subject_of(obj) -> tuple[int, str] | None:
    """Whose data a fingerprinted row holds: a run's person, or the person of the run a row belongs to."""
    if isinstance(obj, Run):
        return (obj.tenant_id, obj.on_behalf_of) if obj.on_behalf_of else None
    run = getattr(obj, "_state").fields_cache.get("run")
    if run is not None:
        return (run.tenant_id, run.on_behalf_of) if run.on_behalf_of else None
    found = run_subject(getattr(obj, "run_id", None))
    return found if found and found[1] else None


def key_of(obj) -> bytes | None:
    found = subject_of(obj)
    return key_for(*found) if found else None


def keyed(key: bytes | None, plain: str) -> str:
    """A digest as the chain records it for a row under `key` (None: as it is)."""
    return plain if key is None else hmac.new(key, plain.encode(), hashlib.sha256).hexdigest()
