CREATE OR REPLACE FUNCTION unwind_failed(
    p_tenant bigint, p_run bigint, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text,
    p_intent jsonb, p_plan jsonb, p_steps jsonb, p_cancelled boolean, p_lease timestamptz,
    p_action bigint, p_from text, p_changes jsonb, p_attempt jsonb, p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The writer of a step's failure Python decided (ledger/engine/outcome_plans.py `failure`, plans.py): it knows
-- no rule. It locks the chain head, then the run, and checks the guards the decision was made under; any that fails
-- answers 'stale', having written nothing, and the caller decides again from a fresh read. Then it writes the plan's
-- rows as given: the step moved from the status it was decided from, its attempt ended, the run's new columns and
-- its checkpoint (when the plan has them: an unwind started), the events.
DECLARE
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_moved integer;
BEGIN
    -- The run as the caller decided from it: its status and the fields its events fingerprint, its cancel mark and
    -- its unwind lease.
    SELECT h.seq, h.hash,
           unwind_run_held(r, p_run_status, p_pivot, p_agent, p_on_behalf_of, p_goal, p_intent, p_plan)
           AND (r.cancel_requested_at IS NOT NULL) = p_cancelled AND r.lease_expires_at IS NOT DISTINCT FROM p_lease
      INTO v_seq, v_prev, v_same
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
    UPDATE ledger_action a
       SET status = n.status, lease_owner = n.lease_owner, lease_expires_at = n.lease_expires_at,
           error_class = n.error_class, error_message = n.error_message, updated_at = n.updated_at,
           finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = p_from;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RETURN 'stale'; END IF;  -- moved since the decision: nothing was written
    UPDATE ledger_attempt t
       SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = f.error_class,
           error_message = f.error_message
      FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
     WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL;
    IF p_run_changes IS NOT NULL THEN
        UPDATE ledger_run r SET status = n.status, attention_detail = n.attention_detail, updated_at = n.updated_at
          FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run;
    END IF;
    IF p_checkpoint IS NOT NULL THEN
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint);
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN 'ok';
END $$;
