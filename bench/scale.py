"""Part 4: the console at 1k, 100k and 1M actions in the database.

The rows are a benchmark fixture, not the services' work: they are generated inside PostgreSQL
(INSERT … SELECT over generate_series, ids from reserved sequence ranges) in a tenant of their own,
`bench-bulk`. Their audit events carry no real hashes, so that tenant's audit chain does not verify;
every other tenant's does. Shape: 10 actions per run (each with an attempt and an audit event), a
checkpoint per run; 3 % of runs need attention (with an open recovery item), 5 % were compensated
(5 steps, 5 compensations), 2 % are running, the rest completed.

Pages are requested in process through Django's test client, as an operator of the bulk tenant,
with a session: p95 of the whole request (middleware, session, queries, template) and the queries
each request makes.
"""
from __future__ import annotations

import time

from psycopg import sql
from psycopg.types.json import Jsonb

from bench.common import log, summary

TENANT = "bench-bulk"
ACTIONS_PER_RUN = 10
SPREAD = "30 days"  # the bulk runs' created_at span


def _literal(field):
    """The SQL literal of a field's default, for the columns the generator leaves out."""
    from django.db.models import JSONField

    if field.null and not field.has_default():
        return sql.SQL("NULL")
    value = field.get_default()
    if isinstance(field, JSONField):
        return sql.Literal(Jsonb(value))
    return sql.Literal(value)


def insert_series(cursor, model, *, first: int, count: int, values: dict[str, str]) -> None:
    """INSERT count rows of `model`, one per g in [first, first + count), column expressions in terms of g."""
    columns, exprs = [], []
    for field in model._meta.concrete_fields:
        columns.append(sql.Identifier(field.column))
        # `%` (modulo) is doubled: the statement also carries %s parameters.
        exprs.append(sql.SQL(values[field.column].replace("%", "%%")) if field.column in values else _literal(field))
    missing = set(values) - {f.column for f in model._meta.concrete_fields}
    assert not missing, missing
    cursor.execute(sql.SQL("INSERT INTO {} ({}) SELECT {} FROM generate_series(%s::bigint, %s::bigint) AS g").format(
        sql.Identifier(model._meta.db_table), sql.SQL(", ").join(columns), sql.SQL(", ").join(exprs)),
        (first, first + count - 1))


def reserve(cursor, model, count: int) -> int:
    """Reserve `count` ids of the model's sequence; returns the first."""
    table = model._meta.db_table
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", (table,))
    sequence = cursor.fetchone()[0]
    cursor.execute("SELECT nextval(%s)", (sequence,))
    first = cursor.fetchone()[0]
    cursor.execute("SELECT setval(%s, %s)", (sequence, first + count - 1))
    return first


