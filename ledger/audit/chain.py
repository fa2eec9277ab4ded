"""The keyed, hash-chained audit log and the transaction every ledger write happens in.

Every write to a tenant's ledger runs in `ledger_transaction(tenant_id)`: it locks the tenant's
chain head first (one lock order for every writer, so writers of one tenant never deadlock), lets
the services record events, and appends them to the chain just before commit. A rolled-back change
leaves no event; a committed one always has its event.

Each event's hash is an HMAC-SHA256 over the previous hash and the event, under a key that is not in
the database (settings UNWIND_AUDIT_KEYS; the event records the id of the key it was made with), so
someone who can write to the database can neither edit an event nor recompute the chain after deleting
one. Each tenant's head is also signed and exported outside the database (ledger/audit/export.py), so
cutting the chain short below an exported head is detected too.

Each event that concerns a row a person or a recovery decision reads carries a fingerprint of that row
as it stood after the change (runs, actions, tool policy here; approval decisions and recovery items
through `register_fingerprinted`, which those apps call at ready()), so `verify_chain` also notices a
row edited or deleted behind the services' back.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

from ledger.audit import subjects
from ledger.db import received, sql
from ledger.canonical import digest, digest_plain, dumps, dumps_plain
from ledger.models import (
    Action, AuditEvent, AuditHead, ErasedRun, Erasure, Membership, Run, TenantPolicyVersion, Tool,
)

GENESIS = "0" * 64
_local = threading.local()


# --- fingerprints --------------------------------------------------------------------------------

# Every field a person reads on the run page, the approval preview or the correction trail, or that a recovery
# decision depends on (what was done, to what, with what outcome, and how it would be undone).
ACTION_FIELDS = (
    "run_id", "tool_id", "kind", "compensates_id", "status", "args", "args_hash", "target_type", "target_id",
    "idempotency_key", "result", "error_class", "error_message", "before", "after", "verification", "intent",
    "compensation_plan", "args_text", "content_key", "repeat_of_id", "stopped_by", "policy_decision",
)
RUN_FIELDS = ("tenant_id", "agent_id", "on_behalf_of", "goal", "intent", "plan", "status", "pivot_committed")
# A tool's whole policy: everything that decides how its calls are checked, run, verified and undone. Fields a
# Tool gains are added here (tests/test_audit_keyed.py fails on a Tool field that is in neither list).
TOOL_POLICY_FIELDS = (
    "name", "description", "args_schema", "action_class", "saga_role", "risk", "approval", "approvals_required",
    "executor", "endpoint", "target_type", "target_from", "key_fields", "honours_idempotency_key", "snapshot",
    "verify", "lookup", "compensation", "timeout_seconds", "max_attempts", "backoff_seconds", "version", "actor",
    "on_refusal", "describe", "display", "hold", "rules", "limits", "retention_seconds",
)
TENANT_DEFAULTS_FIELDS = ("version", "approval_threshold", "approval_ttl_seconds", "actor", "run_idle_timeout_seconds",
                          "local_part_case_sensitive", "customer_requests_seconds", "subaddress_separators",
                          "retention_seconds")
# Fields a fingerprinted row gained after chains were first written, with the value every earlier row holds. While
# a row holds it, the field stays out of the fingerprint; otherwise it joins by name, so rows recorded before the
# field existed still verify as recorded, and setting the field on one of them shows like any other edit.
# `args_text` is what the tool receives and `content_key` what later calls are matched on: editing either must show
# like editing `args`. `policy_decision` is why a person was asked (or the call refused): the approver reads it.
ADDED_LATER = {"on_refusal": "answer", "describe": {}, "display": {}, "run_idle_timeout_seconds": 3600,
               "local_part_case_sensitive": False,
               "args_text": "", "content_key": "", "repeat_of_id": None, "hold": {}, "stopped_by": "",
               "customer_requests_seconds": 0, "subaddress_separators": "+",
               "rules": [], "limits": [], "policy_decision": None, "retention_seconds": 0}
# Fingerprinted by their bytes: the digest's canonical form would not tell composed from decomposed text.
BY_BYTES = ("args_text",)
# `is_current` is the one field a recorded version changes (when a newer one supersedes it); `verify_chain` checks
# it instead: the current version of every tool is its newest.
TOOL_UNFINGERPRINTED_FIELDS = ("id", "tenant", "created_at", "updated_at", "is_current")


def _plain(value):
    return value.isoformat() if isinstance(value, datetime) else value


def _later(name: str, value):
    return hashlib.sha256(value.encode()).hexdigest() if name in BY_BYTES else _plain(value)


def _fingerprint(label: str, obj: models.Model, fields: tuple[str, ...], read_plain: bool = False) -> str:
    """The row's digest; for a row of a run acted for someone, an HMAC of it under the run's key
    (ledger/audit/subjects.py). A run opened before keys existed has none: its rows' digests are bare, as recorded.
    `read_plain`: the row was read back with every value plain (text, numbers without a fraction, booleans, nulls,
    times, JSON decoded as such: ledger/canonical.py `loads_noting_plain`), so its digest skips the canonical copy."""
    named, added = _fields_split(fields)
    values = [_plain(getattr(obj, name)) for name in named]
    later = {}
    for name in added:
        value = getattr(obj, name)
        if value != ADDED_LATER[name]:
            later[name] = _later(name, value)
    hashed = digest_plain if read_plain else digest
    plain = hashed(label, obj.pk, *values, later) if later else hashed(label, obj.pk, *values)
    return subjects.keyed(subjects.key_of(obj), plain)


@lru_cache(maxsize=64)
def _fields_split(fields: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`fields` as `_fingerprint` reads them: those every row's digest holds, and those in `ADDED_LATER`, in order."""
    return (tuple(name for name in fields if name not in ADDED_LATER),
            tuple(name for name in fields if name in ADDED_LATER))


