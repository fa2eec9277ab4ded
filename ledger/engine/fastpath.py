"""PostgreSQL: each of the engine's transactions in one round trip.

Every step the API runs makes two commits: the proposal (the action recorded, already claimed, with its attempt
and its audit event) and the outcome; a run adds its opening and its completion, an unwind one commit per
compensation. On the Python path each is BEGIN, the chain-head lock, the run lock, the checks, the writes, the
audit append and COMMIT: a round trip apiece. Here the plain case of each is one call of a database function
(ledger/engine/plpgsql/<name>.sql, one file per function, installed by `migrate`) in autocommit, so PostgreSQL runs the
whole transaction in that call:

- `unwind_propose`: writes a proposal Python decided (`proposal.plain`, `runsteps`): locks the head, then the run;
  checks the guards it was decided under (`ProposeGuards`: the run's status, cancel mark, next step number and
  actions' ids and statuses; the tool version, its compensation's twin and the tenant's slug and approval threshold,
  which the caller may have taken from what this process keeps: `kept_tool`; else it answers 'stale', and the caller
  decides again from a fresh read) and that the key is free in the scopes it is told (else 'taken': the Python path
  says whose it is); then inserts the action (its id drawn beforehand, with the tool's read or by this thread's
  previous proposal) unless its agent's key is taken (a replay: the unique index on tenant, agent and key says
  so, and nothing is written), takes the step's number, inserts the attempt, appends the event, and draws the id
  of this thread's next proposal. It knows no rule: no status name, no ordering law, no content match.
- `unwind_open_run`: locks the head, inserts the run (its id drawn beforehand, or by this thread's previous
  opening) and appends its event, and draws the id of this thread's next run.
- `unwind_complete`: writes a completion Python decided (`runs.completion`, a `plans.Completion`): locks the head,
  then the run; checks the guards it was decided under (the run's status, pivot and fingerprinted fields, which the
  events were built from, and its actions' ids and statuses in order, which the checkpoint's state was built from;
  else 'stale') and that no checkpoint of the run came after the checkpoint's id (drawn beforehand, or by this
  thread's previous completion); then completes the run, inserts the checkpoint as given, appends the events, and
  answers the run as completed. The Python writer (`plans.write_completion`) applies the same plan elsewhere.
- `unwind_compensated`: writes a step of an unwind Python decided (`unwind_plans.compensated`, `claimed`, a
  `plans.UnwindStep` that claims its next undo or settles the run itself): locks the head, then the run; checks the
  guards it was decided under (`plans.UnwindGuards`: the run's status and fingerprinted fields, its actions' ids and
  statuses as read by `run_for_unwind`, its unwind lease when the decision read it, the tenant's threshold when it
  claims an undo; else 'stale'); records the compensation's success and its step compensated (or takes the run's
  lease), then claims the next undo (the step's move, the compensation with its number and attempt) or settles the
  run with its checkpoint; appends the events. The Python writer (`plans.write_unwind`) applies the same plan
  elsewhere.
- `unwind_outcome`: writes a step's outcome Python decided, its success or its failure for good
  (`outcome_plans.success`, `failure`, a `plans.Outcome` that moves no other step and emits nothing): locks the head,
  then the run; checks the guards it was decided under (`plans.StepGuards`: the run's status, pivot and
  fingerprinted fields, cancel mark and unwind lease, and its actions' ids and statuses when the decision read them;
  else 'stale'); moves the step from the status it was decided from (a conditional update: one moved since is
  'stale' too), setting the columns the plan sets and no other, so a success and a failure are the same call with
  other changes; ends its attempt as given; moves the run and inserts its checkpoint when the plan does (a failure
  that starts the unwind: its id drawn by the read the decision was made from, `run_for_unwind`; its caller unwinds
  the run next, from that read, and `unwinding.unwind_elsewhere` queues it when it cannot); appends the events. The
  Python writer (`plans.write_outcome`) applies the same plan elsewhere, and every plan that moves another step or
  emits (pending steps skipped, a recovery item).

Anything else answers 'fallback' (or 'stale', 'taken', 'full') having written nothing, and the caller takes the Python
path, which decides the case
under the same locks and says what happened (a replay, `in_flight`, an ordering refusal, a cancelled run, a
StateConflict). Everything the chain records is built here exactly as on the Python path (the same fingerprints,
the same data); the function only fills in the sequence number and the HMAC chain (`unwind_chain_append`, which every
function calls), which it computes from the
head it locked: `event_hash`'s HMAC-SHA256 as sha256(okey || sha256(ikey || message)), with the key's padded
halves passed for that call and never stored. `verify_chain` checks these events as it checks every other.

Not used inside a ledger transaction of the same tenant already under way (its head is in memory until it
commits), nor on SQLite, nor with UNWIND_FAST_PATH off.

Longer than 500 lines: the Python side of all six functions and the one guard they share (`_trust`, the
definitions' fingerprint); each wrapper is short, and splitting them would put the guard apart from what it guards.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.utils import timezone
from psycopg.types.json import Jsonb

from ledger.audit import chain as audit
from ledger.db import sql
from ledger.db.partitions import recent
from ledger.engine import attempts, plans, plpgsql
from ledger.engine.dispatch import enqueue
from ledger.canonical import dumps
from ledger.models import Action, ActionStatus as A, Run, Tenant, Tool

log = logging.getLogger("unwind.engine")

_altered = False  # set when the guard finds the functions changed: this process stops calling them


def usable(tenant_id: int) -> bool:
    db = connections[DEFAULT_DB_ALIAS]
    return (bool(settings.UNWIND_FAST_PATH) and not _altered and db.vendor == "postgresql"
            and audit.open_log(tenant_id) is None)


# The key reaches only the functions ledger/plpgsql's files define. Someone with the database's credentials could
# replace one with a version that keeps its arguments, or plant an operator it would use instead of the built-in one.
# So on a connection's first call (`_trust`) the definitions of every `unwind_` function in schema public (name, body,
# settings) are fingerprinted and compared with the files' (`plpgsql.expected_fingerprint`), and pg_catalog must
# come first in the search
# path (so no planted operator or function is used); then every call checks, in the same statement and before the
# key is passed, that those functions are still the very rows that were checked (their oid and xmin: replacing one
# changes them). Builtins in these statements are named in pg_catalog.
TRUST = (
    "SELECT pg_catalog.md5(pg_catalog.string_agg(pg_catalog.concat_ws(':', p.proname, p.prosrc,"
    " pg_catalog.array_to_string(p.proconfig, ',')), '|' ORDER BY p.proname)),"
    " pg_catalog.array_agg(p.oid ORDER BY p.oid),"
    " pg_catalog.string_agg(pg_catalog.concat_ws(':', p.oid, p.xmin), ',' ORDER BY p.oid),"
    " pg_catalog.current_schemas(false)"
    " FROM pg_catalog.pg_proc p WHERE p.pronamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace"
    " AND p.proname OPERATOR(pg_catalog.>=) 'unwind_' AND p.proname OPERATOR(pg_catalog.<) 'unwind`'"
)
# The checked rows are written into the statement as literals (numbers from the catalog, checked to be numbers), not
# passed as parameters: with an array parameter PostgreSQL's generic plan for the check read all of pg_proc, 0.1 ms
# of every call; with the values in the text it reads the checked rows by their oid.
GUARD = (
    "pg_catalog.texteq((SELECT pg_catalog.string_agg(pg_catalog.concat_ws(':', p.oid, p.xmin), ',' ORDER BY p.oid)"
    " FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) ANY ('{{{oids}}}'::pg_catalog.oid[])),"
    " '{versions}'::pg_catalog.text)"
)
_VERSIONS = re.compile(r"[0-9]+:[0-9]+(,[0-9]+:[0-9]+)*")
_trusted: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # connection → the GUARD of its checked rows


def _trust(db) -> str | None:
    """`GUARD` for this connection's functions once they are checked to be the files', with pg_catalog first in its
    search path; None when they are not."""
    connection = db.connection
    guard = _trusted.get(connection)
    if guard is None:
        fingerprint, oids, versions, schemas = sql.fetch_one(TRUST, [])
        # pg_catalog is searched first unless the search path names it later (then it is among the explicit ones).
        if fingerprint != plpgsql.expected_fingerprint() or ("pg_catalog" in schemas and schemas[0] != "pg_catalog"):
            return None
        if not _VERSIONS.fullmatch(versions or ""):
            return None
        guard = _trusted[connection] = GUARD.format(oids=",".join(str(int(oid)) for oid in oids), versions=versions)
    return guard


@lru_cache(maxsize=8)
def _pads(key: bytes) -> tuple[bytes, bytes]:
    """HMAC's inner and outer keys (RFC 2104) for SHA-256, whose block is 64 bytes."""
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    return bytes(b ^ 0x36 for b in key), bytes(b ^ 0x5C for b in key)


