CREATE OR REPLACE FUNCTION unwind_succeed(
    p_tenant bigint, p_run bigint, p_run_status text, p_action bigint, p_from text, p_changes jsonb, p_pivot boolean,
    p_attempt jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_status text;
    v_open boolean;
    v_pivot boolean;
    v_moved integer;
BEGIN
    SELECT h.seq, h.hash, r.status, r.cancel_requested_at IS NULL, r.pivot_committed
      INTO v_seq, v_prev, v_status, v_open, v_pivot
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    -- The run in the status the caller decided under (p_run_status), not cancelled, its pivot's commit recorded if
    -- this is the pivot; the step in the status it moves from (p_from).
    IF NOT FOUND OR v_status IS DISTINCT FROM p_run_status OR NOT v_open OR (p_pivot AND NOT v_pivot) THEN
        RETURN 'fallback';
    END IF;
    UPDATE ledger_action a
       SET status = n.status, result = n.result, after = n.after, verification = n.verification,
           target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
           lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
           updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = p_from;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RETURN 'fallback'; END IF;  -- moved by someone else: the Python path says how
    UPDATE ledger_attempt t
       SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = '', error_message = ''
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
     WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL;
    PERFORM unwind_chain_append(p_tenant, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