def action_fingerprint(action: Action, *, read_plain: bool = False) -> str:
    return _fingerprint("action", action, ACTION_FIELDS, read_plain)


def run_fingerprint(run: Run, *, read_plain: bool = False) -> str:
    return _fingerprint("run", run, RUN_FIELDS, read_plain)


@dataclass(frozen=True)
class Fingerprinted:
    """A model whose rows the chain fingerprints: each event of one of `kinds` carries the fingerprint of the row
    it concerns (passed as `rows=` to `AuditLog.record`), and `verify_chain` compares every row of the tenant with
    the last fingerprint recorded for it."""

    model: type[models.Model]
    fields: tuple[str, ...]
    kinds: frozenset[str]
    tenant_lookup: str

    @property
    def label(self) -> str:
        return self.model._meta.label_lower


_fingerprinted: dict[str, Fingerprinted] = {}


def register_fingerprinted(model: type[models.Model], *, fields: tuple[str, ...], kinds: tuple[str, ...],
                           tenant_lookup: str = "tenant_id") -> None:
    """Called at AppConfig.ready() by the apps that own the model (the ledger imports none of them). A field the
    model gains later goes in `ADDED_LATER` too, so rows recorded before it keep their fingerprints."""
    spec = Fingerprinted(model, tuple(fields), frozenset(kinds), tenant_lookup)
    _fingerprinted[spec.label] = spec


def fingerprinted_models() -> list[Fingerprinted]:
    return list(_fingerprinted.values())


def row_fingerprint(obj: models.Model, *, read_plain: bool = False) -> str:
    spec = _fingerprinted.get(obj._meta.label_lower)
    if spec is None:
        raise TypeError(f"{obj._meta.label_lower} is not registered with register_fingerprinted")
    return _fingerprint(spec.label, obj, spec.fields, read_plain)


def tool_fingerprint(tool: Tool) -> str:
    return row_fingerprint(tool)


register_fingerprinted(Tool, fields=TOOL_POLICY_FIELDS, kinds=("tool.registered", "tool.updated"))
register_fingerprinted(TenantPolicyVersion, fields=TENANT_DEFAULTS_FIELDS,
                       kinds=("tenant.defaults",))
# Who holds which role: a viewer made admin in the database shows. `membership.set` events written before roles were
# fingerprinted carry none, so only the kinds that always did are held to it (migration 0015 recorded the roles
# that existed then).
MEMBERSHIP_FIELDS = ("user_id", "role")
register_fingerprinted(Membership, fields=MEMBERSHIP_FIELDS, kinds=("membership.removed", "membership.recorded"))
# An erasure and the runs it erased (recovery/erasure.py): a run marked erased in the database, or an erasure's
# numbers changed, shows.
register_fingerprinted(Erasure, fields=("erased_at", "erased_by", "reason", "runs", "actions", "fields", "events",
                                        "unkeyed_events"), kinds=("subject.erased",))
register_fingerprinted(ErasedRun, fields=("run_id", "erasure_id", "erased_at"), kinds=("subject.erased",))

# --- seals --------------------------------------------------------------------------------------------------

# The events that make a step. Each also records the step's seal (`sends`): what its call will be.
SEALED_KINDS = ("forward.proposed", "compensation.proposed")