def _chain(tenant_id: int, pending: list, now) -> list:
    """The events of `pending` (AuditLog.record's entries) as the functions take them, with the signing key's halves:
    each as [kind, actor, run, action, data, body before its number, body after it], the same data and bodies
    `AuditLog.flush` would sign, less each event's sequence number."""
    key_id = settings.UNWIND_AUDIT_KEY_ID
    ikey, okey = _pads(settings.UNWIND_AUDIT_KEYS[key_id])
    events = []
    for kind, actor, run_ref, action_ref, data in pending:
        text = dumps(data)
        head, tail = audit.body_around_seq(key_id=key_id, tenant_id=tenant_id, kind=kind, actor=actor,
                                           run_ref=run_ref, action_ref=action_ref, data_text=text, created_at=now)
        events.append([kind, actor, run_ref, action_ref, text, head, tail])
    return [ikey, okey, key_id, now, Jsonb(events)]


# The chain's arguments: the key's halves, its id, the events' time and the events, as one JSON array (one JSON
# dump is much cheaper to send than seven text arrays).
CHAIN_ARGS = "%s::bytea, %s::bytea, %s::text, %s::timestamptz, %s::jsonb"


# A step outcome's guards (`plans.StepGuards`), the first arguments of unwind_outcome: the tenant and the run, the
# run as decided from, its steps when read, its cancel mark and lease, the step and its status before.
STEP_GUARD_ARGS = ("%s::bigint, %s::bigint, %s::text, %s::boolean, %s::bigint, %s::text, %s::text, %s::jsonb,"
                   " %s::jsonb, %s::jsonb, %s::boolean, %s::timestamptz, %s::bigint, %s::text")


