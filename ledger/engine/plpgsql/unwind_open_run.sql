CREATE OR REPLACE FUNCTION unwind_open_run(
    p_tenant bigint, p_run jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_head tid;
    v_seq bigint;
    v_prev text;
BEGIN
    SELECT h.ctid, h.seq, h.hash INTO v_head, v_seq, v_prev FROM ledger_audithead h WHERE h.tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    INSERT INTO ledger_run SELECT * FROM jsonb_populate_record(NULL::ledger_run, p_run);
    PERFORM unwind_chain_append(p_tenant, v_head, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    -- The id of this caller's next run, drawn now: it spares that opening a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'next_id', nextval(pg_get_serial_sequence('ledger_run', 'id')));
END $$;
