"""Verifying a tenant's audit chain: its sequence, links, HMACs, head, exported signed head and row fingerprints.

The chain is written by ledger/audit/chain.py; heads are signed and exported by ledger/audit/export.py. This module reads
both (the export only when UNWIND_AUDIT_EXPORT_DIR is set, so `cryptography` is loaded only then), and neither
imports it back.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from django.db import connection
from django.db.models import JSONField, TextField
from django.db.models.functions import Cast

from ledger.archive import chain as archive_chain
from ledger.archive.service import ARCHIVED_EVENT
from ledger.db import sql
from ledger.audit import erased, sealed, subjects
from ledger.audit.chain import (
    ACTION_FIELDS, GENESIS, RUN_FIELDS, SEALED_KINDS, UNDO_SEALED_KINDS, action_fingerprint, fingerprinted_models,
    keyed_for_events, read_event_hash, row_fingerprint, run_fingerprint,
)
from ledger.canonical import loads_noting_plain
from ledger.models import Action, ActionStatus, AuditEvent, AuditHead, Run, Tenant, TenantPolicyVersion, Tool
from ledger.policy.limits import COUNTED  # the statuses whose steps hold their share of a limit


@dataclass
class ChainReport:
    ok: bool
    events: int
    problem: str = ""
    check: str = ""  # which check failed: sequence, link, key, hmac, head, sends, hold, undo, fingerprint, policy,
    # attempt, totals, export-signature, export-head
    exported_head: int | None = None  # the seq of the signed head checked against, when there is one
    segments: int = 0  # archived segments read as part of the chain (ledger/archive)


class _Broken(Exception):
    def __init__(self, check: str, problem: str):
        super().__init__(problem)
        self.check, self.problem = check, problem


def verify_chain(tenant_id: int, *, keys: dict[str, bytes] | None = None) -> ChainReport:
    """Walk a tenant's chain: sequence, links, each event's HMAC under the key it names, the head, the newest signed
    head exported outside the database (when UNWIND_AUDIT_EXPORT_DIR is set), and the fingerprints of the rows."""
    keys = settings.UNWIND_AUDIT_KEYS if keys is None else keys
    state = {"events": 0, "exported": None, "segments": 0}
    try:
        with subjects.cache_scope(tenant_id):
            _verify(tenant_id, keys, state)
    except archive_chain.ArchiveBroken as broken:
        return ChainReport(False, state["events"], broken.problem, broken.check, state["exported"])
    except _Broken as broken:
        return ChainReport(False, state["events"], broken.problem, broken.check, state["exported"])
    return ChainReport(True, state["events"], exported_head=state["exported"], segments=state["segments"])


def _verify(tenant_id: int, keys: dict[str, bytes], state: dict) -> None:
    exported = None
    if settings.UNWIND_AUDIT_EXPORT_DIR:
        from ledger.audit import export as audit_export  # cryptography is loaded only where heads are signed or checked

        try:
            exported = audit_export.latest_head(tenant_id)
        except audit_export.ExportInvalid as exc:
            raise _Broken("export-signature", str(exc)) from None
        state["exported"] = exported["seq"] if exported else None
    # Archived segments (ledger/archive, docs/archive.md) hold the older slices of the chain and the rows of the runs
    # they took out of the hot tables: the walk reads them first, one at a time, as one chain with the hot events.
    archive = archive_chain.load(tenant_id)
    segments_recorded: dict[str, int] = {}
    prev = GENESIS
    expected_seq = 0
    last_action: dict[int, tuple[str, int]] = {}
    last_run: dict[int, tuple[str, int]] = {}
    last_row: dict[str, dict[str, tuple[str, int]]] = {spec.label: {} for spec in fingerprinted_models()}
    carried_by = {kind: spec for spec in fingerprinted_models() for kind in spec.kinds}
    # What the chain recorded of each step besides its fingerprints (ledger/audit/sealed.py): the seal of the event
    # that made it, the end of its latest hold, what its undo is built from (its latest undo seal), and every refusal
    # of a step whose row differed from them.
    seals: dict[int, tuple[dict | None, int]] = {}
    undo_seals: dict[int, tuple[str, int]] = {}
    approved: set[int] = set()
    holds: dict[int, tuple[str, int]] = {}
    refused: list[tuple[int, str, str]] = []
    rewritten = erased.Rewritten(tenant_id)
    keyed: dict[str, object] = {}  # each key made ready once (chain.keyed_for_events)
    for event in archive_chain.events(archive, _hot_events(tenant_id)):
        state["events"] += 1
        expected_seq += 1
        if event.seq != expected_seq:
            raise _Broken("sequence", f"event #{expected_seq} is missing (next is #{event.seq}): deleted")
        if event.prev_hash != prev:
            raise _Broken("link", f"event #{event.seq} does not link to #{event.seq - 1}")
        signer = keyed.get(event.key_id)
        if signer is None:
            key = keys.get(event.key_id)
            if key is None:
                named = event.key_id or "(none)"
                raise _Broken("key", f"event #{event.seq} was made with audit key id {named!r}, which is not "
                                     "configured: add that key to UNWIND_AUDIT_OLD_KEYS or UNWIND_AUDIT_OLD_KEY_FILES")
            signer = keyed[event.key_id] = keyed_for_events(key)
        recomputed = read_event_hash(signer, prev, key_id=event.key_id, tenant_id=tenant_id, seq=event.seq,
                                     kind=event.kind, actor=event.actor, run_ref=event.run_ref,
                                     action_ref=event.action_ref, data=event.data, created_at=event.created_at,
                                     data_plain=getattr(event, "plain", False))
        if not hmac.compare_digest(recomputed, event.hash) and not rewritten.pending(event):
            raise _Broken("hmac", f"event #{event.seq} ({event.kind}) was edited: its HMAC under key "
                                  f"{event.key_id} does not match (rewritten without the audit key)")
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind == erased.KIND:
            rewritten.vouched(event, data, last_action, last_run, seals, undo_seals)
        if event.action_ref is not None and "action_state" in data:
            last_action[event.action_ref] = (data["action_state"], event.seq)
        if event.run_ref is not None and "run_state" in data:
            last_run[event.run_ref] = (data["run_state"], event.seq)
        if event.action_ref is not None and event.kind in SEALED_KINDS and event.action_ref not in seals:
            seals[event.action_ref] = (data.get("sends"), event.seq)
        if event.action_ref is not None and event.kind in sealed.APPROVED_KINDS:
            approved.add(event.action_ref)
        if event.action_ref is not None and event.kind in UNDO_SEALED_KINDS and "undo" in data:
            undo_seals[event.action_ref] = (str(data["undo"]), event.seq)
        if event.action_ref is not None and event.kind == "forward.held" and "executes_at" in data:
            holds[event.action_ref] = (data["executes_at"], event.seq)
        if event.kind == ARCHIVED_EVENT:
            segments_recorded[str(data.get("segment"))] = event.seq
        if event.kind == sealed.TAMPERING:
            refused.append((event.seq, str(data.get("check") or "sends"), str(data.get("problem") or "")))
        carried = data.get("rows") or {}
        spec = carried_by.get(event.kind)
        if spec is not None and not any(ref.startswith(spec.label + ":") for ref in carried):
            raise _Broken("fingerprint",
                          f"event #{event.seq} ({event.kind}) carries no fingerprint of its {spec.label} row")
        for ref, fingerprint in carried.items():
            label, _, pk = ref.rpartition(":")
            if label in last_row and fingerprint is None:
                last_row[label].pop(pk, None)  # removed by the services
            elif label in last_row:
                last_row[label][pk] = (fingerprint, event.seq)
        if exported is not None and event.seq == exported["seq"] and event.hash != exported["hash"]:
            raise _Broken("export-head", f"event #{event.seq} is not the signed head exported at {exported['at']}: "
                                         "the chain was rewritten from there on")
        prev = event.hash
    state["segments"] = archive.read
    if exported is not None and expected_seq < exported["seq"]:
        raise _Broken("export-head", f"the chain ends at #{expected_seq}, below the signed head #{exported['seq']} "
                                     f"exported at {exported['at']}: events were removed")
    problem = rewritten.unvouched()
    if problem:
        raise _Broken("hmac", problem)
    head = AuditHead.objects.filter(pk=tenant_id).first()
    if head is not None and (head.seq != expected_seq or head.hash != prev):
        raise _Broken("head", f"the chain ends at #{expected_seq} but its head says #{head.seq}: events were removed")
    archive_chain.recorded_segments(archive, segments_recorded)
    _check_archived_rows(archive, last_action, last_run, last_row)
    # Runs first: a step's fingerprint is keyed with its run's key (ledger/audit/subjects.py), so an edit of the key
    # is named as the run's.
    _check_rows(Run.objects.filter(tenant_id=tenant_id), "run", RUN_FIELDS, run_fingerprint, last_run,
                every_row_recorded=False)
    # The steps are read once, for their fingerprints and for their seals, holds and undo plans (_check_seal); the
    # first problem of the latter (or error) is reported where it always was, once every fingerprint is checked.
    sealing: list[Exception] = []

    def check_seal(action: Action, plain: bool) -> None:
        if sealing:
            return
        try:
            _check_seal(action, plain, seals, approved, holds, undo_seals)
        except Exception as problem:  # noqa: BLE001 - raised below, after the fingerprints, as before
            sealing.append(problem)

    _check_rows(Action.objects.filter(tenant_id=tenant_id), "action", (*ACTION_FIELDS, *SEAL_FIELDS),
                action_fingerprint, last_action, every_row_recorded=True, also=check_seal)
    for spec in fingerprinted_models():
        recorded = {int(pk): value for pk, value in last_row[spec.label].items()}
        rows = spec.model._default_manager.filter(**{spec.tenant_lookup: tenant_id})
        _check_rows(rows, spec.label, spec.fields, row_fingerprint, recorded, every_row_recorded=True)
    # After the fingerprints, which name an edit made since a step's last event; these name one a later event
    # fingerprinted (laundered) as well.
    if sealing:
        raise sealing[0]
    _check_policy_in_force(tenant_id)
    _check_attempts(tenant_id)
    _check_totals(tenant_id)
    if refused:
        # The engine caught these before it acted (the step was not sent, its run went to a person): the ledger was
        # still edited behind the services' back, and the chain says so for good.
        seq, check, problem = refused[0]
        more = f" (and {len(refused) - 1} more such refusals)" if len(refused) > 1 else ""
        raise _Broken(check, f"event #{seq} recorded a step refused by the engine: {problem}{more}")


class _HotEvent:
    """A hot event's columns, with the attributes of an AuditEvent row that the walk, the archive's join
    (archive_chain.events) and the erasure's vouching read: no model instance is built per event."""

    __slots__ = ("seq", "kind", "actor", "run_ref", "action_ref", "data", "created_at", "prev_hash", "hash", "key_id",
                 "tenant_id", "plain")

    def __init__(self, tenant_id, seq, kind, actor, run_ref, action_ref, data_text, created_at, prev_hash, hash_,
                 key_id):
        self.tenant_id, self.seq, self.kind, self.actor = tenant_id, seq, kind, actor
        self.run_ref, self.action_ref, self.created_at = run_ref, action_ref, created_at
        self.prev_hash, self.hash, self.key_id = prev_hash, hash_, key_id
        # As the model's JSONField reads the column (text that is not JSON stays text), noting whether it is plain
        # (ledger/canonical.py), which lets its hash skip the canonical copy.
        self.data, self.plain = None, False
        if data_text is not None:
            try:
                self.data, self.plain = loads_noting_plain(data_text)
            except json.JSONDecodeError:
                self.data = data_text