def sent_text(action: Action) -> str:
    """The JSON text a step's tool receives (`executors.call.http_call` sends exactly these bytes; the in-process and
    MCP executors get the object they parse to): its args as the agent wrote them (`args_text`), or, for a step
    recorded before they were kept, the canonical form."""
    return received.dumps(received.loads(action.args_text) if action.args_text else action.args)


def seal(action: Action, text: str | None = None, *, read_plain: bool = False) -> dict:
    """What a step's call is, as the event that makes it records it: the SHA-256 of the body its tool receives, a
    digest of whom it calls (the tool version, the tenant and the idempotency key it is sent with), one of its target
    (a step whose target its result names gets it only once it succeeded), and how many people must approve it first.
    Recomputed from the row just before the call leaves (ledger/audit/sealed.py) and by `verify_chain`, so an edit of
    the row shows whatever was recorded about it since: no later event's fingerprint launders it."""
    body = sent_text(action) if text is None else text
    key = subjects.key_of(action)
    hashed = digest_plain if read_plain else digest  # `read_plain`: as for `_fingerprint`
    return {"body": subjects.keyed(key, hashlib.sha256(body.encode()).hexdigest()),
            "call": subjects.keyed(key, hashed(action.tool_id, action.tenant_id, action.key_agent,
                                                action.idempotency_key)),
            "target": subjects.keyed(key, hashed(action.target_id)), "approvals": action.approvals_required}


def sealed_fields(action: Action) -> tuple:
    """What a seal is computed from, as the values stand: an object whose values are still these has that seal."""
    return (action.args_text, action.args, action.args_hash, action.tool_id, action.target_id, action.tenant_id,
            action.key_agent, action.idempotency_key, action.approvals_required)


# The events after which a succeeded step's undo is what it is: its success (what the undo resolves its arguments
# from is all there) and a person's completing of its undo's arguments (ledger/engine/undo_plans.py). Each records
# the step's undo seal (`undo`).
UNDO_SEALED_KINDS = ("forward.succeeded", "compensation.plan_completed")


def undo_seal(action: Action, *, read_plain: bool = False) -> str:
    """A digest of everything a succeeded step's undo is built from (`unwinding.new_compensation`, `undo_args`,
    `undo_approvals`, `compensation_tool`, the drift check): its compensation plan (the undo tool's version, the
    arguments' mapping, or those a person completed, its risk and approval), what `$args`, `$result`, `$before`,
    `$after`, `$target`, `$key` and `$intent` resolve to, and whom the undo is sent for. Recorded when the step
    succeeds and recomputed from the row just before its undo is sent (ledger/audit/sealed.py) and by `verify_chain`:
    the unwinder's own events fingerprint the row as it then stands, so an edit made in between would otherwise be
    laundered by them, and the undo tool sent bytes nobody recorded. `force` is left out: the operator's choice to
    overwrite a drifted target (`runs.run_compensate`), set on the plan after the step succeeded."""
    plan = {name: value for name, value in (action.compensation_plan or {}).items() if name != "force"}
    hashed = digest_plain if read_plain else digest  # `read_plain`: as for `_fingerprint`
    plain = hashed("undo", action.tenant_id, action.tool_id, plan,
                   hashlib.sha256(action.args_text.encode()).hexdigest(), action.args, action.result, action.before,
                   action.after, action.target_type, action.target_id, action.idempotency_key, action.key_agent,
                   action.risk, action.intent)
    return subjects.keyed(subjects.key_of(action), plain)


# The keys of an event's data that hold fingerprints (and seals): only `verify_chain` and the engine's checks read
# them, pages leave them out.
FINGERPRINT_KEYS = ("action_state", "run_state", "rows", "sends", "undo")


# --- the chain -----------------------------------------------------------------------------------

def _body_value(*, key_id: str, tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at) -> dict:
    return {
        "tenant": tenant_id, "seq": seq, "kind": kind, "actor": actor, "run": run_ref,
        "action": action_ref, "data": data, "at": created_at.isoformat(), "key": key_id,
    }


def _body(*, key_id: str, tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at) -> str:
    """The text an event's HMAC signs (after the previous hash)."""
    return dumps(_body_value(key_id=key_id, tenant_id=tenant_id, seq=seq, kind=kind, actor=actor, run_ref=run_ref,
                             action_ref=action_ref, data=data, created_at=created_at))