def _step_guards(plan: plans.Outcome) -> list:
    run, guards, held = plan.run, plan.guards, plan.guards.run
    return [run.tenant_id, run.pk, held.status, held.pivot_committed, held.agent_id, held.on_behalf_of, held.goal,
            Jsonb(held.intent), Jsonb(held.plan), None if held.steps is None else Jsonb(held.steps), guards.cancelled,
            guards.lease_expires_at, plan.action.pk, guards.step_from]


def _row(obj: models.Model, *, fields=None, adding: bool = False) -> Jsonb:
    """A row as `jsonb_populate_record` reads it: each column by name, as the ORM would store it."""
    row = {}
    for f, attname, column, timestamp in _row_columns(type(obj), None if fields is None else frozenset(fields)):
        value = f.pre_save(obj, adding) if adding else getattr(obj, attname)
        if timestamp and value is not None:
            value = value.isoformat()
        row[column] = value
    return Jsonb(row)


def _ending(attempt, step: Action) -> Jsonb:
    """The end of `step`'s attempt as the calls take it (ATTEMPT_FIELDS), and `partitions_from`: the lower bound of its
    start (`attempts.started_after`), so that the update reads only the months since the step was recorded."""
    row = _row(attempt, fields=ATTEMPT_FIELDS)
    since = attempts.started_after(step)
    row.obj["partitions_from"] = None if since is None else since.isoformat()
    return row


def _checkpoint(checkpoint, run: Run) -> Jsonb:
    """A checkpoint's row to insert, and `partitions_from`: the lower bound of its run's checkpoints' creation, which
    `unwind_complete` reads (only the months since the run began)."""
    row = _row(copy.copy(checkpoint), adding=True)
    row.obj["partitions_from"] = recent(run.created_at).isoformat()
    return row


@lru_cache(maxsize=None)
def _row_columns(model: type[models.Model], fields: frozenset | None) -> tuple:
    """`_row`'s columns of `model` (those named in `fields`, else all), in the model's order, each as (field, attname,
    column, whether a timestamp): worked out once, not on every row of every call."""
    return tuple((f, f.attname, f.column, isinstance(f, models.DateTimeField)) for f in model._meta.concrete_fields
                 if fields is None or f.attname in fields)


def call_statement(function: str, arguments: str, guard: str) -> str:
    """The one statement every call of a function is: the function runs only where the guard holds
    (bench/counting.py counts a call as a commit by this shape)."""
    return f"SELECT CASE WHEN {guard} THEN public.{function}({arguments}) END"


def _call(function: str, arguments: str, params: list) -> tuple:
    """Call `public.<function>(<arguments>)` with `params`, provided the functions are exactly those ledger/plpgsql
    defines (`_trust` once per connection, then `GUARD` in the same statement, before the key reaches them): alone
    in autocommit (one round trip), or in a savepoint inside a transaction the caller already has open, so an error
    rolls back only the call.
    Returns (outcome, step, defaults_version, next_id, row, used); an altered function is never called: the outcome is then
    "altered", and this process takes the Python path from then on."""
    global _altered
    db = connections[DEFAULT_DB_ALIAS]
    value = None
    for _ in range(2):  # a second time only after the functions were installed again, and checked
        db.ensure_connection()
        guard = _trust(db)
        if guard is None:
            break
        statement = call_statement(function, arguments, guard)
        if db.in_atomic_block:
            with transaction.atomic():
                value = sql.fetch_one(statement, params)[0]
        else:
            value = sql.fetch_one(statement, params)[0]
        if value is not None:
            break
        _trusted.pop(db.connection, None)
    if value is not None:
        if function in _ANSWER_JSON:  # Django reads jsonb as text
            outcome = json.loads(value) if isinstance(value, str) else value
            return (outcome["outcome"], outcome.get("step"), outcome.get("defaults_version"), outcome.get("next_id"),
                    outcome.get("row"), outcome.get("used"))
        return value, None, None, None, None, None
    _altered = True
    log.error("the engine's PostgreSQL functions differ from those ledger/plpgsql defines: they were not called "
              "with the audit key, and this process takes the Python path from now on. Check who changed them "
              "(pg_proc), then run `manage.py migrate`, which installs them again from the files.")
    return "altered", None, None, None, None


