"""Archiving a tenant's due runs into segments, and legal holds (docs/archive.md).

A pass takes the due runs (retention.py) in batches of UNWIND_ARCHIVE_SEGMENT_RUNS, ordered by their last audit
event. Each batch becomes one segment: the slice of the tenant's chain from the end of its previous segment to the
batch's last event (every event of the slice, the kept-hot runs' too, so that the archive holds the chain whole and
in order), the batch's rows (everything deleting the runs would remove, found from the models' relations, so apps
built on the ledger are archived without the ledger importing them) and the signed head at the slice's end. The
file is written first (named by its SHA-256, so writing it again is harmless); then, in one ledger transaction under
the chain's lock, the batch is checked again (a hold set or a step reopened meanwhile keeps the run: the pass stops
and removes the file it wrote, which nothing indexes), indexed, recorded in the chain (`archive.segment`), and its rows
and its runs' events are deleted from the hot tables.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connection, router
from django.db.models import Model, Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from ledger.archive import retention, segments
from ledger.archive.retention import id_set
from ledger.archive.store import archive_store, segment_key
from ledger.audit.chain import GENESIS, ledger_transaction
from ledger.canonical import dumps
from ledger.db import partitions
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import Action, ArchivedKey, ArchivedRun, ArchiveSegment, AuditEvent, Run, Tenant

ARCHIVED_EVENT = "archive.segment"
HOLD_EVENT = "legal_hold.set"

# Look-up keys of archived rows other apps find them by (a trail link by its token's hash): label -> column.
_lookup_keys: dict[str, str] = {}


def register_archived_lookup(model: type[Model], column: str) -> None:
    """Called at AppConfig.ready() by the app that owns the model: its archived rows stay findable by `column`."""
    _lookup_keys[model._meta.label_lower] = column


# --- what a run's rows are --------------------------------------------------------------------------------------

@dataclass
class _Table:
    model: type[Model]
    lookups: list[str] = field(default_factory=list)  # each `<path>__in` reaches the run ids
    nulls: list[tuple[str, str]] = field(default_factory=list)  # (column set to NULL, path) for SET_NULL relations


def run_tables() -> list[_Table]:
    """Every model whose rows deleting a run deletes (CASCADE from Run, transitively), in the order they are first
    reached (parents before children), each with every path by which it reaches a run; and the SET_NULL columns
    that point into them."""
    tables: dict[str, _Table] = {}
    queue = [(Run, "")]
    while queue:
        model, path = queue.pop(0)
        label = model._meta.label_lower
        first = label not in tables or not tables[label].lookups
        table = tables.setdefault(label, _Table(model))
        table.lookups.append(path)
        if not first:
            continue  # its children were reached from its first path
        # Hidden relations too (related_name="+"): a step a customer's request names points at it that way.
        relations = [f for f in model._meta.get_fields(include_hidden=True) if f.auto_created and (f.one_to_many or f.one_to_one) and not f.concrete]
        for rel in relations:
            child = rel.related_model
            child_path = f"{rel.field.name}__{path}" if path else rel.field.name
            if rel.on_delete.__name__ == "CASCADE" and child is not model:  # an undo's step is reached as a step
                queue.append((child, child_path))
            elif rel.on_delete.__name__ == "SET_NULL":
                tables.setdefault(child._meta.label_lower, _Table(child)).nulls.append((rel.field.attname, child_path))
    return [table for table in tables.values() if table.lookups or table.nulls]


def _reaches(table: _Table, ids: list[int], taken: dict[str, list[int]] | None = None) -> Q:
    """The table's rows of these runs. A path through a parent already read (`taken`: an attempt's action) is asked
    by the parent's primary keys, not joined back to the runs: on a partitioned table the join read every month
    whole (a hash join over all attempts, 52 ms of a 1,000-run batch at 100k actions), the keys probe each month's
    index. The same rows: the parent's rows of these runs are the ones read (a parent row added since keeps its run's
    row referenced, and the commit's foreign key fails rather than lose it). On PostgreSQL only, where the keys go as
    one array parameter: elsewhere each is a parameter, and a parent may have more rows than SQLite takes those."""
    q = Q(pk__in=[])
    for path in table.lookups:
        head, _, rest = path.partition("__")
        parent = table.model._meta.get_field(head).related_model._meta.label_lower if rest else None
        if taken is not None and parent in taken and connection.vendor == "postgresql":
            q |= Q(**{f"{head}__in": id_set(taken[parent])})
        else:
            q |= Q(**{f"{path}__in" if path else "pk__in": id_set(ids)})
    return q


# On PostgreSQL the database writes a segment's lines itself: an event's line, and a row as JSON, as text that goes
# into the segment as it is (no decoding of JSON columns to encode them again). An event's `at` is its timestamp in
# ISO 8601 (the connection's time zone is UTC), which parses back to the instant its HMAC covers; its hashes in hex,
# as everywhere outside the column (ledger/models.py HexDigestField).
# The line is put together as text, each value by to_json or as the column's own text (jsonb's for `data`):
# json_build_object took 53 ms for a 1,000-run batch's 9,000 events, this 22 ms (the same JSON; only the spaces
# json_build_object puts around its colons and commas are gone).
EVENT_LINE = ("""'{"t":"event","seq":' || seq || ',"kind":' || to_json(kind) || ',"actor":' || to_json(actor)"""
              """ || ',"run":' || coalesce(run_ref::text, 'null')"""
              """ || ',"action":' || coalesce(action_ref::text, 'null')"""
              """ || ',"data":' || coalesce(data::text, 'null') || ',"at":' || to_json(created_at)"""
              """ || ',"prev":"' || encode(prev_hash, 'hex') || '","hash":"' || encode(hash, 'hex')"""
              """ || '","key":' || to_json(key_id) || '}'""")


def _table_rows(table: _Table, ids: list[int], taken: dict[str, list[int]] | None = None,
                spans: dict[str, tuple] | None = None) -> tuple[list[tuple[int, dict | str]], list[tuple[str, int]]]:
    """(primary key, fields) of the table's rows of these runs, oldest first; and, for a model registered with
    `register_archived_lookup`, each row's (look-up key, run id), read as columns, not from the fields' JSON. For a
    table partitioned by month, `spans` gets the least and greatest partition key of the rows read, by which the
    commit's delete of exactly those rows touches only their months."""
    found = table.model._base_manager.filter(_reaches(table, ids, taken)).order_by("pk")
    column = _lookup_keys.get(table.model._meta.label_lower)
    if connection.vendor == "postgresql":
        whole = RawSQL(f"row_to_json({connection.ops.quote_name(table.model._meta.db_table)})::text", ())
        key = partitions.PARTITIONED.get(table.model._meta.db_table) if spans is not None else None
        read = list(found.annotate(archive_fields=whole).values_list(
            "pk", "archive_fields", key or "pk", *((column, "run_id") if column else ())))
        if key and read:
            spans[table.model._meta.label_lower] = (key, min(row[2] for row in read), max(row[2] for row in read))
        return [(row[0], row[1]) for row in read], [(str(row[3]), row[4]) for row in read] if column else []
    attname = table.model._meta.pk.attname
    read = list(found.values())
    return [(row[attname], row) for row in read], [(str(row[column]), row["run_id"]) for row in read] if column else []


