"""PostgreSQL functions for the engine's transactions, each in one round trip (ledger/engine/fastpath.py).

Each function locks the tenant's chain head first and the run second (the lock order of every ledger writer),
reads what it checks after it holds the locks (a PL/pgSQL statement sees everything committed before it), and
answers 'fallback' before writing anything whenever the step is not the plain case it handles: the caller then
takes the Python path, which decides it under the same locks. The events' HMAC chain is computed here exactly as
`ledger.audit.chain.event_hash` does, from the head the function locked, with the key's padded halves passed by the
caller for that call only (HMAC-SHA256 = sha256(okey || sha256(ikey || message))): the key is never stored.

SQLite has no such functions: it keeps the Python path, which PostgreSQL also takes for everything else.
"""
from django.db import migrations

APPEND = """
CREATE OR REPLACE FUNCTION unwind_chain_append(
    p_tenant bigint, p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hash text;
    v_event jsonb;
BEGIN
    -- The caller holds the head's lock.
    SELECT seq, hash INTO STRICT v_seq, v_prev FROM ledger_audithead WHERE tenant_id = p_tenant;
    -- Each event: [kind, actor, run, action, data (its canonical text), the body before its number, after it].
    FOR v_event IN SELECT e.value FROM jsonb_array_elements(p_events) e LOOP
        v_seq := v_seq + 1;
        v_hash := encode(sha256(p_okey || sha256(p_ikey || convert_to(
            v_prev || (v_event->>5) || v_seq::text || (v_event->>6), 'UTF8'))), 'hex');
        INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash,
                                       hash, key_id)
        VALUES (p_tenant, v_seq, v_event->>0, v_event->>1, (v_event->>2)::bigint, (v_event->>3)::bigint,
                (v_event->>4)::jsonb, p_at, v_prev, v_hash, p_key_id);
        v_prev := v_hash;
    END LOOP;
    UPDATE ledger_audithead SET seq = v_seq, hash = v_prev WHERE tenant_id = p_tenant;
    RETURN v_seq;
END $$;
"""

PROPOSE = """
CREATE OR REPLACE FUNCTION unwind_propose(
    p_tenant bigint, p_run bigint, p_action jsonb, p_attempt jsonb, p_key text, p_content_key text,
    p_matching text[], p_roles text[], p_gone text[], p_threshold text,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_step integer;
    v_dv integer;
    v_run record;
    v_row ledger_action;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    SELECT r.status, r.cancel_requested_at, r.next_seq, r.tenant_id INTO v_run
        FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.cancel_requested_at IS NOT NULL
            OR v_run.status NOT IN ('running', 'awaiting_approval') THEN
        RETURN jsonb_build_object('outcome', 'fallback');
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
            SELECT 1 FROM ledger_action a JOIN ledger_tool t ON t.id = a.tool_id
             WHERE a.run_id = p_run AND a.kind = 'forward' AND a.saga_role = ANY (p_roles)
               AND a.status <> ALL (p_gone) AND t.action_class <> 'read_only'
               AND NOT (a.status = 'failed' AND a.error_class = 'refused')) THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- the ordering law refuses it
    END IF;
    IF (SELECT t.approval_threshold FROM ledger_tenant t WHERE t.id = p_tenant) IS DISTINCT FROM p_threshold THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- the threshold the approval decision used has changed
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
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv);
END $$;
"""

SUCCEED = """
CREATE OR REPLACE FUNCTION unwind_succeed(
    p_tenant bigint, p_run bigint, p_action bigint, p_changes jsonb, p_pivot boolean, p_attempt jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_run record;
    v_moved integer;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN 'fallback'; END IF;
    SELECT r.status, r.cancel_requested_at, r.pivot_committed, r.tenant_id INTO v_run
        FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.status <> 'running'
            OR v_run.cancel_requested_at IS NOT NULL OR (p_pivot AND NOT v_run.pivot_committed) THEN
        RETURN 'fallback';
    END IF;
    UPDATE ledger_action a
       SET status = n.status, result = n.result, after = n.after, verification = n.verification,
           target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
           lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
           updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = 'running';
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RETURN 'fallback'; END IF;  -- moved by someone else: the Python path says how
    UPDATE ledger_attempt t
       SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = '',
           error_message = ''
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
     WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
"""

