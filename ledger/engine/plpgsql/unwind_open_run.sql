CREATE OR REPLACE FUNCTION unwind_open_run(
    p_tenant bigint, p_run jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
BEGIN
    SELECT h.seq, h.hash INTO v_seq, v_prev FROM ledger_audithead h WHERE h.tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH opened AS (INSERT INTO ledger_run SELECT * FROM jsonb_populate_record(NULL::ledger_run, p_run)),
    chained AS (
        INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash,
                                       hash, key_id)
        SELECT p_tenant, v_seq + e.i, e.v->>0, e.v->>1, (e.v->>2)::bigint, (e.v->>3)::bigint, (e.v->>4)::jsonb, p_at,
               CASE WHEN e.i = 1 THEN v_prev ELSE v_hashes[e.i::integer - 1] END, v_hashes[e.i::integer], p_key_id
          FROM jsonb_array_elements(p_events) WITH ORDINALITY e(v, i))
    UPDATE ledger_audithead
       SET seq = v_seq + cardinality(v_hashes), hash = coalesce(v_hashes[cardinality(v_hashes)], v_prev)
     WHERE tenant_id = p_tenant;
    -- The id of this caller's next run, drawn now: it spares that opening a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'next_id', nextval(pg_get_serial_sequence('ledger_run', 'id')));
END $$;
