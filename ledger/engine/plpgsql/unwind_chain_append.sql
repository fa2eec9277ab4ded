CREATE OR REPLACE FUNCTION unwind_chain_append(
    p_tenant bigint, p_seq bigint, p_prev text, p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz,
    p_events jsonb
) RETURNS void LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The one place the engine's functions append to the tenant's audit chain: the events (each [kind, actor, run,
-- action, data, the body before its number, after it], as fastpath._chain builds them) after the head its caller
-- locked and read (p_seq, p_prev), hashed by unwind_chain_hashes, and the head moved to the last of them.
DECLARE
    v_hashes text[] := unwind_chain_hashes(p_prev, p_seq, p_ikey, p_okey, p_events);
BEGIN
    WITH chained AS (
        INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash,
                                       hash, key_id)
        SELECT p_tenant, p_seq + e.i, e.v->>0, e.v->>1, (e.v->>2)::bigint, (e.v->>3)::bigint, (e.v->>4)::jsonb, p_at,
               decode(CASE WHEN e.i = 1 THEN p_prev ELSE v_hashes[e.i::integer - 1] END, 'hex'),
               decode(v_hashes[e.i::integer], 'hex'), p_key_id
          FROM jsonb_array_elements(p_events) WITH ORDINALITY e(v, i))
    UPDATE ledger_audithead
       SET seq = p_seq + cardinality(v_hashes), hash = coalesce(v_hashes[cardinality(v_hashes)], p_prev)
     WHERE tenant_id = p_tenant;
END $$;