# --- a pass ---------------------------------------------------------------------------------------------------

@dataclass
class PassReport:
    tenant: str
    kept: str = ""  # why nothing of the tenant is archived
    runs: int = 0
    actions: int = 0
    events: int = 0
    segments: list[str] = field(default_factory=list)
    due: list[int] = field(default_factory=list)  # dry run: the runs that would go
    seconds: float = 0.0
    rested: float = 0.0  # of `seconds`, those it rested between segments (its pace)
    stopped: str = ""  # why the pass stopped early


def archive_tenant(*, tenant: Tenant, actor: str, now: datetime | None = None, dry_run: bool = False,
                   store=None, segment_runs: int | None = None, limit: int | None = None,
                   pace: float | None = None) -> PassReport:
    """Archive the tenant's due runs, a segment at a time; at `pace` (UNWIND_ARCHIVE_PACE) below 1, rest after each
    segment so that the pass works that share of its time."""
    started = time.perf_counter()
    pace = settings.UNWIND_ARCHIVE_PACE if pace is None else pace
    if not 0 < pace <= 1:
        raise ValidationFailed(f"pace: the share of its time a pass works is above 0 and at most 1, not {pace}",
                               field="pace")
    now = now or timezone.now()
    report = PassReport(tenant.slug, kept=retention.why_kept(tenant))
    if report.kept:
        return report
    due = retention.due_runs(tenant, now=now, limit=limit)
    if dry_run:
        report.due = [c.run_id for c in due]
        report.runs = len(due)
        report.actions = Action.objects.filter(run_id__in=report.due).count() if due else 0
        return report
    if not due:
        return report
    from ledger.audit import export as audit_export  # cryptography is loaded only where heads are signed

    key = audit_export.signing_key()
    store = store or archive_store()
    size = segment_runs or settings.UNWIND_ARCHIVE_SEGMENT_RUNS
    tables = run_tables()
    for start in range(0, len(due), size):
        batch = due[start:start + size]
        began = time.perf_counter()
        try:
            segment = _archive_batch(tenant, batch, tables=tables, store=store, key=key, actor=actor, now=now)
        except StateConflict as conflict:
            report.stopped = str(conflict)
            break
        report.runs += segment.runs
        report.actions += segment.actions
        report.events += segment.last_seq - segment.first_seq + 1
        report.segments.append(segment.sha256)
        if pace < 1 and start + size < len(due):
            rest = (time.perf_counter() - began) * (1 - pace) / pace
            time.sleep(rest)
            report.rested += rest
    report.seconds = time.perf_counter() - started
    return report