# They answer {outcome[, step, defaults_version][, next_id][, row]}.
_ANSWER_JSON = ("unwind_propose", "unwind_compensated", "unwind_open_run", "unwind_complete")


# --- ids drawn by the previous call ------------------------------------------------------------------------------

NEXT_ID_SECONDS = 1.0


class Reserved(threading.local):
    """The id of `table`'s next row that this thread's previous call of one kind drew (the functions answer it as
    `next_id`), so that the next call of that kind needs no statement first. It is used once, and only within
    NEXT_ID_SECONDS of being drawn, so ids keep to the order of the calls within about that long (concurrent
    transactions already commit out of id order); an unused one leaves a gap in the sequence."""

    def __init__(self, table: str):
        self.table, self.id, self.at = table, None, 0.0

    def keep(self, drawn: int | None) -> None:
        self.id, self.at = drawn, time.monotonic()

    def fresh(self) -> int | None:
        """The kept id if it is recent enough, else None; either way it is not handed out again."""
        kept, self.id = self.id, None
        return kept if kept is not None and time.monotonic() - self.at <= NEXT_ID_SECONDS else None

    def take(self) -> int:
        """The kept id if recent enough, else one drawn now."""
        kept = self.fresh()
        if kept is not None:
            return kept
        return sql.fetch_one(f"SELECT nextval(pg_get_serial_sequence('{self.table}', 'id'))", [])[0]


_next_action = Reserved("ledger_action")
_next_run = Reserved("ledger_run")
_next_checkpoint = Reserved("ledger_checkpoint")


# --- opening a run -----------------------------------------------------------------------------------------------

def open_run(run: Run, *, actor: str, event: dict) -> bool:
    """Insert `run` (its id the one this thread's last opening drew, or drawn first) with its `run.opened` event in
    one call."""
    run.pk = _next_run.take()
    now = timezone.now()
    log = audit.AuditLog(run.tenant_id, head=None)
    log.record("run.opened", actor=actor, run=run, **event)
    outcome = _call("unwind_open_run", f"%s::bigint, %s::jsonb, {CHAIN_ARGS}",
                    [run.tenant_id, _row(run, adding=True), *_chain(run.tenant_id, log.pending, now)])
    if outcome[0] != "ok":
        run.pk = None
        return False
    _next_run.keep(outcome[3])
    run._state.adding = False
    run._state.db = DEFAULT_DB_ALIAS
    return True


# --- completing a run --------------------------------------------------------------------------------------------

def checkpoint_id() -> int:
    """An id for a completion's checkpoint: the one this thread's last completion drew, or one drawn now. The call
    checks that no checkpoint of the run came after it."""
    return _next_checkpoint.take()


# The run's columns a completion sets, which `unwind_complete` writes (a plan setting others goes to the Python writer).
COMPLETION_CHANGES = frozenset({"status", "updated_at", "finished_at"})


def complete(plan: plans.Completion) -> Run | str | None:
    """Write a completion Python decided (`runs.completion`) in one call, its checkpoint's id the one the plan names
    or else `checkpoint_id`'s. The call compares the plan's guards with the run under its locks (`plans.RunGuards`:
    the run's status and fingerprinted fields, its actions' ids and statuses in order) and checks that no checkpoint
    of the run came after that id; then it moves the run, inserts the checkpoint and appends the events. Returns the
    run as the call left it; plans.STALE when a guard failed (nothing written: decide again); None when the call was
    not made or did not write (the Python writer applies the plan)."""
    if set(plan.changes) != COMPLETION_CHANGES:
        return None
    if plan.checkpoint.pk is None:
        plan = plan.numbered(checkpoint_id())
    run, guards = plan.run, plan.guards
    now = timezone.now()
    outcome = _call(
        "unwind_complete", "%s::bigint, %s::bigint, %s::text, %s::boolean, %s::bigint, %s::text, %s::text, %s::jsonb,"
        f" %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, {CHAIN_ARGS}",
        [run.tenant_id, run.pk, guards.status, guards.pivot_committed, guards.agent_id, guards.on_behalf_of,
         guards.goal, Jsonb(guards.intent), Jsonb(guards.plan), Jsonb(guards.steps),
         _row(run, fields=COMPLETION_CHANGES), _checkpoint(plan.checkpoint, run),
         *_chain(run.tenant_id, plan.events, now)])
    if outcome[0] == plans.STALE:
        return plans.STALE
    if outcome[0] != "ok":
        return None
    _next_checkpoint.keep(outcome[3])
    return _from_json(Run, outcome[4])


def _from_json(model: type[models.Model], row: dict) -> models.Model:
    """A model instance from a row as `to_jsonb` writes it (JSON columns already parsed, times as ISO text)."""
    fields = model._meta.concrete_fields
    return model.from_db(DEFAULT_DB_ALIAS, [f.attname for f in fields],
                         [None if row[f.column] is None else f.to_python(row[f.column]) for f in fields])