OPEN_RUN = """
CREATE OR REPLACE FUNCTION unwind_open_run(
    p_tenant bigint, p_run jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN 'fallback'; END IF;
    INSERT INTO ledger_run SELECT (jsonb_populate_record(NULL::ledger_run, p_run)).*;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
"""

COMPLETE = """
CREATE OR REPLACE FUNCTION unwind_complete(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_pivot boolean, p_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_run record;
    v_steps jsonb;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN 'fallback'; END IF;
    SELECT r.status, r.pivot_committed, r.tenant_id INTO v_run FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.status <> 'running' OR v_run.pivot_committed <> p_pivot THEN
        RETURN 'fallback';
    END IF;
    -- Every action of the run as the caller read it before the locks (what its checks and checkpoint are built on).
    SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb) INTO v_steps
      FROM ledger_action a WHERE a.run_id = p_run;
    IF v_steps <> p_steps THEN RETURN 'fallback'; END IF;
    UPDATE ledger_run r SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_run, p_changes) n WHERE r.id = p_run;
    INSERT INTO ledger_checkpoint SELECT (jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint)).*;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
"""

COMPENSATED = """
CREATE OR REPLACE FUNCTION unwind_compensated(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_lease timestamptz, p_undo bigint, p_undo_changes jsonb,
    p_undo_attempt jsonb,
    p_forward bigint, p_forward_changes jsonb, p_next_forward bigint, p_next_forward_changes jsonb, p_next jsonb,
    p_next_attempt jsonb, p_threshold text, p_settle jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_step integer;
    v_dv integer;
    v_run record;
    v_steps jsonb;
    v_moved integer;
    v_row ledger_action;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    SELECT r.status, r.lease_expires_at, r.next_seq, r.tenant_id INTO v_run
        FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.status <> 'unwinding' THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    IF p_lease IS NULL THEN
        -- The unwinder holds the run's lease (else the Python path queues another unwinder).
        IF v_run.lease_expires_at IS NULL OR v_run.lease_expires_at < now() THEN
            RETURN jsonb_build_object('outcome', 'fallback');
        END IF;
    ELSIF v_run.lease_expires_at IS NOT NULL AND v_run.lease_expires_at >= now() THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- another unwinder holds it
    END IF;
    -- Every action of the run as the caller read it before the locks: what it chose the next undo (or the
    -- settling) from.
    SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb) INTO v_steps
      FROM ledger_action a WHERE a.run_id = p_run;
    IF v_steps <> p_steps THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    IF p_next IS NOT NULL AND
            (SELECT t.approval_threshold FROM ledger_tenant t WHERE t.id = p_tenant) IS DISTINCT FROM p_threshold THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    IF p_lease IS NOT NULL THEN
        UPDATE ledger_run SET lease_expires_at = p_lease WHERE id = p_run;
    END IF;
    IF p_undo IS NOT NULL THEN
        UPDATE ledger_action a
           SET status = n.status, result = n.result, after = n.after, verification = n.verification,
               target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
               lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
               updated_at = n.updated_at, finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_undo_changes) n
         WHERE a.id = p_undo AND a.run_id = p_run AND a.status = 'running';
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: undo % moved under the run lock', p_undo; END IF;
        UPDATE ledger_attempt t
           SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = '',
               error_message = ''
          FROM jsonb_populate_record(NULL::ledger_attempt, p_undo_attempt) f
         WHERE t.action_id = p_undo AND t.number = f.number AND t.finished_at IS NULL;
        UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_forward_changes) n
         WHERE a.id = p_forward AND a.status = 'compensating';
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_forward; END IF;
    END IF;
    IF p_next IS NOT NULL THEN
        UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at
          FROM jsonb_populate_record(NULL::ledger_action, p_next_forward_changes) n
         WHERE a.id = p_next_forward AND a.status = 'succeeded';
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_next_forward; END IF;
        SELECT coalesce(max(v.version), 0) INTO v_dv FROM ledger_tenantpolicyversion v
         WHERE v.tenant_id = p_tenant;
        UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run;
        v_step := v_run.next_seq;
        v_row := jsonb_populate_record(NULL::ledger_action, p_next);
        v_row.seq := v_step;
        v_row.defaults_version := v_dv;
        INSERT INTO ledger_action SELECT (v_row).*;
        IF p_next_attempt IS NOT NULL THEN
            INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                        error_message, latency_ms)
            SELECT v_row.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
              FROM jsonb_populate_record(NULL::ledger_attempt, p_next_attempt) a;
        END IF;
    END IF;
    IF p_settle IS NOT NULL THEN
        UPDATE ledger_run r SET status = n.status, lease_expires_at = NULL, updated_at = n.updated_at,
                                finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_run, p_settle) n WHERE r.id = p_run;
        INSERT INTO ledger_checkpoint SELECT (jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint)).*;
    END IF;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv);
END $$;
"""