_EVENT_COLUMNS = ("seq", "kind", "actor", "run_ref", "action_ref", "data_text", "created_at", "prev_hash", "hash",
                  "key_id")


def _hot_events(tenant_id: int):
    """The tenant's hot events in order, read in chunks on a server-side cursor (PostgreSQL), the data as its text."""
    rows = (AuditEvent.objects.filter(tenant_id=tenant_id).order_by("seq")
            .annotate(data_text=Cast("data", output_field=TextField())).values_list(*_EVENT_COLUMNS))
    for row in rows.iterator(chunk_size=2000):
        yield _HotEvent(tenant_id, *row)


def _check_archived_rows(archive, last_action: dict, last_run: dict, last_row: dict) -> None:
    """Rows that left the hot tables for a segment left legitimately: each must still be as the chain last recorded
    it, and is then no longer expected in the hot tables. A row deleted without archiving is still reported there.
    The segments are read again here, one at a time: what the chain last recorded is known only after the walk."""
    specs = [("ledger.action", Action, action_fingerprint, last_action, ACTION_FIELDS),
             ("ledger.run", Run, run_fingerprint, last_run, RUN_FIELDS)]
    specs += [(spec.label, spec.model, row_fingerprint, last_row[spec.label], spec.fields)
              for spec in fingerprinted_models()]
    for number, rows, rows_plain in archive.rows_noting_plain():
        # An archived run's steps and rows are keyed with its key, which left the hot table with it (into the segment
        # that holds them).
        subjects.remember({row["id"]: row.get("fingerprint_key") or "" for row in rows.get("ledger.run", [])})
        for label, model, fingerprint, recorded, fields in specs:
            keyed_by_text = label not in ("ledger.action", "ledger.run")
            json_fields = {name for name in fields if isinstance(model._meta.get_field(name), JSONField)}
            lines = rows.get(label, [])
            plains = rows_plain.get(label, [])
            if len(plains) != len(lines):
                plains = [False] * len(lines)
            for row, line_plain in zip(lines, plains):
                pk = str(row["id"]) if keyed_by_text else row["id"]
                last = recorded.get(pk)
                if last is None:
                    continue
                obj = archive_chain.instance(model, row)
                # Plain as a hot row is (_read_rows): its line was plain JSON, and its columns are of those types.
                plain = line_plain and type(obj.pk) in _PLAIN_COLUMNS and all(
                    type(value) in _PLAIN_COLUMNS or (name in json_fields and type(value) in (dict, list))
                    for name, value in ((name, getattr(obj, name)) for name in fields))
                if last[0] != fingerprint(obj, read_plain=plain):
                    raise _Broken("archive", f"archived {label.split('.')[-1]} {row['id']} in segment {number} "
                                             f"differs from its state at event #{last[1]}: edited before or while "
                                             "archived")
                recorded.pop(pk)
        del rows  # not held while the next segment is read


