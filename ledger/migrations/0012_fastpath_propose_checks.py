"""`unwind_propose` checks what its caller may have taken from a cache, draws the caller's next action id, and runs
its ordering check from the run's actions whatever the statistics say.

A process keeps the tools it proposes with (ledger/engine/fastpath.py), so a proposal no longer reads its tool first. The
function now checks, under its locks and before writing, that the tool's version is still the current one, that the
compensation's twin is still the version the plan binds, and that the tenant's slug and approval threshold are
unchanged; otherwise it answers 'stale' having written nothing, and the caller decides again from a fresh read.
On success it also draws an id for the caller's next proposal.

0010's ordering check joined the run's actions with their tools; on a database without statistics yet (a new one)
the planner started from the tools and scanned every action of each (0.8 ms of a proposal's 0.9 inside
PostgreSQL). The tool's class is now looked up per action of the run, which leaves one plan.

The signature changes, so 0010's function is dropped first (the definitions are checked against `FUNCTIONS` here,
all of them by name).
"""
import importlib

from django.db import migrations

EARLIER = importlib.import_module("ledger.migrations.0010_fastpath_functions")

DROP_EARLIER = """
DROP FUNCTION IF EXISTS unwind_propose(bigint, bigint, jsonb, jsonb, text, text, text[], text[], text[], text, bytea,
    bytea, text, timestamptz, jsonb);
"""
DROP = """
DROP FUNCTION IF EXISTS unwind_propose(bigint, bigint, jsonb, jsonb, text, text, text[], text[], text[], text,
    timestamptz, text, text, bigint, bytea, bytea, text, timestamptz, jsonb);
"""

PROPOSE = """
CREATE OR REPLACE FUNCTION unwind_propose(
    p_tenant bigint, p_run bigint, p_action jsonb, p_attempt jsonb, p_key text, p_content_key text,
    p_matching text[], p_roles text[], p_gone text[], p_threshold text, p_tool_written timestamptz, p_slug text,
    p_twin_name text, p_twin bigint, p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_step integer;
    v_dv integer;
    v_run record;
    v_row ledger_action;
    v_tenant record;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    SELECT r.status, r.cancel_requested_at, r.next_seq, r.tenant_id INTO v_run
        FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.cancel_requested_at IS NOT NULL
            OR v_run.status NOT IN ('running', 'awaiting_approval') THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- What the caller decided from, as it stands now: the tool's version is still the current one (the very row:
    -- its id and when it was written, should ids ever be drawn again, after a restore), the compensation's twin
    -- (unless the tool pins its version) is still the version bound, the tenant's slug (which signs the call) and
    -- approval threshold are unchanged. The caller may have taken them from what its process keeps.
    SELECT t.approval_threshold, t.slug INTO v_tenant FROM ledger_tenant t WHERE t.id = p_tenant;
    IF NOT coalesce((SELECT t.is_current AND t.created_at = p_tool_written FROM ledger_tool t
                      WHERE t.id = (p_action->>'tool_id')::bigint AND t.tenant_id = p_tenant), false)
            OR (p_twin_name IS NOT NULL AND (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant
                 AND t.name = p_twin_name AND t.is_current) IS DISTINCT FROM p_twin)
            OR v_tenant.slug IS DISTINCT FROM p_slug OR v_tenant.approval_threshold IS DISTINCT FROM p_threshold THEN
        RETURN jsonb_build_object('outcome', 'stale');
    END IF;
    IF EXISTS (SELECT 1 FROM ledger_action a WHERE a.tenant_id = p_tenant AND a.idempotency_key = p_key) THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- a replay: the caller answers it
    END IF;
    IF p_content_key <> '' AND EXISTS (
            SELECT 1 FROM ledger_action a WHERE a.run_id = p_run AND a.content_key = p_content_key
               AND a.status = ANY (p_matching)) THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- the same content is done or in flight
    END IF;
    IF coalesce(array_length(p_roles, 1), 0) > 0 AND EXISTS (
            SELECT 1 FROM ledger_action a
             WHERE a.run_id = p_run AND a.kind = 'forward' AND a.saga_role = ANY (p_roles)
               AND a.status <> ALL (p_gone) AND NOT (a.status = 'failed' AND a.error_class = 'refused')
               AND (SELECT t.action_class FROM ledger_tool t WHERE t.id = a.tool_id) <> 'read_only') THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- the ordering law refuses it
    END IF;
    SELECT coalesce(max(v.version), 0) INTO v_dv FROM ledger_tenantpolicyversion v
     WHERE v.tenant_id = p_tenant;
    UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run;
    v_step := v_run.next_seq;
    v_row := jsonb_populate_record(NULL::ledger_action, p_action);
    v_row.seq := v_step;
    v_row.defaults_version := v_dv;
    INSERT INTO ledger_action SELECT (v_row).*;
    INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                error_message, latency_ms)
    SELECT v_row.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) a;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    -- The id of this caller's next proposal, drawn now: it spares that proposal a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv,
                              'next_id', nextval(pg_get_serial_sequence('ledger_action', 'id')));
END $$;
"""

FUNCTIONS = {**EARLIER.FUNCTIONS, "unwind_propose": PROPOSE}


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_EARLIER, params=None)
        schema_editor.execute(PROPOSE, params=None)  # no placeholders: the body holds "%"


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)
        schema_editor.execute(EARLIER.PROPOSE, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0011_action_sweep_partial_indexes"),
    ]

    operations = [migrations.RunPython(create, restore)]