EVENT_COLUMNS = ("seq", "kind", "actor", "run_ref", "action_ref", "data", "created_at", "prev_hash", "hash", "key_id")


def _archive_batch(tenant: Tenant, batch: list, *, tables, store, key, actor: str, now: datetime) -> ArchiveSegment:
    from ledger.audit import export as audit_export

    ids = [c.run_id for c in batch]
    previous = ArchiveSegment.objects.filter(tenant_id=tenant.pk).order_by("-number").first()
    first_seq = previous.last_seq + 1 if previous else 1
    last_seq = max(previous.last_seq if previous else 0, max(c.last_seq for c in batch))
    slice_ = AuditEvent.objects.filter(tenant_id=tenant.pk, seq__gte=first_seq, seq__lte=last_seq).order_by("seq")
    if connection.vendor == "postgresql":
        # Sorted here, not by the database: its sort of the lines (5 MB for 9,000 events) spilled to disk.
        events = [line for _, line in sorted(slice_.order_by().annotate(line=RawSQL(EVENT_LINE, ())).values_list(
            "seq", "line"))]
        last = slice_.reverse().values("hash", "key_id").first()
    else:
        events = list(slice_.values(*EVENT_COLUMNS))
        last = events[-1] if events else None
    if len(events) != last_seq - first_seq + 1:
        raise StateConflict(f"the chain of tenant {tenant.slug} has gaps between #{first_seq} and #{last_seq}: "
                            "run `manage.py verify_audit` (nothing was archived)")
    prev_hash = previous_hash(tenant.pk, first_seq, previous)
    last_hash = last["hash"] if last else prev_hash
    rows, actions, taken, keys, spans = [], 0, {}, [], {}
    for table in tables:
        label = table.model._meta.label_lower
        found, keyed = _table_rows(table, ids, taken, spans) if table.lookups else ([], [])
        if label == "ledger.action":
            actions = len(found)
        rows.extend((label, fields) for _, fields in found)
        taken[label] = [pk for pk, _ in found]
        keys.extend((label, value, run) for value, run in keyed)
    head = {"tenant": tenant.pk, "slug": tenant.slug, "seq": last_seq, "hash": last_hash,
            "key_id": last["key_id"] if last else "", "at": now.isoformat(),
            "signer": audit_export.public_key_id(key.public_key())}
    head["sig"] = base64.b64encode(key.sign(signed_part(head))).decode()
    manifest = {"tenant": tenant.pk, "number": (previous.number + 1) if previous else 1, "first_seq": first_seq,
                "last_seq": last_seq, "prev_hash": prev_hash, "last_hash": last_hash,
                "prev_segment": previous.sha256 if previous else None, "runs": ids, "head": head}
    data, sha256 = segments.encode(manifest, events, rows)
    store.put(segment_key(tenant.pk, sha256), data)
    try:
        return _commit(tenant, batch, manifest, sha256, len(data), actions=actions, keys=keys, taken=taken,
                       spans=spans, tables=tables, actor=actor, now=now)
    except StateConflict as conflict:
        raise StateConflict(f"{conflict}; {_forget(store, tenant.pk, sha256)}") from None
    except Exception:
        _forget(store, tenant.pk, sha256)
        raise