# --- a compensation's success, and the next compensation or the settling -----------------------------------------

# The unwinding calls read every action of the run, and check them all again under the locks: past this many a run
# takes the Python path, which reads only what each decision needs.
UNWIND_READ_LIMIT = 200


@dataclass(frozen=True)
class Step:
    """An action of the run as far as the unwinding decisions read it when it is not a candidate to undo."""

    pk: int
    seq: int
    kind: str
    status: str


# The forward steps an unwinder may undo next (`unwind_plans.following` decides which): read whole.
UNDO_NEXT = (A.SUCCEEDED, A.COMPENSATING)


def run_for_unwind(run_id: int, *, checkpoints: int = 1):
    """The run, ids for the compensations to come and for `checkpoints` checkpoints, the tenant's approval threshold,
    and every action of the run in order with its tool's name and class, read in one statement without locks:
    `compensated` checks the statuses again under its locks. A forward step that is succeeded or compensating (one
    the unwinder may undo next) comes whole, with its compensation's tool version (and the tenant's slug); every
    other action as a `Step`. (None, ...) when there is no such run, or it has more than UNWIND_READ_LIMIT
    actions."""
    run_cols, run_n = sql.columns(Run, "r")
    action_cols, action_n = sql.columns(Action, "f")
    tool_cols, tool_n = sql.columns(Tool, "u")
    rows = sql.fetch_all(
        # Ids for every compensation this unwind may still claim (one per step it may undo), drawn in order. The
        # steps are counted with FILTER so that only the run picks the index: without statistics the planner also
        # scanned the status index, every succeeded action of every run (0.7 ms).
        "WITH ids AS MATERIALIZED (SELECT (SELECT pg_catalog.array_agg(nextval(pg_get_serial_sequence('ledger_action',"
        " 'id')) ORDER BY g) FROM generate_series(1, 1 + (SELECT count(*) FILTER (WHERE c.kind = 'forward'"
        " AND c.status = ANY (%s)) FROM ledger_action c WHERE c.run_id = %s)) g) AS action_id,"
        " (SELECT pg_catalog.array_agg(nextval(pg_get_serial_sequence('ledger_checkpoint', 'id')) ORDER BY g)"
        " FROM generate_series(1, %s) g) AS checkpoint_ids)"
        f" SELECT {run_cols}, ids.action_id, ids.checkpoint_ids, tenant.approval_threshold, tenant.slug,"
        f" a.id, a.seq, a.kind, a.status, t.name, t.action_class, {action_cols}, {tool_cols}"
        " FROM ledger_run r CROSS JOIN ids JOIN ledger_tenant tenant ON tenant.id = r.tenant_id"
        " LEFT JOIN ledger_action a ON a.run_id = r.id LEFT JOIN ledger_tool t ON t.id = a.tool_id"
        " LEFT JOIN ledger_action f ON f.id = a.id AND a.kind = 'forward' AND a.status = ANY (%s)"
        # The version of the compensation's tool bound when the step was proposed (`unwinding.compensation_tool`).
        " LEFT JOIN ledger_tool u ON u.tenant_id = r.tenant_id AND u.id = CASE"
        " WHEN f.compensation_plan->>'tool_id' ~ '^[0-9]{1,18}$' THEN (f.compensation_plan->>'tool_id')::bigint END"
        " WHERE r.id = %s AND r.next_seq <= %s ORDER BY a.seq", [list(UNDO_NEXT), run_id, checkpoints, list(UNDO_NEXT), run_id, UNWIND_READ_LIMIT])
    if not rows:
        return None, [], [], None, []
    first = rows[0]
    run = sql.instance(Run, first[:run_n])
    action_ids, checkpoint_ids, threshold, slug = first[run_n:run_n + 4]
    tenant = Tenant.from_db(DEFAULT_DB_ALIAS, ["id", "slug"], [run.tenant_id, slug])
    at = run_n + 4
    actions = []
    for row in rows:
        if row[at] is None:
            continue  # a run without actions
        name, action_class = row[at + 4:at + 6]
        whole = at + 6
        if row[whole] is None:
            actions.append((Step(*row[at:at + 4]), name, action_class, None))
            continue
        action = sql.instance(Action, row[whole:whole + action_n])
        action.run_fingerprint_key = run.fingerprint_key  # its digests' key (ledger/audit/subjects.py), read here
        undo_tool = None
        if row[whole + action_n] is not None:
            undo_tool = sql.instance(Tool, row[whole + action_n:whole + action_n + tool_n])
            undo_tool.tenant = tenant
        actions.append((action, name, action_class, undo_tool))
    return run, list(action_ids), list(checkpoint_ids), threshold, actions


# The run's columns a settling sets, which `unwind_compensated` writes.
SETTLED_FIELDS = ("status", "lease_expires_at", "updated_at", "finished_at")


