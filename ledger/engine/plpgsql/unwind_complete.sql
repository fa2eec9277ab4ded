CREATE OR REPLACE FUNCTION unwind_complete(
    p_tenant bigint, p_run bigint, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text, p_intent jsonb,
    p_plan jsonb, p_busy text[], p_done text[], p_unfinished text[], p_awaiting text[], p_changes jsonb,
    p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_busy boolean;
    v_newer boolean;
    v_run ledger_run;
    v_checkpoint ledger_checkpoint;
BEGIN
    v_checkpoint := jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint);
    -- Running, with the pivot and the fingerprinted fields the caller built the events from (else the Python path
    -- says which).
    SELECT h.seq, h.hash,
           r.status = p_run_status AND r.pivot_committed = p_pivot AND r.agent_id IS NOT DISTINCT FROM p_agent
           AND r.on_behalf_of = p_on_behalf_of AND r.goal = p_goal AND r.intent = p_intent AND r.plan = p_plan
      INTO v_seq, v_prev, v_same
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND OR NOT v_same THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    -- No step in flight; and the checkpoint's id was drawn before the locks: the run's checkpoints are read in id
    -- order, so none may have come after it. Its state as runstate.checkpoint_state builds it from the run's
    -- forward steps in order, onto what the caller decided of it (the run's status, pivot and recovery mode).
    SELECT EXISTS (SELECT 1 FROM ledger_action b WHERE b.run_id = p_run AND b.status = ANY (p_busy)),
           EXISTS (SELECT 1 FROM ledger_checkpoint c WHERE c.run_id = p_run AND c.id > v_checkpoint.id),
           v_checkpoint.state || jsonb_build_object(
               'completed_action_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = ANY (p_done)), '[]'::jsonb),
               'pending_action_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = ANY (p_unfinished)), '[]'::jsonb),
               'awaiting_approval_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = ANY (p_awaiting)), '[]'::jsonb),
               'summary', coalesce(string_agg((SELECT t.name FROM ledger_tool t WHERE t.id = a.tool_id) || ' '
                                              || replace(a.status, '_', ' '), ', ' ORDER BY a.seq), 'no actions yet'))
      INTO v_busy, v_newer, v_checkpoint.state
      FROM ledger_action a WHERE a.run_id = p_run AND a.kind = 'forward';
    IF v_busy THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    IF v_newer THEN RETURN jsonb_build_object('outcome', 'stale'); END IF;
    PERFORM unwind_chain_append(p_tenant, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    WITH checkpointed AS (INSERT INTO ledger_checkpoint SELECT (v_checkpoint).*)
    UPDATE ledger_run r SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_run, p_changes) n WHERE r.id = p_run
    RETURNING r.* INTO v_run;
    -- The id of this caller's next completion's checkpoint, drawn now: it spares that completion a read.
    RETURN jsonb_build_object('outcome', 'ok', 'row', to_jsonb(v_run),
                              'next_id', nextval(pg_get_serial_sequence('ledger_checkpoint', 'id')));
END $$;
