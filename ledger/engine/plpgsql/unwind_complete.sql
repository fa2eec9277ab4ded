CREATE OR REPLACE FUNCTION unwind_complete(
    p_tenant bigint, p_run bigint, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text,
    p_intent jsonb, p_plan jsonb, p_steps jsonb, p_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The writer of a completion Python decided (ledger/engine/runs.py `completion`, plans.py): it knows no rule. It
-- locks the chain head, then the run, and checks the guards the decision was made under; any that fails answers
-- 'stale', having written nothing, and the caller decides again from a fresh read. Then it writes the plan's rows
-- as given: the run's new columns, the checkpoint whole (its state decided in Python), the events.
DECLARE
    v_head tid;
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_steps jsonb;
    v_newer boolean;
    v_run ledger_run;
BEGIN
    -- The run as the caller decided from it: its status, and the fields its events fingerprint.
    SELECT h.ctid, h.seq, h.hash,
           unwind_run_held(r, p_run_status, p_pivot, p_agent, p_on_behalf_of, p_goal, p_intent, p_plan)
      INTO v_head, v_seq, v_prev, v_same
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- Its actions as the caller decided from them ([id, status] in order: whether one is in flight, and the
    -- checkpoint's lists and summary); and no checkpoint of the run after the one's id, drawn before the locks (the
    -- run's checkpoints are read in id order), among the months since the run began (`partitions_from`).
    SELECT unwind_run_steps(p_run),
           EXISTS (SELECT 1 FROM ledger_checkpoint c WHERE c.run_id = p_run AND c.id > (p_checkpoint->>'id')::bigint
                     AND c.created_at >= coalesce((p_checkpoint->>'partitions_from')::timestamptz, '-infinity'))
      INTO v_steps, v_newer;
    IF NOT v_same OR v_steps <> p_steps OR v_newer THEN
        RETURN jsonb_build_object('outcome', 'stale');
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_head, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    WITH checkpointed AS (
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint))
    UPDATE ledger_run r SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_run, p_changes) n WHERE r.id = p_run
    RETURNING r.* INTO v_run;
    -- The id of this caller's next completion's checkpoint, drawn now: it spares that completion a read.
    RETURN jsonb_build_object('outcome', 'ok', 'row', to_jsonb(v_run),
                              'next_id', nextval(pg_get_serial_sequence('ledger_checkpoint', 'id')));
END $$;