def compensated(plan: plans.UnwindStep) -> plans.Unwound | str | None:
    """Write a step of an unwind Python decided (`unwind_plans.compensated`, `unwind_plans.claimed`) in one call,
    when the plan claims its next undo or settles the run itself (not `then_claim`), names the ids of the rows it
    inserts and emits nothing anyone handles. The call compares the plan's guards with the run under its locks
    (`plans.UnwindGuards`: the run's status and fingerprinted fields, its actions' ids and statuses, its unwind lease
    when the decision read it, the tenant's threshold when the plan claims an undo), then writes the plan: the
    compensation's success and its step compensated (the first move conditional on the status it was decided from),
    or the run's lease taken; the next undo claimed, or the run settled with its checkpoint; the events. Returns
    what it took (the leases run from when it held its locks); plans.STALE when a guard failed (nothing written:
    decide again); None when the call was not made or did not write (the Python writer applies the plan)."""
    claim, run, guards = plan.claim, plan.run, plan.guards
    if plan.then_claim or plan.emits or (claim is not None and claim.undo.pk is None) \
            or (plan.checkpoint is not None and plan.checkpoint.pk is None) \
            or not set(plan.run_changes or ()) <= set(SETTLED_FIELDS) \
            or (plan.undo is not None and not set(plan.undo_changes) <= set(SUCCESS_FIELDS)):
        return None
    held = guards.run
    now = timezone.now()
    outcome = _call(
        "unwind_compensated", "%s::bigint, %s::bigint, %s::text, %s::boolean, %s::bigint, %s::text, %s::text,"
        " %s::jsonb, %s::jsonb, %s::jsonb, %s::boolean, %s::timestamptz, %s::text, %s::timestamptz,"
        " %s::bigint, %s::text, %s::jsonb, %s::jsonb, %s::bigint, %s::text, %s::jsonb,"
        f" %s::bigint, %s::text, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, {CHAIN_ARGS}",
        [run.tenant_id, run.pk, held.status, held.pivot_committed, held.agent_id, held.on_behalf_of, held.goal,
         Jsonb(held.intent), Jsonb(held.plan), Jsonb(held.steps), guards.lease_compared, guards.lease_expires_at,
         guards.threshold,
         plan.lease,
         *((plan.undo.pk, plan.undo_from, _row(plan.undo, fields=SUCCESS_FIELDS),
            _ending(plan.attempt, plan.undo), plan.forward.pk, plan.forward_from,
            _row(plan.forward, fields=("status", "updated_at", "finished_at")))
           if plan.undo is not None else (None,) * 7),
         *((claim.forward.pk, claim.forward_from, _row(claim.forward, fields=("status", "updated_at")),
            _row(claim.undo, adding=True), _row(claim.attempt, fields=ATTEMPT_START_FIELDS))
           if claim is not None else (None,) * 5),
         _row(run, fields=SETTLED_FIELDS) if plan.run_changes else None,
         _row(copy.copy(plan.checkpoint), adding=True) if plan.checkpoint is not None else None,
         *_chain(run.tenant_id, [event for event in plan.events if not isinstance(event, plans.Emit)], now)])
    if outcome[0] == plans.STALE:
        return plans.STALE
    if outcome[0] != "ok":
        return None
    leases = {name: None if at is None else datetime.fromisoformat(at) for name, at in (outcome[4] or {}).items()}
    return plans.Unwound(step=outcome[1], defaults_version=outcome[2], undo_id=claim.undo.pk if claim else None,
                         undo_lease=leases.get("undo_lease"), run_lease=leases.get("run_lease"),
                         checkpoint_id=plan.checkpoint.pk if plan.checkpoint is not None else None)


# --- the proposal ------------------------------------------------------------------------------------------------

_TOOL_ALSO = (
    "nextval(pg_get_serial_sequence('ledger_action', 'id'))",
    "(SELECT approval_threshold FROM ledger_tenant WHERE ledger_tenant.id = ledger_tool.tenant_id)",
    # The compensation's twin as `proposal.compensation_plan_of` finds it: the version written with this one, or the
    # current version of the named tool.
    "(SELECT ARRAY[twin.id, twin.version] FROM ledger_tool twin WHERE twin.tenant_id = ledger_tool.tenant_id"
    " AND twin.name = ledger_tool.compensation->>'tool' AND CASE"
    " WHEN jsonb_typeof(ledger_tool.compensation->'twin_version') = 'number'"
    " AND ledger_tool.compensation->>'twin_version' ~ '^[0-9]+$'"
    " THEN twin.version = (ledger_tool.compensation->>'twin_version')::integer ELSE twin.is_current END)",
    "(SELECT slug FROM ledger_tenant WHERE ledger_tenant.id = ledger_tool.tenant_id)",
)


