"""The archived part of a tenant's chain, for `verify_chain` (ledger/audit/verify.py) and the readers.

Each indexed segment is fetched and must hash to its name (else: changed, or swapped with another), follow the one
before it (its number, the previous segment's SHA-256, a slice starting where the last ended: else reordered),
carry a head signed by the audit signing key at its last event, and be recorded in the chain (`archive.segment`).
The events then join the hot ones as one chain: `events()` yields the archived slices in order, checking that an
event kept hot beside its archived copy is that copy, then the hot events after them. Segments are fetched and
checked as the walk reaches them and dropped after, so verifying holds one at a time, however many a tenant has;
their rows are read in a second pass (`Archive.rows()`).
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
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
    plain: bool = False  # its line was plain JSON (ledger/canonical.py): its hash skips the canonical copy


class Archive:
    """A tenant's indexed segments, read one at a time and dropped: a tenant archiving for years has thousands, and
    verification holds one (docs/archive.md). `segments()` reads each with its checks and its events, `rows()` reads
    each again for its rows only (the rows are checked against the state the whole walk recorded, known only after
    it). What is kept across segments is the index's names, to name a segment swapped in or recorded in the chain."""

    def __init__(self, tenant_id: int, *, store=None):
        self.tenant_id = tenant_id
        self.names = dict(ArchiveSegment.objects.filter(tenant_id=tenant_id).order_by("number")
                          .values_list("sha256", "number"))  # in their order, for recorded_segments
        self._store = store
        self.read = 0  # segments fetched and checked by segments()

    @property
    def store(self):
        """The store, named only when there are segments: a tenant without any verifies with no UNWIND_ARCHIVE_URL."""
        if self._store is None:
            self._store = archive_store()
        return self._store

    def _indexed(self):
        return ArchiveSegment.objects.filter(tenant_id=self.tenant_id).order_by("number").iterator(chunk_size=500)

    def _fetch(self, index: ArchiveSegment) -> bytes:
        """The segment's bytes, which must be there and hash to its name."""
        data = self.store.get(segment_key(self.tenant_id, index.sha256))
        if data is None:
            raise ArchiveBroken("archive", f"{_name(index)} is missing from {self.store.where}: removed")
        actual = hashlib.sha256(data).hexdigest()
        if actual != index.sha256:
            other = self.names.get(actual)
            if other is not None:
                raise ArchiveBroken("archive", f"{_name(index)} holds the bytes of segment {other} "
                                               f"({actual[:16]}…): the segments were swapped (reordered)")
            raise ArchiveBroken("archive", f"{_name(index)} was changed: its bytes hash to {actual[:16]}…, not to "
                                           "its name")
        return data

    def _decode(self, index: ArchiveSegment, data: bytes, *, events: bool, rows: bool) -> segments.Segment:
        try:
            return segments.decode(data, events=events, rows=rows)
        except segments.SegmentUnreadable as exc:
            raise ArchiveBroken("archive", f"{_name(index)} cannot be read: {exc}") from None

    def segments(self):
        """(index, segment with its events, not its rows) in order, each fetched and checked on its own and against
        the one before just before it is yielded; the caller drops it before the next is read."""
        if not self.names:
            return
        verifying = _verifying_key()
        previous = None
        for position, index in enumerate(self._indexed(), start=1):
            segment = self._decode(index, self._fetch(index), events=True, rows=False)
            manifest = segment.manifest
            expected_first = previous.last_seq + 1 if previous else 1
            if (manifest.get("number") != position or index.number != position
                    or manifest.get("tenant") != self.tenant_id
                    or manifest.get("prev_segment") != (previous.sha256 if previous else None)
                    or manifest.get("first_seq") != expected_first or index.first_seq != expected_first):
                raise ArchiveBroken("archive", f"{_name(index)} does not follow "
                                               f"{_name(previous) if previous else 'the start of the chain'}: its "
                                               "number, place or previous segment differ (reordered or one removed)")
            _check_head(index, manifest, verifying)
            seqs = [event["seq"] for event in segment.events]
            if seqs != list(range(manifest["first_seq"], manifest["last_seq"] + 1)):
                raise ArchiveBroken("archive", f"{_name(index)} does not hold events #{manifest['first_seq']}–"
                                               f"#{manifest['last_seq']} in order")
            self.read += 1
            yield index, segment
            del segment, manifest, seqs  # not held while the next one is read: one at a time, not two
            previous = index

    def rows(self):
        """(segment number, its rows by model label), one segment at a time (a caller drops each before asking for the
        next): each is fetched again and must still hash to its name, as it may have been changed in between."""
        for number, rows, _ in self.rows_noting_plain():
            yield number, rows

    def rows_noting_plain(self):
        """As `rows()`, with whether each row's line was plain JSON (ledger/canonical.py), by model label."""
        if not self.names:
            return
        for index in self._indexed():
            segment = self._decode(index, self._fetch(index), events=False, rows=True)
            yield index.number, segment.rows, segment.rows_plain
            del segment


