"""Signed chain heads, exported outside the database.

The HMAC keeps someone with database access from editing or forging events, but not from cutting the
newest ones off and moving the head back. So at checkpoints each tenant's head (seq, hash, the key id it
was made with) is signed with an Ed25519 key that is not in the database, and appended as one JSON line to
that tenant's file in UNWIND_AUDIT_EXPORT_DIR (opened in append mode, never rewritten). `verify_audit`
checks the newest line's signature with the public key and that the chain still holds that head; an auditor
who is handed the public key and the files can check them without trusting Unwind.

One line: {"tenant": id, "slug": ..., "seq": n, "hash": ..., "key_id": ..., "at": ISO time, "signer": the
public key's id, "sig": base64 Ed25519 signature over the canonical JSON of every other field}.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ledger.audit.chain import event_is_authentic
from ledger.canonical import dumps
from ledger.models import AuditEvent, AuditHead, Tenant

log = logging.getLogger("unwind.audit")
TAIL_BYTES = 64 * 1024  # one line is a few hundred bytes: the newest one is always within this tail


class ExportInvalid(Exception):
    """The exported heads cannot be trusted: unreadable, malformed, or not signed by the configured key."""


def generate_key_pair() -> tuple[bytes, bytes]:
    """(private key PEM, public key PEM) of a new Ed25519 key."""
    private = Ed25519PrivateKey.generate()
    return (
        private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
    )


def public_key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _read(path: str, variable: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ImproperlyConfigured(f"{variable}: cannot read {path!r} ({exc.strerror}).") from None


def signing_key() -> Ed25519PrivateKey:
    path = settings.UNWIND_AUDIT_SIGNING_KEY_FILE
    if not path:
        raise ImproperlyConfigured("UNWIND_AUDIT_SIGNING_KEY_FILE is not set: create a key pair with "
                                   "`manage.py audit_keygen` and name its private key file there.")
    try:
        key = serialization.load_pem_private_key(_read(path, "UNWIND_AUDIT_SIGNING_KEY_FILE"), password=None)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"UNWIND_AUDIT_SIGNING_KEY_FILE: {path!r} is not a PEM private key ({exc}).") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ImproperlyConfigured(f"UNWIND_AUDIT_SIGNING_KEY_FILE: {path!r} is not an Ed25519 key.")
    return key


def verifying_key() -> Ed25519PublicKey:
    """The public key from UNWIND_AUDIT_PUBLIC_KEY_FILE, or derived from the signing key."""
    path = settings.UNWIND_AUDIT_PUBLIC_KEY_FILE
    if not path:
        return signing_key().public_key()
    try:
        key = serialization.load_pem_public_key(_read(path, "UNWIND_AUDIT_PUBLIC_KEY_FILE"))
    except ValueError as exc:
        raise ImproperlyConfigured(f"UNWIND_AUDIT_PUBLIC_KEY_FILE: {path!r} is not a PEM public key ({exc}).") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ImproperlyConfigured(f"UNWIND_AUDIT_PUBLIC_KEY_FILE: {path!r} is not an Ed25519 key.")
    return key


def export_dir() -> Path:
    if not settings.UNWIND_AUDIT_EXPORT_DIR:
        raise ImproperlyConfigured("UNWIND_AUDIT_EXPORT_DIR is not set: name a directory outside the database "
                                   "(ideally on another machine or an append-only mount) for the signed heads.")
    return Path(settings.UNWIND_AUDIT_EXPORT_DIR)


def head_file(tenant_id: int) -> Path:
    return export_dir() / f"tenant-{tenant_id}.jsonl"


def _signed_part(line: dict) -> bytes:
    return dumps({k: v for k, v in line.items() if k != "sig"}).encode()


def _last_line(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ExportInvalid(f"the exported heads file {path} cannot be read ({exc.strerror})") from None
    lines = [line for line in tail.split(b"\n") if line.strip()]
    return lines[-1].decode("utf-8", "replace") if lines else None


def latest_head(tenant_id: int) -> dict | None:
    """The newest exported head of the tenant, its signature checked; None when none was exported yet."""
    path = head_file(tenant_id)
    text = _last_line(path)
    if text is None:
        return None
    try:
        line = json.loads(text)
        signature = base64.b64decode(line["sig"], validate=True)
        seq, head_hash = int(line["seq"]), str(line["hash"])
    except (ValueError, KeyError, TypeError):
        raise ExportInvalid(
            f"the newest line of {path} is not a signed head (malformed): it cannot be trusted") from None
    if line.get("tenant") != tenant_id:
        raise ExportInvalid(f"the newest line of {path} is the head of tenant {line.get('tenant')!r}, not {tenant_id}")
    public = verifying_key()
    try:
        public.verify(signature, _signed_part(line))
    except InvalidSignature:
        raise ExportInvalid(f"the newest exported head in {path} (#{seq}) has an invalid signature: it was not signed "
                            f"by the audit signing key {public_key_id(public)} (forged or altered)") from None
    return {"seq": seq, "hash": head_hash, "at": line.get("at", "?"), "key_id": line.get("key_id")}


def _append(path: Path, line: dict) -> None:
    """One write of one whole line with O_APPEND: never a rewrite, and concurrent appenders do not interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, (json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def head_checkpoint(tenant: Tenant, *, key: Ed25519PrivateKey) -> dict | None:
    """Sign and export the tenant's current head. None when there is nothing new since the last exported one.

    The head event's own HMAC is checked first, so a head moved in the database to a forged event is never signed.
    """
    head = AuditHead.objects.filter(pk=tenant.pk).first()
    if head is None or head.seq == 0:
        return None
    path = head_file(tenant.pk)
    last = _last_line(path)
    if last is not None:
        try:
            if json.loads(last).get("seq") == head.seq:
                return None
        except ValueError:
            pass  # a damaged last line: a new signed head after it is what verify will read
    event = AuditEvent.objects.filter(tenant_id=tenant.pk, seq=head.seq).first()
    if event is None or not hmac.compare_digest(event.hash, head.hash) or not event_is_authentic(event):
        raise ExportInvalid(f"tenant {tenant.slug}: the head (#{head.seq}) is not an authentic event of the chain; "
                            "run `manage.py verify_audit` (nothing was signed)")
    line = {"tenant": tenant.pk, "slug": tenant.slug, "seq": head.seq, "hash": head.hash, "key_id": event.key_id,
            "at": timezone.now().isoformat(), "signer": public_key_id(key.public_key())}
    line["sig"] = base64.b64encode(key.sign(_signed_part(line))).decode()
    _append(path, line)
    return line


def heads_checkpoint(*, tenants=None) -> tuple[list[dict], list[str]]:
    """Sign and export every tenant's head that moved: (lines written, problems)."""
    key = signing_key()
    written, problems = [], []
    for tenant in tenants if tenants is not None else Tenant.objects.order_by("pk"):
        try:
            line = head_checkpoint(tenant, key=key)
        except ExportInvalid as exc:
            problems.append(str(exc))
            continue
        if line is not None:
            written.append(line)
    return written, problems


_last_periodic: dict[str, float | None] = {"at": None}  # this process's last periodic checkpoint (monotonic)


def on_sweep(*, now) -> None:
    """The worker's sweep (through `checkpoint_on_sweep` in ledger/apps.py): sign the heads every
    UNWIND_AUDIT_CHECKPOINT_SECONDS."""
    last = _last_periodic["at"]
    if last is not None and time.monotonic() - last < settings.UNWIND_AUDIT_CHECKPOINT_SECONDS:
        return
    _last_periodic["at"] = time.monotonic()
    try:
        written, problems = heads_checkpoint()
    except ImproperlyConfigured as exc:
        log.error("audit checkpoint: %s", exc)
        return
    for problem in problems:
        log.error("audit checkpoint: %s", problem)
    if written:
        log.info("audit checkpoint: signed %d head(s)", len(written))
