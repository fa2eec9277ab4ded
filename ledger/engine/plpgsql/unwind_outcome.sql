CREATE OR REPLACE FUNCTION unwind_outcome(
    p_tenant bigint, p_run bigint, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text,
    p_intent jsonb, p_plan jsonb, p_steps jsonb, p_cancelled boolean, p_lease timestamptz,
    p_action bigint, p_from text, p_changes jsonb, p_attempt jsonb, p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The writer of a step's outcome Python decided, its success or its failure for good (ledger/engine/
-- outcome_plans.py `success`, `failure`, plans.Outcome): it knows no rule. It locks the chain head, then the run, and
-- checks the guards the decision was made under; any that fails answers 'stale', having written nothing, and the
-- caller decides again from a fresh read. Then it writes the plan's rows as given: the step moved from the status it
-- was decided from (the columns the plan sets, each a key of p_changes; the others as they are), its attempt ended
-- (found among the months since the step was recorded: `partitions_from`),
-- the run's new columns and its checkpoint (when the plan has them: an unwind started), the events.
DECLARE
    v_head tid;
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_moved integer;
BEGIN
    -- The run as the caller decided from it: its status and the fields its events fingerprint, its cancel mark and
    -- its unwind lease.
    SELECT h.ctid, h.seq, h.hash,
           unwind_run_held(r, p_run_status, p_pivot, p_agent, p_on_behalf_of, p_goal, p_intent, p_plan)
           AND (r.cancel_requested_at IS NOT NULL) = p_cancelled AND r.lease_expires_at IS NOT DISTINCT FROM p_lease
      INTO v_head, v_seq, v_prev, v_same
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN 'fallback';
    END IF;
    IF NOT v_same THEN
        RETURN 'stale';
    END IF;
    -- Its actions as the caller decided from them ([id, status] in order), when it read them.
    IF p_steps IS NOT NULL AND p_steps <> unwind_run_steps(p_run) THEN
        RETURN 'stale';
    END IF;
    -- Each column the plan sets, the others as they are: a success and a failure set different ones.
    UPDATE ledger_action a
       SET status = CASE WHEN p_changes ? 'status' THEN n.status ELSE a.status END,
           result = CASE WHEN p_changes ? 'result' THEN n.result ELSE a.result END,
           after = CASE WHEN p_changes ? 'after' THEN n.after ELSE a.after END,
           verification = CASE WHEN p_changes ? 'verification' THEN n.verification ELSE a.verification END,
           target_id = CASE WHEN p_changes ? 'target_id' THEN n.target_id ELSE a.target_id END,
           compensation_plan = CASE WHEN p_changes ? 'compensation_plan' THEN n.compensation_plan
                                    ELSE a.compensation_plan END,
           lease_owner = CASE WHEN p_changes ? 'lease_owner' THEN n.lease_owner ELSE a.lease_owner END,
           lease_expires_at = CASE WHEN p_changes ? 'lease_expires_at' THEN n.lease_expires_at
                                   ELSE a.lease_expires_at END,
           error_class = CASE WHEN p_changes ? 'error_class' THEN n.error_class ELSE a.error_class END,
           error_message = CASE WHEN p_changes ? 'error_message' THEN n.error_message ELSE a.error_message END,
           updated_at = CASE WHEN p_changes ? 'updated_at' THEN n.updated_at ELSE a.updated_at END,
           finished_at = CASE WHEN p_changes ? 'finished_at' THEN n.finished_at ELSE a.finished_at END
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = p_from;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RETURN 'stale'; END IF;  -- moved since the decision: nothing was written
    UPDATE ledger_attempt t
       SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = f.error_class,
           error_message = f.error_message
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
     WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL
       AND t.started_at >= coalesce((p_attempt->>'partitions_from')::timestamptz, '-infinity');
    IF p_run_changes IS NOT NULL THEN
        UPDATE ledger_run r
           SET status = CASE WHEN p_run_changes ? 'status' THEN n.status ELSE r.status END,
               attention_detail = CASE WHEN p_run_changes ? 'attention_detail' THEN n.attention_detail
                                       ELSE r.attention_detail END,
               updated_at = CASE WHEN p_run_changes ? 'updated_at' THEN n.updated_at ELSE r.updated_at END
          FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run;
    END IF;
    IF p_checkpoint IS NOT NULL THEN
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint);
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_head, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