def _forget(store, tenant_id: int, sha256: str) -> str:
    """The pass wrote a segment that its commit then refused: remove the file, which no index names, so the archive
    holds only what the chain records. When the database cannot say the index lacks it (the commit's answer was
    lost, say), or the store refuses (a write-once bucket), the file stays: harmless, never read, and said so."""
    try:
        indexed = ArchiveSegment.objects.filter(tenant_id=tenant_id, sha256=sha256).exists()
    except Exception:  # noqa: BLE001 - whatever the database says, the file stays
        return f"segment {sha256[:12]} is left in the archive (whether it was indexed could not be read)"
    if indexed:
        return f"segment {sha256[:12]} is indexed"
    try:
        store.delete(segment_key(tenant_id, sha256))
    except Exception as exc:  # noqa: BLE001 - a store that keeps what it was given keeps this too
        return f"segment {sha256[:12]} is not indexed and stays in the archive ({type(exc).__name__}: {exc})"
    return f"segment {sha256[:12]} was not indexed and its file was removed"


def signed_part(head: dict) -> bytes:
    """What a head's signature covers: every other field, canonical (as ledger/audit/export.py signs its lines)."""
    return dumps({name: value for name, value in head.items() if name != "sig"}).encode()


def previous_hash(tenant_id: int, first_seq: int, previous: ArchiveSegment | None) -> str:
    if first_seq == 1:
        return GENESIS
    event = AuditEvent.objects.filter(tenant_id=tenant_id, seq=first_seq).values_list("prev_hash", flat=True).first()
    if event is not None:
        return event
    # Every event of the slice before was archived (none of them stayed hot): the last segment says where it ended.
    return previous.last_hash if previous is not None else GENESIS


def _commit(tenant, batch, manifest, sha256, size, *, actions, keys, taken, tables, actor, now,
            spans=None) -> ArchiveSegment:
    ids = [c.run_id for c in batch]
    with ledger_transaction(tenant.pk) as audit:
        fresh = Tenant.objects.filter(pk=tenant.pk).values_list("legal_hold", "retention_seconds").get()
        tenant.legal_hold, tenant.retention_seconds = fresh
        still = retention.settled(Run.objects.filter(pk__in=ids, legal_hold=False, status__in=list(
            retention.RUN_FINAL)).values_list("pk", flat=True), tenant=tenant, now=now) if not tenant.legal_hold else set()
        if still != set(ids):
            changed = sorted(set(ids) - still)
            raise StateConflict(f"run {changed[0]} of tenant {tenant.slug} is no longer due (a legal hold, or a step "
                                "reopened, since the pass began): it stays hot")
        segment = ArchiveSegment.objects.create(
            tenant_id=tenant.pk, number=manifest["number"], sha256=sha256, first_seq=manifest["first_seq"],
            last_seq=manifest["last_seq"], runs=len(ids), actions=actions, size=size)
        _index(tenant, batch, segment, keys, now=now)
        for table in tables:
            for column, path in table.nulls:
                table.model._base_manager.filter(**{f"{path}__in": id_set(ids)}).update(**{column: None})
        # Exactly the rows the segment holds, by primary key: a row added since they were read (a new trail link,
        # say) keeps its run's row referenced, and the foreign key fails the transaction rather than lose it.
        using = router.db_for_write(Run)
        for table in reversed(tables):
            label = table.model._meta.label_lower
            pks = taken.get(label) or []
            # On PostgreSQL one statement a table (its ids one array literal); elsewhere in bounded chunks. A table
            # partitioned by month is told the span of its rows' months too (the primary key includes the month):
            # each id probed every month's index, 16 of them in the bench (25 ms of a 1,000-run batch's attempts).
            chunk = max(len(pks), 1) if connection.vendor == "postgresql" else 5000
            key, low, high = (spans or {}).get(label, (None, None, None))
            within = Q(**{f"{key}__gte": low, f"{key}__lte": high}) if key else Q()
            for start in range(0, len(pks), chunk):
                table.model._base_manager.filter(within, pk__in=id_set(pks[start:start + chunk]))._raw_delete(using)
        AuditEvent.objects.filter(tenant_id=tenant.pk, run_ref__in=id_set(ids))._raw_delete(using)
        audit.record(ARCHIVED_EVENT, actor=actor, segment=sha256, number=manifest["number"],
                     first_seq=manifest["first_seq"], last_seq=manifest["last_seq"], runs=ids, actions=actions)
    return segment


