"""The hash-chained audit log and the transaction every ledger write happens in.

Every write to a tenant's ledger runs in `ledger_transaction(tenant_id)`: it locks the tenant's
chain head first (one lock order for every writer, so writers of one tenant never deadlock), lets
the services record events, and appends them to the chain just before commit. A rolled-back change
leaves no event; a committed one always has its event.

Each event that concerns a run or an action carries a fingerprint of that row as it stood after the
change, so `verify_chain` also notices a ledger row edited or deleted behind the services' back.
"""
from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.utils import timezone

from ledger import sql
from ledger.canonical import digest, dumps
from ledger.models import Action, AuditEvent, AuditHead, Run

GENESIS = "0" * 64
_local = threading.local()


def action_fingerprint(action: Action) -> str:
    return digest(
        "action", action.pk, action.run_id, action.tool_id, action.kind, action.status,
        action.args_hash, action.idempotency_key, action.result,
    )


def run_fingerprint(run: Run) -> str:
    return digest("run", run.pk, run.tenant_id, run.status, run.pivot_committed)


def event_hash(prev_hash: str, *, tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at) -> str:
    body = dumps({
        "tenant": tenant_id, "seq": seq, "kind": kind, "actor": actor, "run": run_ref,
        "action": action_ref, "data": data, "at": created_at.isoformat(),
    })
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


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

    def record(self, kind: str, *, actor: str, run: Run | None = None, action: Action | None = None, **data) -> None:
        if action is not None:
            data["action_state"] = action_fingerprint(action)
            run_ref = action.run_id
        else:
            run_ref = run.pk if run is not None else None
        if run is not None:
            data["run_state"] = run_fingerprint(run)
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
        rows = []
        for kind, actor, run_ref, action_ref, data in self.pending:
            seq += 1
            text = dumps(data)
            data = json.loads(text)  # what is hashed is exactly what the database returns
            h = event_hash(prev, tenant_id=self.tenant_id, seq=seq, kind=kind, actor=actor, run_ref=run_ref,
                           action_ref=action_ref, data=data, created_at=now)
            rows.append((self.tenant_id, seq, kind, actor, run_ref, action_ref, text, at, prev, h))
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
           "prev_hash, hash) VALUES")
_EVENT_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
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
    with transaction.atomic():
        # Lock first: every writer of this tenant takes the same lock before any other row.
        head = sql.get_locked(AuditHead, tenant_id)
        log = AuditLog(tenant_id, head)
        stack.append(log)
        try:
            yield log
            log.flush()
        finally:
            stack.pop()


@dataclass
class ChainReport:
    ok: bool
    events: int
    problem: str = ""


def verify_chain(tenant_id: int) -> ChainReport:
    """Walk a tenant's chain: links, hashes, sequence gaps, the head, and the ledger rows' fingerprints."""
    prev = GENESIS
    expected_seq = 0
    last_action: dict[int, tuple[str, int]] = {}
    last_run: dict[int, tuple[str, int]] = {}
    count = 0
    events = AuditEvent.objects.filter(tenant_id=tenant_id).order_by("seq")
    for event in events.iterator(chunk_size=2000):
        count += 1
        expected_seq += 1
        if event.seq != expected_seq:
            return ChainReport(False, count, f"event #{expected_seq} is missing (next is #{event.seq}): deleted")
        if event.prev_hash != prev:
            return ChainReport(False, count, f"event #{event.seq} does not link to #{event.seq - 1}")
        recomputed = event_hash(prev, tenant_id=tenant_id, seq=event.seq, kind=event.kind, actor=event.actor,
                                run_ref=event.run_ref, action_ref=event.action_ref, data=event.data,
                                created_at=event.created_at)
        if recomputed != event.hash:
            return ChainReport(False, count, f"event #{event.seq} ({event.kind}) was edited: its hash does not match")
        if event.action_ref is not None and "action_state" in event.data:
            last_action[event.action_ref] = (event.data["action_state"], event.seq)
        if event.run_ref is not None and "run_state" in event.data:
            last_run[event.run_ref] = (event.data["run_state"], event.seq)
        prev = event.hash
    head = AuditHead.objects.filter(pk=tenant_id).first()
    if head is not None and (head.seq != expected_seq or head.hash != prev):
        return ChainReport(False, count, f"the chain ends at #{expected_seq} but its head says #{head.seq}: events were removed")
    actions = Action.objects.filter(tenant_id=tenant_id).only(
        "id", "run_id", "tool_id", "kind", "status", "args_hash", "idempotency_key", "result")
    seen = set()
    for action in actions.iterator(chunk_size=2000):
        seen.add(action.pk)
        recorded = last_action.get(action.pk)
        if recorded is None:
            return ChainReport(False, count, f"action {action.pk} has no audit event: written behind the services' back")
        if recorded[0] != action_fingerprint(action):
            return ChainReport(False, count, f"action {action.pk} differs from its state at event #{recorded[1]}: edited behind the services' back")
    missing = set(last_action) - seen
    if missing:
        return ChainReport(False, count, f"action {min(missing)} is in the audit chain but not in the ledger: deleted")
    runs = Run.objects.filter(tenant_id=tenant_id).only("id", "tenant_id", "status", "pivot_committed")
    run_ids = set()
    for run in runs.iterator(chunk_size=2000):
        run_ids.add(run.pk)
        recorded = last_run.get(run.pk)
        if recorded is not None and recorded[0] != run_fingerprint(run):
            return ChainReport(False, count, f"run {run.pk} differs from its state at event #{recorded[1]}: edited behind the services' back")
    gone = set(last_run) - run_ids
    if gone:
        return ChainReport(False, count, f"run {min(gone)} is in the audit chain but not in the ledger: deleted")
    return ChainReport(True, count)
