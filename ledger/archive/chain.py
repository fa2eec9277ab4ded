"""The archived part of a tenant's chain, for `verify_chain` (ledger/audit/verify.py) and the readers.

Each indexed segment is fetched and must hash to its name (else: changed, or swapped with another), follow the one
before it (its number, the previous segment's SHA-256, a slice starting where the last ended: else reordered),
carry a head signed by the audit signing key at its last event, and be recorded in the chain (`archive.segment`).
The events then join the hot ones as one chain: `events()` yields the archived slices in order, checking that an
event kept hot beside its archived copy is that copy, then the hot events after them.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings

from ledger.archive import segments
from ledger.archive.service import signed_part
from ledger.archive.store import archive_store, segment_key
from ledger.models import ArchiveSegment


class ArchiveBroken(Exception):
    def __init__(self, check: str, problem: str):
        super().__init__(problem)
        self.check, self.problem = check, problem


@dataclass
class ArchivedEvent:
    """An event read from a segment, with the attributes of an AuditEvent row that verification reads."""

    seq: int
    kind: str
    actor: str
    run_ref: int | None
    action_ref: int | None
    data: dict
    created_at: datetime
    prev_hash: str
    hash: str
    key_id: str
    tenant_id: int = 0
    segment: int = 0


@dataclass
class Archive:
    segments: list[tuple[ArchiveSegment, segments.Segment]] = field(default_factory=list)

    @property
    def last_seq(self) -> int:
        return self.segments[-1][0].last_seq if self.segments else 0

    def rows(self, label: str):
        """(segment number, row fields) of every archived row of a model."""
        for index, segment in self.segments:
            for row in segment.rows.get(label, []):
                yield index.number, row


def _name(index: ArchiveSegment) -> str:
    return f"segment {index.number} ({index.sha256[:16]}…, events #{index.first_seq}–#{index.last_seq})"


def load(tenant_id: int, *, store=None) -> Archive:
    """Every segment of the tenant, fetched and checked on its own and against the one before."""
    indexed = list(ArchiveSegment.objects.filter(tenant_id=tenant_id).order_by("number"))
    archive = Archive()
    if not indexed:
        return archive
    store = store or archive_store()
    by_sha = {index.sha256: index for index in indexed}
    verifying = _verifying_key()
    previous = None
    for position, index in enumerate(indexed, start=1):
        data = store.get(segment_key(tenant_id, index.sha256))
        if data is None:
            raise ArchiveBroken("archive", f"{_name(index)} is missing from {store.where}: removed")
        actual = hashlib.sha256(data).hexdigest()
        if actual != index.sha256:
            other = by_sha.get(actual)
            if other is not None:
                raise ArchiveBroken("archive", f"{_name(index)} holds the bytes of segment {other.number} "
                                               f"({actual[:16]}…): the segments were swapped (reordered)")
            raise ArchiveBroken("archive", f"{_name(index)} was changed: its bytes hash to {actual[:16]}…, not to "
                                           "its name")
        try:
            segment = segments.decode(data)
        except segments.SegmentUnreadable as exc:
            raise ArchiveBroken("archive", f"{_name(index)} cannot be read: {exc}") from None
        manifest = segment.manifest
        expected_first = previous[0].last_seq + 1 if previous else 1
        if (manifest.get("number") != position or index.number != position or manifest.get("tenant") != tenant_id
                or manifest.get("prev_segment") != (previous[0].sha256 if previous else None)
                or manifest.get("first_seq") != expected_first or index.first_seq != expected_first):
            raise ArchiveBroken("archive", f"{_name(index)} does not follow "
                                           f"{_name(previous[0]) if previous else 'the start of the chain'}: its "
                                           "number, place or previous segment differ (reordered or one removed)")
        _check_head(index, manifest, verifying)
        seqs = [event["seq"] for event in segment.events]
        if seqs != list(range(manifest["first_seq"], manifest["last_seq"] + 1)):
            raise ArchiveBroken("archive", f"{_name(index)} does not hold events #{manifest['first_seq']}–"
                                           f"#{manifest['last_seq']} in order")
        archive.segments.append((index, segment))
        previous = (index, segment)
    return archive


def _verifying_key():
    """The public key of the audit signing key, when this machine has it (a segment's head is checked then)."""
    if not (settings.UNWIND_AUDIT_SIGNING_KEY_FILE or settings.UNWIND_AUDIT_PUBLIC_KEY_FILE):
        return None
    from ledger.audit import export as audit_export

    return audit_export.verifying_key()


def _check_head(index: ArchiveSegment, manifest: dict, verifying) -> None:
    head = manifest.get("head") or {}
    if head.get("seq") != manifest.get("last_seq") or head.get("hash") != manifest.get("last_hash"):
        raise ArchiveBroken("archive", f"{_name(index)}'s signed head is not at its last event")
    if verifying is None:
        return
    from cryptography.exceptions import InvalidSignature

    try:
        verifying.verify(base64.b64decode(head.get("sig", ""), validate=True), signed_part(head))
    except (InvalidSignature, ValueError):
        raise ArchiveBroken("archive", f"{_name(index)}'s head is not signed by the audit signing key "
                                       "(forged or altered)") from None


def archived_event(line: dict, index: ArchiveSegment) -> ArchivedEvent:
    return ArchivedEvent(seq=line["seq"], kind=line["kind"], actor=line["actor"], run_ref=line["run"],
                         action_ref=line["action"], data=line["data"], created_at=datetime.fromisoformat(line["at"]),
                         prev_hash=line["prev"], hash=line["hash"], key_id=line["key"], tenant_id=index.tenant_id,
                         segment=index.number)


def events(archive: Archive, hot):
    """The tenant's whole chain in order: archived slices, then hot events after them. A hot event inside an
    archived slice (one of a run that stayed hot) must be its archived copy, field for field."""
    hot = iter(hot)
    pending = next(hot, None)
    for index, segment in archive.segments:
        if segment.manifest["first_seq"] <= segment.manifest["last_seq"] and segment.events[0]["prev"] != \
                segment.manifest["prev_hash"]:
            raise ArchiveBroken("archive", f"{_name(index)} does not start where its manifest says")
        for line in segment.events:
            event = archived_event(line, index)
            if pending is not None and pending.seq < event.seq:
                raise ArchiveBroken("archive", f"event #{pending.seq} is in the hot table but in no segment")
            if pending is not None and pending.seq == event.seq:
                if (pending.hash, pending.prev_hash, pending.kind, pending.run_ref, pending.data) != \
                        (event.hash, event.prev_hash, event.kind, event.run_ref, event.data):
                    raise ArchiveBroken("archive", f"event #{event.seq} in the hot table differs from its copy in "
                                                   f"{_name(index)}")
                pending = next(hot, None)
            yield event
    for event in [pending] if pending is not None else []:
        yield event
    for event in hot:
        yield event


def instance(model, row: dict):
    """An unsaved model object from an archived row's columns (what the fingerprints are computed from)."""
    return model(**{f.attname: f.to_python(row[f.attname]) for f in model._meta.concrete_fields if f.attname in row})


def recorded_segments(archive: Archive, seen: dict[str, int]) -> None:
    """Every indexed segment is recorded in the chain (`archive.segment`), and every recorded one is indexed."""
    indexed = {index.sha256: index for index, _ in archive.segments}
    for sha, seq in seen.items():
        if sha not in indexed:
            raise ArchiveBroken("archive", f"event #{seq} recorded segment {str(sha)[:16]}…, which is not in the "
                                           "archive index: removed")
    for sha, index in indexed.items():
        if sha not in seen:
            raise ArchiveBroken("archive", f"{_name(index)} is indexed but no archive.segment event records it")