# A process keeps the tools it proposes with, so that a proposal reads nothing before its one call: a tool's
# version never changes once written (but for `is_current`), and `unwind_propose` checks, under its locks, that the
# version kept is still the current one, that the compensation's twin is still the version bound, and that the
# tenant's slug and approval threshold are unchanged (else it answers 'stale', having written nothing, and the
# proposal is decided again from a fresh read). The action's id is the one this thread's previous proposal drew
# (`Reserved`).
TOOL_KEEP_SECONDS = 60.0
_TOOLS_KEPT = 512
_kept: OrderedDict = OrderedDict()  # (tenant id, name) → (when read, the row's columns, threshold, twin, slug)
_kept_lock = threading.Lock()


def current_tool(tenant_id: int, name: str) -> tuple[Tool | None, int | None, str | None, tuple[int, int] | None]:
    """The tool's current version (with its tenant's slug, which signs its calls), an id for the action about to be
    proposed, the tenant's approval threshold and the (id, version) of the compensation's twin (None: none found),
    in one statement; kept for `kept_tool`."""
    columns, count = sql.columns(Tool, "ledger_tool")
    row = sql.fetch_one(f"SELECT {columns}, {', '.join(_TOOL_ALSO)} FROM ledger_tool"
                        " WHERE ledger_tool.tenant_id = %s AND ledger_tool.name = %s AND ledger_tool.is_current",
                        [tenant_id, name])
    if row is None:
        return None, None, None, None
    action_id, threshold, twin, slug = row[count:]
    twin = tuple(twin) if twin else None
    with _kept_lock:
        _kept[(tenant_id, name)] = (time.monotonic(), tuple(row[:count]), threshold, twin, slug)
        _kept.move_to_end((tenant_id, name))
        while len(_kept) > _TOOLS_KEPT:
            _kept.popitem(last=False)
    return _tool(row, slug), action_id, threshold, twin


def kept_tool(tenant_id: int, name: str) -> tuple[Tool, int, str | None, tuple[int, int] | None] | None:
    """What `current_tool` answers, from what this process kept and the id this thread's last proposal drew, when
    both are recent; None otherwise. The proposal's call checks them (see above)."""
    with _kept_lock:
        kept = _kept.get((tenant_id, name))
    if kept is None or time.monotonic() - kept[0] > TOOL_KEEP_SECONDS:
        return None
    reserved = _next_action.fresh()
    if reserved is None:
        return None
    _, row, threshold, twin, slug = kept
    return _tool(row, slug), reserved, threshold, twin


def forget_tool(tenant_id: int, name: str) -> None:
    with _kept_lock:
        _kept.pop((tenant_id, name), None)


def _tool(row, slug: str) -> Tool:
    """A Tool of its own for each proposal (the kept row's JSON is parsed again), with its tenant's slug."""
    tool = sql.instance(Tool, row)
    tool.tenant = Tenant.from_db(DEFAULT_DB_ALIAS, ["id", "slug"], [tool.tenant_id, slug])  # the rest loads if asked
    return tool


def _twin_checked(tool: Tool, plan: dict) -> tuple[str | None, int | None]:
    """The compensation's twin as `unwind_propose` checks it: its name and the version's id the plan binds, or (None,
    None) when there is nothing to check (no named twin, or a version the tool pins, which never changes)."""
    name = tool.compensation.get("tool")
    pinned = tool.compensation.get("twin_version")
    if not isinstance(name, str) or (type(pinned) is int and pinned >= 0):
        return None, None
    return name, plan.get("tool_id")


@dataclass(frozen=True)
class ProposeGuards:
    """What a proposal was decided under, which `unwind_propose` checks under its locks before it writes (any that
    fails: 'stale', nothing written): the run's status, its cancel mark, its next step's number and its actions
    (a digest of [id, status] in order, `runsteps.guard`); the tool's version, its twin, the tenant's slug and approval
    threshold (from the action's tool); and the key scopes besides the agent's own where the key must be free."""

    run_status: str
    cancelled: bool
    step: int
    steps: str
    threshold: str | None
    key_free_in: tuple


