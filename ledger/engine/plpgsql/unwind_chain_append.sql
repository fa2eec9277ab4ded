CREATE OR REPLACE FUNCTION unwind_chain_append(
    p_tenant bigint, p_head tid, p_seq bigint, p_prev text, p_ikey bytea, p_okey bytea, p_key_id text,
    p_at timestamptz, p_events jsonb
) RETURNS void LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The one place the engine's functions append to the tenant's audit chain: the events (each [kind, actor, run,
-- action, data, the body before its number, after it], as fastpath._chain builds them) after the head its caller
-- locked and read (p_seq, p_prev), hashed by unwind_chain_hashes, and the head moved to the last of them.
-- The head is moved where its caller locked it (p_head, its ctid: a lock leaves the row where it is), not looked up
-- again by the tenant: each move leaves a version behind, and while any transaction of the server holds back the
-- horizon none is pruned, so the index look-up walks every version since (0.6 ms at 4,000, measured), once for
-- the lock and once more here.
DECLARE
    v_hashes text[] := unwind_chain_hashes(p_prev, p_seq, p_ikey, p_okey, p_events);
    v_moved integer;
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
     WHERE ctid = p_head AND tenant_id = p_tenant AND seq = p_seq;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN
        RAISE EXCEPTION 'unwind: the audit head of tenant % is not where its caller locked it', p_tenant;
    END IF;
END $$;
