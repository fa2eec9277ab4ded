CREATE OR REPLACE FUNCTION unwind_failed(
    p_tenant bigint, p_run bigint, p_run_status text, p_steps jsonb, p_action bigint, p_from text, p_changes jsonb,
    p_attempt jsonb,
    p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
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
    -- The run in the status the caller decided under, before its pivot, with no unwind lease.
    IF NOT FOUND OR v_status IS DISTINCT FROM p_run_status OR v_pivot OR v_leased THEN
        RETURN 'fallback';
    END IF;
    SELECT (SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb)
                FROM ledger_action a WHERE a.run_id = p_run) INTO v_steps;
    IF v_steps <> p_steps THEN RETURN 'fallback'; END IF;
    WITH failed AS (
        UPDATE ledger_action a
           SET status = n.status, lease_owner = n.lease_owner, lease_expires_at = n.lease_expires_at,
               error_class = n.error_class, error_message = n.error_message, updated_at = n.updated_at,
               finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
         WHERE a.id = p_action AND a.run_id = p_run AND a.status = p_from RETURNING a.id),
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
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint))
    SELECT count(*) INTO v_moved FROM failed;
    IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_action; END IF;
    PERFORM unwind_chain_append(p_tenant, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