def _index(tenant, batch, segment: ArchiveSegment, keys: list[tuple[str, str, int]], *, now: datetime) -> None:
    """The batch's ArchivedRun rows and its rows' ArchivedKey rows. On PostgreSQL each table in one INSERT … SELECT
    from a JSON parameter the json module writes at once: bulk_create would prepare every field of every object
    (51,000 values in a 3,000-run pass, 1.2 s)."""
    if connection.vendor != "postgresql":
        ArchivedRun.objects.bulk_create([
            ArchivedRun(run_id=c.run_id, tenant_id=tenant.pk, agent_id=c.agent_id, segment=segment,
                        first_seq=c.first_seq, last_seq=c.last_seq, finished_at=c.finished_at, archived_at=now)
            for c in batch])
        ArchivedKey.objects.bulk_create([ArchivedKey(label=label, value=value, run_id=run)
                                         for label, value, run in keys], batch_size=5000)
        return
    runs = json.dumps([(c.run_id, c.agent_id, c.first_seq, c.last_seq,
                        c.finished_at.isoformat() if c.finished_at is not None else None) for c in batch])
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(ArchivedRun._meta.db_table)} (run_id, tenant_id, agent_id, segment_id, first_seq, "
            "last_seq, finished_at, archived_at) SELECT (r->>0)::bigint, %s, (r->>1)::bigint, %s, (r->>2)::bigint, "
            "(r->>3)::bigint, (r->>4)::timestamptz, %s FROM json_array_elements(%s::json) AS r",
            (tenant.pk, segment.pk, now, runs))
        if keys:
            cursor.execute(
                f"INSERT INTO {quote(ArchivedKey._meta.db_table)} (label, value, run_id) "
                "SELECT k->>0, k->>1, (k->>2)::bigint FROM json_array_elements(%s::json) AS k",
                (json.dumps(keys, ensure_ascii=False),))


def legal_hold_set(*, tenant: Tenant, held: bool, actor: str, why: str, run: Run | None = None) -> bool:
    """Set or clear a legal hold on a run or on its whole tenant, recorded in the tenant's chain with who and why.
    Returns whether anything changed. A hold keeps runs out of every archive pass from the moment it commits."""
    why = (why or "").strip()
    if not why:
        raise ValidationFailed("why: a legal hold is set or cleared with a reason", field="why")
    with ledger_transaction(tenant.pk) as audit:
        if run is not None:
            changed = Run.objects.filter(pk=run.pk, tenant_id=tenant.pk).exclude(legal_hold=held).update(
                legal_hold=held)
        else:
            changed = Tenant.objects.filter(pk=tenant.pk).exclude(legal_hold=held).update(legal_hold=held)
        if changed:
            audit.record(HOLD_EVENT, actor=actor, run=run, held=held, why=why[:1000],
                         scope="run" if run is not None else "tenant")
    if run is not None:
        run.legal_hold = held
    else:
        tenant.legal_hold = held
    return bool(changed)