# The columns the seal, undo and hold checks read of each step.
SEAL_FIELDS = ("kind", "seq", "run", "status", "args", "args_text", "args_hash", "tool_id", "target_id",
               "tenant_id", "key_agent", "idempotency_key", "next_attempt_at", "compensation_plan", "result", "before", "after",
               "target_type", "risk", "intent", "approvals_required")


def _check_seal(action: Action, plain: bool, seals: dict, approved: set, holds: dict, undo_seals: dict) -> None:
    """A step that succeeded is still what its undo is built from as its success recorded (check `undo`); the step's
    row is the call the event that made it sealed, and one sealed as needing approval that went past it was approved
    (check `sends`); a held step's window ends when its latest hold recorded (check `hold`): the same comparisons the
    engine makes before it acts, for every row (in the order of their ids), so an edit shows however many events were
    recorded for the step since."""
    if action.status in AFTER_SUCCESS and action.pk in undo_seals:
        recorded, seq = undo_seals[action.pk]
        problem = sealed.undo_seal_problem(action, recorded, event=seq, read_plain=plain)
        if problem:
            raise _Broken("undo", problem)
    if action.pk in seals:
        recorded, seq = seals[action.pk]
        # A step made before seals were kept (none recorded) is left to its fingerprint.
        problem = sealed.seal_problem(action, recorded, event=seq, target=action.status not in AFTER_SUCCESS,
                                      read_plain=plain) if recorded is not None else ""
        if not problem and action.status in PAST_APPROVAL:
            problem = sealed.approval_problem(action, recorded, action.pk in approved)
        if problem:
            raise _Broken("sends", problem)
    if action.status == ActionStatus.HELD:
        if action.pk not in holds:
            raise _Broken("hold", f"held step {action.seq} (action {action.pk}) has no recorded hold: made held "
                                  "behind the services' back")
        executes_at, seq = holds[action.pk]
        problem = sealed.hold_problem(action, executes_at, event=seq)
        if problem:
            raise _Broken("hold", problem)