def _name(index: ArchiveSegment) -> str:
    return f"segment {index.number} ({index.sha256[:16]}…, events #{index.first_seq}–#{index.last_seq})"


def load(tenant_id: int, *, store=None) -> Archive:
    """The tenant's archive, read as it is walked (nothing is fetched yet)."""
    return Archive(tenant_id, store=store)


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


def archived_event(line: dict, index: ArchiveSegment, plain: bool = False) -> ArchivedEvent:
    return ArchivedEvent(seq=line["seq"], kind=line["kind"], actor=line["actor"], run_ref=line["run"],
                         action_ref=line["action"], data=line["data"], created_at=datetime.fromisoformat(line["at"]),
                         prev_hash=line["prev"], hash=line["hash"], key_id=line["key"], tenant_id=index.tenant_id,
                         segment=index.number, plain=plain)


def events(archive: Archive, hot):
    """The tenant's whole chain in order: archived slices, then hot events after them. A hot event inside an
    archived slice (one of a run that stayed hot) must be its archived copy, field for field."""
    hot = iter(hot)
    pending = next(hot, None)
    for index, segment in archive.segments():
        if segment.manifest["first_seq"] <= segment.manifest["last_seq"] and segment.events[0]["prev"] != \
                segment.manifest["prev_hash"]:
            raise ArchiveBroken("archive", f"{_name(index)} does not start where its manifest says")
        plains = segment.events_plain if len(segment.events_plain) == len(segment.events) else \
            [False] * len(segment.events)  # a segment built without them: each hashed the long way
        for line, plain in zip(segment.events, plains):
            event = archived_event(line, index, plain)
            if pending is not None and pending.seq < event.seq:
                raise ArchiveBroken("archive", f"event #{pending.seq} is in the hot table but in no segment")
            if pending is not None and pending.seq == event.seq:
                if (pending.hash, pending.prev_hash, pending.kind, pending.run_ref, pending.data) != \
                        (event.hash, event.prev_hash, event.kind, event.run_ref, event.data):
                    raise ArchiveBroken("archive", f"event #{event.seq} in the hot table differs from its copy in "
                                                   f"{_name(index)}")
                pending = next(hot, None)
            yield event
        del segment  # not held while the next one is read
    for event in [pending] if pending is not None else []:
        yield event
    for event in hot:
        yield event


def instance(model, row: dict):
    """An unsaved model object from an archived row's columns (what the fingerprints are computed from)."""
    return model(**{f.attname: f.to_python(row[f.attname]) for f in model._meta.concrete_fields if f.attname in row})


def recorded_segments(archive: Archive, seen: dict[str, int]) -> None:
    """Every indexed segment is recorded in the chain (`archive.segment`), and every recorded one is indexed."""
    for sha, seq in seen.items():
        if sha not in archive.names:
            raise ArchiveBroken("archive", f"event #{seq} recorded segment {str(sha)[:16]}…, which is not in the "
                                           "archive index: removed")
    for sha in archive.names:
        if sha not in seen:
            index = ArchiveSegment.objects.get(tenant_id=archive.tenant_id, sha256=sha)
            raise ArchiveBroken("archive", f"{_name(index)} is indexed but no archive.segment event records it")