def event_hash(key: bytes, prev_hash: str, *, key_id: str, tenant_id, seq, kind, actor, run_ref, action_ref, data,
               created_at) -> str:
    body = _body(key_id=key_id, tenant_id=tenant_id, seq=seq, kind=kind, actor=actor, run_ref=run_ref,
                 action_ref=action_ref, data=data, created_at=created_at)
    return hmac.new(key, (prev_hash + body).encode(), hashlib.sha256).hexdigest()


def keyed_for_events(key: bytes) -> "hmac.HMAC":
    """The audit key made ready once for `read_event_hash`, which copies it for each event."""
    return hmac.new(key, digestmod=hashlib.sha256)


def read_event_hash(keyed: "hmac.HMAC", prev_hash: str, *, key_id: str, tenant_id, seq, kind, actor, run_ref,
                    action_ref, data, created_at, data_plain: bool) -> str:
    """`event_hash` under the key `keyed` holds (`keyed_for_events`), for an event read back: `data_plain` says its
    data was found plain as it was decoded (ledger/canonical.py `loads_noting_plain`), and with the event's other
    columns of their stored types the body's text is then the encoder's (`dumps_plain`). The same bytes are signed."""
    body = _body_value(key_id=key_id, tenant_id=tenant_id, seq=seq, kind=kind, actor=actor, run_ref=run_ref,
                       action_ref=action_ref, data=data, created_at=created_at)
    plain = (data_plain and type(tenant_id) is int and type(seq) is int and type(kind) is str and type(actor) is str
             and type(key_id) is str and (run_ref is None or type(run_ref) is int)
             and (action_ref is None or type(action_ref) is int))
    signed = keyed.copy()
    signed.update((prev_hash + (dumps_plain(body) if plain else dumps(body))).encode())
    return signed.hexdigest()


def body_around_seq(*, key_id: str, tenant_id: int, kind, actor, run_ref, action_ref, data_text: str,
                    created_at) -> tuple[str, str]:
    """The text `event_hash` signs, as the parts before and after the event's sequence number, for a signer that
    learns the number only once it holds the chain head (ledger/engine/fastpath.py). `data_text` is the data's canonical
    JSON (`dumps`), which the body holds as it is: the body is encoded around a null in its place, and a null
    after `"data":` can only be that value, as every quote inside a string is escaped. The keys are sorted, so
    the number is always followed by the tenant and the end of the object."""
    body = _body(key_id=key_id, tenant_id=tenant_id, seq=0, kind=kind, actor=actor, run_ref=run_ref,
                 action_ref=action_ref, data=None, created_at=created_at)
    tail = f',"tenant":{dumps(tenant_id)}}}'
    cut = ',"seq":0' + tail
    before, found, after = body.partition(',"data":null,')
    if not found or not after.endswith(cut):
        raise ValueError("an event body whose data or sequence number is not where the signer expects it")
    return before + ',"data":' + data_text + "," + after[:-len(cut)] + ',"seq":', tail


def event_is_authentic(event: AuditEvent, keys: dict[str, bytes] | None = None) -> bool:
    """Whether the event's HMAC matches under the key it names (its links and rows are `verify_chain`'s business)."""
    key = (settings.UNWIND_AUDIT_KEYS if keys is None else keys).get(event.key_id)
    return key is not None and hmac.compare_digest(event.hash, event_hash(
        key, event.prev_hash, key_id=event.key_id, tenant_id=event.tenant_id, seq=event.seq, kind=event.kind,
        actor=event.actor, run_ref=event.run_ref, action_ref=event.action_ref, data=event.data,
        created_at=event.created_at))