# What a step's recorded status (fingerprinted in the chain) can be once one of its attempts succeeded: a success is
# recorded with its attempt's end in one transaction, and nothing moves a step back from there.
AFTER_SUCCESS = ("succeeded", "compensating", "compensated", "compensation_failed")
# The statuses a step that waited for a person reaches only once approved (a rejected, expired or skipped one never
# was; a step's approval is recorded as `<kind>.approved`).
PAST_APPROVAL = (ActionStatus.APPROVED, ActionStatus.HELD, ActionStatus.RUNNING, ActionStatus.RETRY_SCHEDULED,
                 ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.LOST, *AFTER_SUCCESS)


def _check_attempts(tenant_id: int) -> None:
    """An attempt is only as true as its step: one that says it succeeded belongs to a step the chain recorded as
    succeeded (a lost or failed step's attempt edited to success shows)."""
    found = sql.fetch_one(
        "SELECT t.number, a.id, a.status FROM ledger_attempt t JOIN ledger_action a ON a.id = t.action_id"
        f" WHERE a.tenant_id = %s AND t.outcome = 'succeeded' AND a.status NOT IN"
        f" ({', '.join(['%s'] * len(AFTER_SUCCESS))}) ORDER BY a.id, t.number LIMIT 1", [tenant_id, *AFTER_SUCCESS])
    if found is not None:
        number, action_id, status = found
        raise _Broken("attempt", f"attempt {number} of action {action_id} says it succeeded, but the action is "
                                 f"{status} in the audit chain: edited behind the services' back")