class Bulk:
    """The bulk tenant and its fixture rows, loaded in steps up to a target number of actions."""

    def __init__(self):
        from django.contrib.auth import get_user_model

        from ledger.models import Tenant
        from ledger.tenancy import agent_create, membership_set, tenant_create
        from ledger.policy.versions import tool_upsert

        self.tenant = Tenant.objects.filter(slug=TENANT).first() or tenant_create(slug=TENANT, name="Bulk fixture")
        tool_upsert(tenant=self.tenant, name="bulk.undo", actor="bench", spec={
            "executor": {"kind": "python", "path": "bench.noop.undo_step"}, "args_schema": {"type": "object"}})
        for n in range(ACTIONS_PER_RUN):
            tool_upsert(tenant=self.tenant, name=f"bulk.step{n}", actor="bench", spec={
                "executor": {"kind": "python", "path": "bench.noop.step"}, "args_schema": {"type": "object"},
                "target": {"type": "record", "from": "args.n"},
                "compensation": {"strategy": "twin", "tool": "bulk.undo", "args": {"id": "$result.id"}}})
        from ledger.models import Agent, Tool

        self.tools = list(Tool.objects.filter(tenant=self.tenant, name__startswith="bulk.step", is_current=True).order_by("name")
                          .values_list("pk", flat=True))
        self.agent = Agent.objects.filter(tenant=self.tenant, name="bulk").first() or \
            agent_create(tenant=self.tenant, name="bulk")[0]
        User = get_user_model()
        self.user = User.objects.filter(username="bench-operator").first() or \
            User.objects.create_user("bench-operator", "operator@bench.invalid", None)
        membership_set(tenant=self.tenant, user=self.user, role="operator")
        from ledger.models import Action

        self.actions = Action.objects.filter(tenant=self.tenant).count()

    def load_to(self, total_actions: int) -> float:
        """Add runs until the bulk tenant holds `total_actions` actions. Returns the seconds it took."""
        from django.db import connection

        from ledger.models import Action, Attempt, AuditEvent, Checkpoint, Run

        runs = (total_actions - self.actions) // ACTIONS_PER_RUN
        if runs <= 0:
            return 0.0
        started = time.perf_counter()
        t, agent = self.tenant.pk, self.agent.pk
        tools = f"(ARRAY[{','.join(str(pk) for pk in self.tools)}])"
        with connection.cursor() as django_cursor:
            cursor = django_cursor.cursor  # the psycopg cursor, for psycopg.sql compositions
            r0 = reserve(cursor, Run, runs)
            a0 = reserve(cursor, Action, runs * ACTIONS_PER_RUN)
            at0 = reserve(cursor, Attempt, runs * ACTIONS_PER_RUN)
            e0 = reserve(cursor, AuditEvent, runs * ACTIONS_PER_RUN)
            c0 = reserve(cursor, Checkpoint, runs)
            cursor.execute("SELECT coalesce(max(seq), 0) + 1000000000 FROM ledger_auditevent WHERE tenant_id = %s", (t,))
            seq0 = cursor.fetchone()[0]
            # Run index i = g - r0; its kind by i % 100: 0-2 needs attention, 3-7 compensated, 8-9 running.
            status = (f"(CASE WHEN (g - {r0}) % 100 < 3 THEN 'needs_attention' WHEN (g - {r0}) % 100 < 8 "
                      f"THEN 'compensated' WHEN (g - {r0}) % 100 < 10 THEN 'running' ELSE 'completed' END)")
            created = f"(now() - interval '{SPREAD}' * (1 - (g - {r0})::float / {runs}) - interval '1 minute')"
            insert_series(cursor, Run, first=r0, count=runs, values={
                "id": "g", "tenant_id": str(t), "agent_id": str(agent), "on_behalf_of": "'user' || g || '@bulk.invalid'",
                "goal": "'Bulk run ' || g || ': onboard a new hire'", "intent": "'{}'::jsonb", "plan": "'[]'::jsonb",
                "status": status, "pivot_committed": "false",
                "attention_reason": f"(CASE WHEN (g - {r0}) % 100 < 3 THEN 'step_failed' ELSE '' END)",
                "attention_detail": f"(CASE WHEN (g - {r0}) % 100 < 3 THEN 'bulk.step9 (step 10) failed: 503' ELSE '' END)",
                "next_seq": str(ACTIONS_PER_RUN + 1), "created_at": created, "updated_at": created,
                "finished_at": f"(CASE WHEN (g - {r0}) % 100 >= 3 AND (g - {r0}) % 100 < 8 OR (g - {r0}) % 100 >= 10 "
                               f"THEN {created} + interval '1 second' END)",
            })
            # Action a = g - a0: run r0 + a / 10, seq a % 10 + 1; in compensated runs seq 6-10 compensate 5-1.
            run = f"({r0} + (g - {a0}) / {ACTIONS_PER_RUN})"
            seq = f"((g - {a0}) % {ACTIONS_PER_RUN} + 1)"
            kind = f"(({run} - {r0}) % 100)"
            comp = f"({kind} BETWEEN 3 AND 7 AND {seq} > 5)"
            a_status = (f"(CASE WHEN {comp} THEN 'succeeded' WHEN {kind} BETWEEN 3 AND 7 THEN 'compensated' "
                        f"WHEN {seq} = {ACTIONS_PER_RUN} AND {kind} < 3 THEN 'failed' "
                        f"WHEN {seq} = {ACTIONS_PER_RUN} AND {kind} BETWEEN 8 AND 9 THEN 'running' ELSE 'succeeded' END)")
            a_created = f"(now() - interval '{SPREAD}' * (1 - ({run} - {r0})::float / {runs}) - interval '1 minute' + {seq} * interval '10 ms')"
            insert_series(cursor, Action, first=a0, count=runs * ACTIONS_PER_RUN, values={
                "id": "g", "tenant_id": str(t), "run_id": run, "seq": seq,
                "kind": f"(CASE WHEN {comp} THEN 'compensation' ELSE 'forward' END)",
                "compensates_id": f"(CASE WHEN {comp} THEN g - 2 * ({seq} - 6) - 1 END)",
                "tool_id": f"{tools}[{seq}]", "saga_role": "'compensatable'", "risk": "'low'",
                "args": "jsonb_build_object('n', g)", "args_hash": "md5(g::text) || md5(g::text)",
                "target_type": "'record'", "target_id": "g::text", "idempotency_key": "'bulk-' || g",
                "key_source": "'derived'", "status": a_status, "attempts": "1",
                "lease_expires_at": f"(CASE WHEN {a_status} = 'running' THEN timestamptz '2100-01-01' END)",
                "result": f"(CASE WHEN {a_status} <> 'failed' THEN jsonb_build_object('id', 's-' || g) END)",
                "error_class": f"(CASE WHEN {a_status} = 'failed' THEN 'http_503' ELSE '' END)",
                "error_message": f"(CASE WHEN {a_status} = 'failed' THEN 'answered 503' ELSE '' END)",
                "intent": "jsonb_build_object('goal', 'bulk step', 'confidence', 0.9)",
                "compensation_plan": "jsonb_build_object('strategy', 'twin', 'tool', 'bulk.undo')",
                "created_at": a_created, "updated_at": a_created,
                "finished_at": f"(CASE WHEN {a_status} <> 'running' THEN {a_created} + interval '5 ms' END)",
            })
            action = f"({a0} + g - {at0})"
            insert_series(cursor, Attempt, first=at0, count=runs * ACTIONS_PER_RUN, values={
                "id": "g", "action_id": action, "number": "1", "worker": "'bulk:1'",
                "started_at": "now() - interval '1 hour'", "finished_at": "now() - interval '1 hour'",
                "outcome": "'succeeded'", "latency_ms": "1.0",
            })
            e_action = f"({a0} + g - {e0})"
            insert_series(cursor, AuditEvent, first=e0, count=runs * ACTIONS_PER_RUN, values={
                "id": "g", "tenant_id": str(t), "seq": f"({seq0} + g - {e0})", "kind": "'forward.succeeded'",
                "actor": "'system:engine'", "run_ref": f"({r0} + ({e_action} - {a0}) / {ACTIONS_PER_RUN})",
                "action_ref": e_action, "data": "jsonb_build_object('status_from', 'running')",
                "created_at": "now() - interval '1 hour'", "prev_hash": "decode(md5(g::text) || md5(g::text), 'hex')",
                "hash": "decode(md5((g + 1)::text) || md5((g + 1)::text), 'hex')",
            })
            insert_series(cursor, Checkpoint, first=c0, count=runs, values={
                "id": "g", "tenant_id": str(t), "run_id": f"({r0} + g - {c0})", "label": "'completed'",
                "state": "jsonb_build_object('summary', 'bulk', 'recovery_mode', 'resume')",
                "created_at": "now() - interval '1 hour'",
            })
            cursor.execute(
                "INSERT INTO recovery_recoveryitem (tenant_id, run_id, action_id, reason, risk, tool_name, detail, "
                "suggestion, status, resolution, resolved_by, resolution_note, created_at) "
                "SELECT r.tenant_id, r.id, a.id, 'step_failed', 'medium', 'bulk.step9', r.attention_detail, "
                "'Retry step 10 or compensate steps 9 to 1.', 'open', '', '', '', r.created_at "
                "FROM ledger_run r JOIN ledger_action a ON a.run_id = r.id AND a.seq = %s "
                "WHERE r.id BETWEEN %s AND %s AND r.status = 'needs_attention'",
                (ACTIONS_PER_RUN, r0, r0 + runs - 1))
            for table in ("ledger_run", "ledger_action", "ledger_attempt", "ledger_auditevent", "ledger_checkpoint",
                          "recovery_recoveryitem"):
                cursor.execute(f"ANALYZE {table}")
        self.actions += runs * ACTIONS_PER_RUN
        self.sample_run = r0 + (runs // 2) // 100 * 100  # a run that needs attention, in the middle of this batch
        return time.perf_counter() - started


PAGES = {
    "recovery queue": "/console/recovery/",
    "run list": "/console/runs/",
    "run timeline": "/console/runs/{run}/",
}


def measure_pages(bulk: Bulk, requests: int) -> dict:
    from bench.common import page_times

    return page_times(bulk.user, {name: url.format(run=bulk.sample_run) for name, url in PAGES.items()}, requests)


def measure(sizes: list[int], requests: int, engine_sagas: int) -> dict:
    from bench.engine import Saga, tenant_with_tools

    bulk = Bulk()
    tenant, agent, _ = tenant_with_tools()
    saga = Saga(tenant, agent)
    base = int(time.time() * 1000) % 10**9 * 1000 + 700_000
    rows = []
    for size in sizes:
        seconds = bulk.load_to(size)
        log(f"scale: {bulk.actions} bulk actions ({seconds:.1f} s to load)")
        from ledger.models import Action

        total = Action.objects.count()
        pages = measure_pages(bulk, requests)
        times = []
        for i in range(engine_sagas):
            started = time.perf_counter()
            saga.onboard(base + size + i, False)
            times.append(time.perf_counter() - started)
        rows.append({"bulk_actions": bulk.actions, "actions_in_db": total, "load_s": round(seconds, 1),
                     "pages": pages, "engine_saga_ok": summary(times)})
        log(f"scale: {rows[-1]['pages']}")
    return {"tenant": TENANT, "rows": rows}