@dataclass
class AuditLog:
    tenant_id: int
    head: AuditHead
    pending: list = field(default_factory=list)
    writes: list = field(default_factory=list)

    def write_at_commit(self, statement: tuple[str, list]) -> None:
        """Send a write whose outcome nothing in this transaction reads (an attempt's start or finish) with the
        audit append, just before commit: on PostgreSQL it rides in the append's single statement."""
        self.writes.append(statement)

    def record(self, kind: str, *, actor: str, run: Run | None = None, action: Action | None = None,
               rows: tuple[models.Model, ...] | list[models.Model] = (),
               removed: tuple[models.Model, ...] | list[models.Model] = (), **data) -> None:
        """Append an event at commit. `rows` are rows of fingerprinted models (see `register_fingerprinted`) the
        event concerns, each fingerprinted as it stands now; `removed`, such rows the change deletes (recorded with
        no fingerprint, so that `verify_chain` expects them gone)."""
        if action is not None:
            data["action_state"] = action_fingerprint(action)
            if kind in SEALED_KINDS:
                # The object recorded here remembers its seal and what it was computed from: sent from memory, unchanged,
                # it needs no read of this event (ledger/audit/sealed.py).
                data["sends"] = seal(action)
                action._sealed = (data["sends"], sealed_fields(action))
            elif kind in UNDO_SEALED_KINDS:
                data["undo"] = undo_seal(action)
            run_ref = action.run_id
        else:
            run_ref = run.pk if run is not None else None
        if run is not None:
            data["run_state"] = run_fingerprint(run)
        if rows or removed:
            data["rows"] = {f"{row._meta.label_lower}:{row.pk}": row_fingerprint(row) for row in rows}
            data["rows"].update({f"{row._meta.label_lower}:{row.pk}": None for row in removed})
        self.pending.append((kind, actor, run_ref, action.pk if action is not None else None, data))

    def flush(self) -> None:
        """Run the writes left for the commit, append the pending events and move the head: one statement on
        PostgreSQL (data-modifying CTEs, each on rows the others do not touch), one per write on SQLite."""
        writes, self.writes = self.writes, []
        if not self.pending:
            with connection.cursor() as cursor:
                for statement, params in writes:
                    cursor.execute(statement, params)
            return
        seq, prev = self.head.seq, self.head.hash
        now = timezone.now()
        at = connection.ops.adapt_datetimefield_value(now)
        key_id = settings.UNWIND_AUDIT_KEY_ID
        key = settings.UNWIND_AUDIT_KEYS[key_id]
        rows = []
        digest_value = AuditEvent._meta.get_field("hash").get_db_prep_value  # bytea on PostgreSQL
        for kind, actor, run_ref, action_ref, data in self.pending:
            seq += 1
            text = dumps(data)
            data = json.loads(text)  # what is hashed is exactly what the database returns
            h = event_hash(key, prev, key_id=key_id, tenant_id=self.tenant_id, seq=seq, kind=kind, actor=actor,
                           run_ref=run_ref, action_ref=action_ref, data=data, created_at=now)
            rows.append((self.tenant_id, seq, kind, actor, run_ref, action_ref, text, at,
                         digest_value(prev, connection), digest_value(h, connection), key_id))
            prev = h
        append = (f"{_APPEND} {', '.join([_EVENT_ROW] * len(rows))}", [value for row in rows for value in row])
        move = (_MOVE_HEAD, [seq, prev, self.tenant_id])
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                parts = [*writes, append]
                ctes = ", ".join(f"w{i} AS ({statement})" for i, (statement, _) in enumerate(parts))
                cursor.execute(f"WITH {ctes} {move[0]}", [value for _, params in parts for value in params] + move[1])
            else:
                for statement, params in [*writes, append, move]:
                    cursor.execute(statement, params)
        self.head.seq, self.head.hash = seq, prev
        self.pending.clear()


_APPEND = ("INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, "
           "prev_hash, hash, key_id) VALUES")
_EVENT_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
_MOVE_HEAD = "UPDATE ledger_audithead SET seq = %s, hash = %s WHERE tenant_id = %s"


@contextmanager
def ledger_transaction(tenant_id: int):
    """atomic() + the tenant's chain-head lock + an AuditLog flushed before commit. Re-entrant."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    for outer in reversed(stack):
        if outer.tenant_id == tenant_id:
            events, writes = len(outer.pending), len(outer.writes)
            try:
                with transaction.atomic():
                    yield outer
            except BaseException:
                # The savepoint rolled back: so do the events and writes recorded inside it.
                del outer.pending[events:], outer.writes[writes:]
                raise
            return
    with transaction.atomic(), subjects.cache_scope():
        # Lock first: every writer of this tenant takes the same lock before any other row.
        head = sql.get_locked(AuditHead, tenant_id)
        log = AuditLog(tenant_id, head)
        stack.append(log)
        try:
            yield log
            log.flush()
        finally:
            stack.pop()


def open_log(tenant_id: int) -> "AuditLog | None":
    """This thread's ledger transaction of the tenant under way, if any (its head is in memory until it commits)."""
    for outer in reversed(getattr(_local, "stack", None) or []):
        if outer.tenant_id == tenant_id:
            return outer
    return None


@contextmanager
def recording(tenant_id: int):
    """The tenant's open AuditLog when a ledger transaction is already under way (an engine event handler records
    into the engine's transaction without a savepoint of its own); otherwise a new `ledger_transaction`."""
    outer = open_log(tenant_id)
    if outer is not None:
        yield outer
        return
    with ledger_transaction(tenant_id) as log:
        yield log