FAILED = """
CREATE OR REPLACE FUNCTION unwind_failed(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_action bigint, p_changes jsonb, p_attempt jsonb,
    p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_run record;
    v_steps jsonb;
    v_moved integer;
BEGIN
    PERFORM 1 FROM ledger_audithead WHERE tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN 'fallback'; END IF;
    SELECT r.status, r.pivot_committed, r.lease_expires_at, r.tenant_id INTO v_run
        FROM ledger_run r WHERE r.id = p_run FOR NO KEY UPDATE;
    IF NOT FOUND OR v_run.tenant_id <> p_tenant OR v_run.status <> 'running' OR v_run.pivot_committed
            OR v_run.lease_expires_at IS NOT NULL THEN
        RETURN 'fallback';
    END IF;
    SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb) INTO v_steps
      FROM ledger_action a WHERE a.run_id = p_run;
    IF v_steps <> p_steps THEN RETURN 'fallback'; END IF;
    UPDATE ledger_action a
       SET status = n.status, lease_owner = n.lease_owner, lease_expires_at = n.lease_expires_at,
           error_class = n.error_class, error_message = n.error_message, updated_at = n.updated_at,
           finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = 'running';
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_action; END IF;
    UPDATE ledger_attempt t
       SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = f.error_class,
           error_message = f.error_message
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
     WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL;
    UPDATE ledger_run r SET status = n.status, attention_detail = n.attention_detail, updated_at = n.updated_at
      FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run;
    INSERT INTO ledger_checkpoint SELECT (jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint)).*;
    PERFORM unwind_chain_append(p_tenant, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
"""

DROP = """
DROP FUNCTION IF EXISTS unwind_failed(bigint, bigint, jsonb, bigint, jsonb, jsonb, jsonb, jsonb, bytea, bytea, text,
    timestamptz, jsonb);
DROP FUNCTION IF EXISTS unwind_compensated(bigint, bigint, jsonb, timestamptz, bigint, jsonb, jsonb, bigint, jsonb,
    bigint, jsonb, jsonb, jsonb, text, jsonb, jsonb, bytea, bytea, text, timestamptz, jsonb);
DROP FUNCTION IF EXISTS unwind_complete(bigint, bigint, jsonb, boolean, jsonb, jsonb, bytea, bytea, text, timestamptz,
    jsonb);
DROP FUNCTION IF EXISTS unwind_open_run(bigint, jsonb, bytea, bytea, text, timestamptz, jsonb);
DROP FUNCTION IF EXISTS unwind_succeed(bigint, bigint, bigint, jsonb, boolean, jsonb, bytea, bytea, text, timestamptz,
    jsonb);
DROP FUNCTION IF EXISTS unwind_propose(bigint, bigint, jsonb, jsonb, text, text, text[], text[], text[], text, bytea,
    bytea, text, timestamptz, jsonb);
DROP FUNCTION IF EXISTS unwind_chain_append(bigint, bytea, bytea, text, timestamptz, jsonb);
"""


# Every function by name: ledger/engine/fastpath.py fingerprints their definitions (see `fastpath.GUARD`), so what runs with
# the audit key is exactly this text.
FUNCTIONS = {"unwind_chain_append": APPEND, "unwind_propose": PROPOSE, "unwind_succeed": SUCCEED,
             "unwind_open_run": OPEN_RUN, "unwind_complete": COMPLETE, "unwind_compensated": COMPENSATED,
             "unwind_failed": FAILED}


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in FUNCTIONS.values():
            schema_editor.execute(statement, params=None)  # no placeholders: the bodies hold "%"


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0009_h_mcpproxy_executor_mcp'),
    ]

    operations = [migrations.RunPython(create, drop)]