def _check_policy_in_force(tenant_id: int) -> None:
    """The policy the engine uses is the newest recorded version: an insider cannot bring back an old tool version
    (flipping `is_current`) or change the tenant's defaults beside their versions."""
    newest: dict[str, int] = {}
    current: dict[str, int] = {}
    for name, version, is_current in Tool.objects.filter(tenant_id=tenant_id).values_list(
            "name", "version", "is_current").iterator(chunk_size=2000):
        newest[name] = max(version, newest.get(name, 0))
        if is_current:
            if name in current:
                raise _Broken("policy", f"{name} has two current versions ({current[name]} and {version})")
            current[name] = version
    for name, version in sorted(newest.items()):
        if current.get(name) != version:
            raise _Broken("policy", f"{name} runs version {current.get(name)} but its newest recorded version is "
                                    f"{version}: changed behind the services' back")
    latest = TenantPolicyVersion.objects.filter(tenant_id=tenant_id).order_by("-version").first()
    if latest is None:
        # Every tenant stores its defaults from its creation (version 0; migration 0015 for older tenants).
        raise _Broken("policy", "the tenant has no recorded defaults version: its defaults (approval threshold, "
                                "approval TTL, idle timeout) cannot be checked, and were removed behind the "
                                "services' back")
    live = Tenant.objects.filter(pk=tenant_id).values_list(
        "approval_threshold", "approval_ttl_seconds", "run_idle_timeout_seconds", "local_part_case_sensitive",
        "subaddress_separators", "retention_seconds").first()
    if live != (latest.approval_threshold, latest.approval_ttl_seconds, latest.run_idle_timeout_seconds,
                latest.local_part_case_sensitive, latest.subaddress_separators, latest.retention_seconds):
        raise _Broken("policy", f"the tenant's defaults differ from their version {latest.version}: "
                                "changed behind the services' back")


def _check_rows(rows, label, fields, fingerprint, recorded, *, every_row_recorded: bool, also=None) -> None:
    """Each row (in the order of their ids) is as the chain last recorded it; `also` is called with each row once its
    own fingerprint is checked (and whether it was read plain)."""
    seen = set()
    for row, plain in _read_rows(rows, fields):
        seen.add(row.pk)
        last = recorded.get(row.pk)
        if last is None:
            if every_row_recorded:
                raise _Broken("fingerprint", f"{label} {row.pk} has no audit event: written behind the services' back")
        elif last[0] != fingerprint(row, read_plain=plain):
            raise _Broken("fingerprint", f"{label} {row.pk} differs from its state at event #{last[1]}: "
                                         "edited behind the services' back")
        if also is not None:
            also(row, plain)
    missing = set(recorded) - seen
    if missing:
        raise _Broken("fingerprint", f"{label} {min(missing)} is in the audit chain but not in the ledger: deleted")


_PLAIN_COLUMNS = (str, int, bool, type(None), datetime)


def _read_rows(rows, fields):
    """(row, plain) for each row of the queryset `rows` in the order of their ids, the row built as `.only(*fields)`
    builds it, except that each JSON column is read as its text and decoded as the model's JSONField decodes it,
    noting whether it is plain (ledger/canonical.py `loads_noting_plain`). `plain`: every JSON value read is, and
    every other value is text, an integer, a boolean, a null or a time, so the row's digest skips the canonical copy."""
    model = rows.model
    wanted = {model._meta.pk.attname} | {model._meta.get_field(name).attname for name in fields}
    columns = [f for f in model._meta.concrete_fields if f.attname in wanted]
    as_text = {f.attname for f in columns
               if isinstance(f, JSONField) and f.decoder is None and type(f).from_db_value is JSONField.from_db_value}
    selected = [f"_text_{f.attname}" if f.attname in as_text else f.attname for f in columns]
    texts = [position for position, f in enumerate(columns) if f.attname in as_text]
    others = [position for position, f in enumerate(columns) if f.attname not in as_text]
    attnames = frozenset(f.attname for f in columns)  # from_db asks each concrete field whether it is in there
    read = rows.annotate(**{f"_text_{name}": Cast(name, output_field=TextField()) for name in as_text}) \
        .order_by("pk").values_list(*selected)
    for values in read.iterator(chunk_size=2000):
        values = list(values)
        plain = all(type(values[position]) in _PLAIN_COLUMNS for position in others)
        for position in texts:
            text = values[position]
            if text is None:
                continue
            try:
                values[position], decoded_plain = loads_noting_plain(text)
            except json.JSONDecodeError:
                decoded_plain = False  # the model's JSONField keeps such text as it is
            plain = plain and decoded_plain
        yield model.from_db(read.db, attnames, values), plain


