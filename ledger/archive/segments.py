"""One segment: JSON Lines compressed with zstd, named by the SHA-256 of its bytes (docs/archive.md).

Line 1 is the manifest: {"t": "segment", "format": 1, "tenant", "number", "first_seq", "last_seq", "prev_hash" (the
hash the slice's first event links to), "last_hash" (its last event's, or prev_hash for an empty slice),
"prev_segment" (the SHA-256 of the tenant's segment before it, or null), "runs" (the ids whose rows it holds),
"head" (the signed head at last_seq: tenant, seq, hash, key_id, at, signer, sig, as ledger/audit/export.py signs)}.
Then one line per audit event of the slice {"t": "event", "seq", "kind", "actor", "run", "action", "data", "at",
"prev", "hash", "key"}, and one per row {"t": "row", "model": "app.model", "fields": {column: value}}. Any tool that
reads zstd and JSON reads it.
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal

import zstandard

from ledger.canonical import loads_noting_plain

FORMAT = 1
LEVEL = 1  # zstd: at 100k actions half the time of level 3 (17 vs 33 ms a segment) and 11 % smaller (1.02 vs 1.15 MB)


class SegmentUnreadable(Exception):
    """A segment's bytes are not a segment (damaged, or not zstd JSON Lines)."""


def _plain(value):
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not stored in a segment")


_encode = json.JSONEncoder(default=_plain, ensure_ascii=False, separators=(",", ":")).encode


def event_line(event: dict) -> dict:
    """An audit event's line from its column values (`AuditEvent.objects.values(...)`)."""
    return {"t": "event", "seq": event["seq"], "kind": event["kind"], "actor": event["actor"],
            "run": event["run_ref"], "action": event["action_ref"], "data": event["data"],
            "at": event["created_at"].isoformat(), "prev": event["prev_hash"], "hash": event["hash"],
            "key": event["key_id"]}


def encode(manifest: dict, events: list, rows: list[tuple[str, dict | str]]) -> tuple[bytes, str]:
    """(the segment's bytes, their SHA-256). An event is its columns, or its line already as JSON text; a row's
    fields are a dict, or already JSON text (PostgreSQL writes both: service.py)."""
    lines = [_encode({"t": "segment", "format": FORMAT, **manifest})]
    lines.extend(event if isinstance(event, str) else _encode(event_line(event)) for event in events)
    lines.extend('{"t":"row","model":%s,"fields":%s}' % (_encode(label), values if isinstance(values, str)
                                                          else _encode(values)) for label, values in rows)
    data = zstandard.ZstdCompressor(level=LEVEL).compress(("\n".join(lines) + "\n").encode())
    return data, hashlib.sha256(data).hexdigest()


@dataclass
class Segment:
    manifest: dict
    events: list[dict] = field(default_factory=list)
    # Whether each event's line was plain JSON (ledger/canonical.py `loads_noting_plain`): its hash skips a copy.
    events_plain: list[bool] = field(default_factory=list)
    rows: dict[str, list[dict]] = field(default_factory=dict)  # model label -> rows' fields
    rows_plain: dict[str, list[bool]] = field(default_factory=dict)  # model label -> whether each line was plain


def decode(data: bytes, *, events: bool = True, rows: bool = True) -> Segment:
    """The segment, keeping only the events or only the rows when that is all a caller reads (verification reads
    each segment twice, once for each: ledger/archive/chain.py)."""
    lines = _lines(data)
    manifest, _ = next(lines, (None, False))
    if manifest is None or manifest.get("t") != "segment" or manifest.get("format") != FORMAT:
        raise SegmentUnreadable("its first line is not a segment manifest of format 1")
    segment = Segment(manifest=manifest)
    for line, plain in lines:
        if line.get("t") == "event":
            if events:
                segment.events.append(line)
                segment.events_plain.append(plain)
        elif line.get("t") == "row":
            if rows:
                segment.rows.setdefault(line["model"], []).append(line["fields"])
                segment.rows_plain.setdefault(line["model"], []).append(plain)
        else:
            raise SegmentUnreadable(f"a line of an unknown type {line.get('t')!r}")
    return segment


def _lines(data: bytes):
    """The segment's lines as JSON objects (each with whether it was plain JSON: ledger/canonical.py), one at a time
    through zstd's stream reader: neither the whole text nor a list of its lines is held. Lines end at "\\n" only: the
    JSON text may hold U+2028 and other characters that str.splitlines() would also split at. The stream reader stops
    quietly where bytes end; a frame cut short shows as fewer bytes than its header says it holds."""
    try:
        size = zstandard.frame_content_size(data)
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        for text in io.TextIOWrapper(reader, encoding="utf-8", newline="\n"):
            if text == "\n":
                continue
            line, plain = loads_noting_plain(text)
            if not isinstance(line, dict):
                raise SegmentUnreadable("a line that is not a JSON object")
            yield line, plain
        if size < 0 or reader.tell() != size:
            raise SegmentUnreadable("not a zstd JSON Lines segment (its frame is cut short or does not say its size)")
    except (zstandard.ZstdError, UnicodeDecodeError, ValueError) as exc:
        raise SegmentUnreadable(f"not a zstd JSON Lines segment ({exc})") from None
