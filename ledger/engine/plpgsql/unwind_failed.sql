CREATE OR REPLACE FUNCTION unwind_failed(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_action bigint, p_changes jsonb, p_attempt jsonb,
    p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_status text;
    v_pivot boolean;
    v_leased boolean;
    v_steps jsonb;
    v_moved integer;
BEGIN
    SELECT h.seq, h.hash, r.status, r.pivot_committed, r.lease_expires_at IS NOT NULL
      INTO v_seq, v_prev, v_status, v_pivot, v_leased
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND OR v_status <> 'running' OR v_pivot OR v_leased THEN
        RETURN 'fallback';
    END IF;
    SELECT (SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb)
                FROM ledger_action a WHERE a.run_id = p_run) INTO v_steps;
    IF v_steps <> p_steps THEN RETURN 'fallback'; END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH failed AS (
        UPDATE ledger_action a
           SET status = n.status, lease_owner = n.lease_owner, lease_expires_at = n.lease_expires_at,
               error_class = n.error_class, error_message = n.error_message, updated_at = n.updated_at,
               finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
         WHERE a.id = p_action AND a.run_id = p_run AND a.status = 'running' RETURNING a.id),
    ended AS (
        UPDATE ledger_attempt t
           SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms,
               error_class = f.error_class, error_message = f.error_message
          FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
         WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL),
    unwinding AS (
        UPDATE ledger_run r SET status = n.status, attention_detail = n.attention_detail, updated_at = n.updated_at
          FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run),
    checkpointed AS (
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint)),
    chained AS (
        INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash,
                                       hash, key_id)
        SELECT p_tenant, v_seq + e.i, e.v->>0, e.v->>1, (e.v->>2)::bigint, (e.v->>3)::bigint, (e.v->>4)::jsonb, p_at,
               CASE WHEN e.i = 1 THEN v_prev ELSE v_hashes[e.i::integer - 1] END, v_hashes[e.i::integer], p_key_id
          FROM jsonb_array_elements(p_events) WITH ORDINALITY e(v, i)),
    head AS (UPDATE ledger_audithead
       SET seq = v_seq + cardinality(v_hashes), hash = coalesce(v_hashes[cardinality(v_hashes)], v_prev)
     WHERE tenant_id = p_tenant)
    SELECT count(*) INTO v_moved FROM failed;
    IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_action; END IF;
    RETURN 'ok';
END $$;