# What each running total of a tenant's limits (ledger/policy/limits.py, migration 0022) should hold, read from the
# steps, beside what it holds. Written out with built-in functions only, not with unwind_limit_share or
# unwind_limit_bucket: a function replaced in the database (which the triggers would call too) cannot make this agree.
# The definition is limits.py's: a tool's forward steps (every version, by name) whose status counts, by the run's
# agent (0 for none) or all of the tenant (0), in buckets of 0 (all time), 60, 3600 and 86400 seconds from the epoch;
# a count adds 1, a sum the value at its path when that is a number of at least 0.
_TOTALS = """
WITH measures AS (SELECT m.id, m.tool_name, m.per, m.path FROM ledger_limitmeasure m WHERE m.tenant_id = %s),
steps AS (
    SELECT m.id AS measure, CASE WHEN m.per = 'agent' THEN coalesce(r.agent_id, 0) ELSE 0 END AS scope, s.span,
           CASE WHEN s.span = 0 THEN timestamptz 'epoch'
                ELSE date_bin(make_interval(secs => s.span), a.created_at, timestamptz 'epoch') END AS bucket,
           sum(CASE WHEN m.path = '' THEN 1::numeric
                    WHEN jsonb_typeof(a.args #> string_to_array(m.path, '.')) = 'number'
                    THEN greatest((a.args #> string_to_array(m.path, '.'))::numeric, 0)
                    ELSE 0::numeric END) AS value
      FROM measures m
      JOIN ledger_tool t ON t.tenant_id = %s AND t.name = m.tool_name
      JOIN ledger_action a ON a.tool_id = t.id AND a.kind = 'forward' AND a.status = ANY (%s)
      JOIN ledger_run r ON r.id = a.run_id
      CROSS JOIN (VALUES (0), (60), (3600), (86400)) s (span)
     GROUP BY 1, 2, 3, 4),
kept AS (SELECT t.measure_id AS measure, t.scope, t.span, t.bucket, t.value
           FROM ledger_limittotal t WHERE t.measure_id IN (SELECT id FROM measures))
SELECT m.tool_name, m.per, m.path, coalesce(k.scope, s.scope), coalesce(k.span, s.span),
       coalesce(k.bucket, s.bucket), coalesce(k.value, 0), coalesce(s.value, 0)
  FROM kept k FULL JOIN steps s
    ON s.measure = k.measure AND s.scope = k.scope AND s.span = k.span AND s.bucket = k.bucket
  JOIN measures m ON m.id = coalesce(k.measure, s.measure)
 WHERE coalesce(k.value, 0) <> coalesce(s.value, 0)
 ORDER BY m.tool_name, m.per, m.path, 4, 5, 6
"""
_NAMED = 8  # mismatches named one by one; the rest are counted


def _check_totals(tenant_id: int) -> None:
    """The running totals the limits per agent and per tenant read (PostgreSQL) are what the steps add up to: an
    insider who resets one (`UPDATE ledger_limittotal SET value = 0`) lets a budget be spent again, and each total
    that differs is named. SQLite keeps none (its limits read the steps)."""
    if connection.vendor != "postgresql":
        return
    rows = sql.fetch_all(_TOTALS, [tenant_id, tenant_id, list(COUNTED)])
    if not rows:
        return
    named = []
    for tool_name, per, path, scope, span, bucket, kept, steps in rows[:_NAMED]:
        measure = f"the sum of {path}" if path else "the count"
        who = f"agent {scope}" if per == "agent" else "the tenant"
        when = "for all time" if span == 0 else f"in the {span} s from {bucket.isoformat()}"
        named.append(f"{measure} of {tool_name} for {who} {when} is kept as {_plain(kept)} but its steps add up to "
                     f"{_plain(steps)}")
    more = f"; and {len(rows) - _NAMED} more" if len(rows) > _NAMED else ""
    raise _Broken("totals", f"{len(rows)} running total(s) of the limits differ from the steps: "
                            f"{'; '.join(named)}{more}: edited behind the services' back")


def _plain(number) -> str:
    text = format(number, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