def propose(action: Action, *, guards: ProposeGuards, owner: str, actor: str, event: dict,
            limits: list[dict] | None = None, counted: tuple = ()) -> tuple[str, list | None]:
    """Write a proposal Python decided: record `action` (its id drawn by `current_tool`, or kept), claimed as
    `owner`, with its attempt and its `forward.proposed` event in one call, provided `guards` still hold. `limits`:
    the tool's limits as `unwind_limits_used` counts them, each with the `room` the call needs (`limits.asked`),
    counted under the call's locks over the steps whose status is in `counted`. Answers ("ok", what each limit had
    used); "stale" when a guard failed (decide again from a fresh read); "taken" when the key is (the Python path
    answers the replay); "full" when a limit had no room; "altered"/"fallback" otherwise. Only "ok" wrote anything."""
    now = timezone.now()
    # The attempt's row as `_row` would give it of Attempt(number=…, worker=…, started_at=now), without the model.
    attempt = Jsonb({"number": action.attempts, "worker": owner[:120], "started_at": now.isoformat()})
    log = audit.AuditLog(action.tenant_id, head=None)
    log.record("forward.proposed", actor=actor, action=action, **event)
    row = _row(action, adding=True)
    twin_name, twin_id = _twin_checked(action.tool, action.compensation_plan)
    outcome = _call(
        "unwind_propose", "%s::bigint, %s::bigint, %s::jsonb, %s::jsonb, %s::text, %s::bigint[], %s::text, "
        "%s::boolean, %s::integer, %s::jsonb, %s::text, %s::timestamptz, %s::text, %s::text, %s::bigint, %s::text, "
        f"%s::jsonb, %s::text[], {CHAIN_ARGS}",
        [action.tenant_id, action.run_id, row, attempt,
         action.idempotency_key, list(guards.key_free_in), guards.run_status, guards.cancelled, guards.step,
         Jsonb(guards.steps), guards.threshold, action.tool.created_at, action.tool.tenant.slug, twin_name, twin_id,
         action.tool.name, None if limits is None else Jsonb(limits), list(counted),
         *_chain(action.tenant_id, log.pending, now)])
    if outcome[0] != "ok":
        return outcome[0], None
    action.seq, action.defaults_version = outcome[1], outcome[2]
    action._state.adding = False
    action._state.db = DEFAULT_DB_ALIAS
    _next_action.keep(outcome[3])
    return "ok", outcome[5]


# --- the outcome -------------------------------------------------------------------------------------------------

# The columns of a step a plan may set (`plans.Outcome.changes`, `UnwindStep.undo_changes`), which `unwind_outcome`
# and `unwind_compensated` write: a success's result, snapshots and plan, any outcome's status, lease and error.
SUCCESS_FIELDS = ("status", "result", "after", "verification", "target_id", "compensation_plan", "lease_owner",
                  "lease_expires_at", "error_class", "error_message", "updated_at", "finished_at")
# The columns of its run an outcome's plan may set, which `unwind_outcome` writes: as an unwind starts.
OUTCOME_RUN_FIELDS = ("status", "attention_detail", "updated_at")


def outcome(plan: plans.Outcome) -> Run | str | None:
    """Write a forward step's outcome Python decided (`outcome_plans.success`, `failure`) in one call, when the plan
    moves no other step, emits nothing, sets no other columns than the call writes and inserts at most one
    checkpoint, its id drawn. The call compares the plan's guards with the run under its locks (`plans.StepGuards`:
    the run's status, fingerprinted fields, cancel mark and unwind lease, and its actions' ids and statuses when the
    decision read them), then moves the step from the status it was decided from (a conditional update), setting
    the plan's `changes` and no other column, ends its attempt, moves the run and inserts the checkpoint when the
    plan does, and appends the events. Returns the run as the plan leaves it; plans.STALE when a guard failed
    (nothing written: decide again); None when the call was not made or did not write (the Python writer applies the
    plan). Queues nothing: its callers do, after it (a failure's unwinds the run itself, or queues the unwinder)."""
    if plan.others or plan.emits or len(plan.checkpoints) > 1 or any(c.pk is None for c in plan.checkpoints) \
            or not set(plan.changes) <= set(SUCCESS_FIELDS) or not set(plan.run_changes) <= set(OUTCOME_RUN_FIELDS):
        return None
    run = plan.run
    now = timezone.now()
    answer = _call(
        "unwind_outcome", f"{STEP_GUARD_ARGS}, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, {CHAIN_ARGS}",
        [*_step_guards(plan), _row(plan.action, fields=plan.changes), _ending(plan.attempt, plan.action),
         _row(run, fields=plan.run_changes) if plan.run_changes else None,
         _row(copy.copy(plan.checkpoints[0]), adding=True) if plan.checkpoints else None,
         *_chain(run.tenant_id, plan.events, now)])
    if answer[0] == plans.STALE:
        return plans.STALE
    if answer[0] != "ok":
        return None
    return run


def succeed(plan: plans.Outcome) -> Run | str | None:
    """Write a forward step's success Python decided (`outcome_plans.success`) in one call (`outcome`), when the plan
    writes the step alone (the run and its other steps stay as they are, and nothing is emitted). Returns what
    `outcome` answers, having queued an unwinder when the plan says so."""
    if plan.run_changes or plan.checkpoints:
        return None
    written = outcome(plan)
    if written is not None and written != plans.STALE and plan.unwind_after:
        enqueue("ledger.tasks.unwind_run", plan.run.pk)
    return written


# An attempt's row as `unwind_compensated` inserts it (an undo's first attempt, opened as the Python path opens it).
ATTEMPT_START_FIELDS = ("number", "worker", "started_at", "finished_at", "outcome", "error_class", "error_message",
                        "latency_ms", "resend_by")

# An attempt's row as the calls that end it take it: which attempt, and the columns its end sets.
ATTEMPT_FIELDS = ("number", *plans.ATTEMPT_END)
