CREATE OR REPLACE FUNCTION unwind_compensated(
    p_tenant bigint, p_run bigint, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text,
    p_intent jsonb, p_plan jsonb, p_steps jsonb, p_lease_compared boolean, p_lease timestamptz, p_threshold text,
    p_take_lease timestamptz,
    p_undo bigint, p_undo_from text, p_undo_changes jsonb, p_undo_attempt jsonb,
    p_forward bigint, p_forward_from text, p_forward_changes jsonb,
    p_next_forward bigint, p_next_forward_from text, p_next_forward_changes jsonb, p_next jsonb, p_next_attempt jsonb,
    p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The writer of a step of an unwind Python decided (ledger/engine/unwind_plans.py, plans.UnwindStep): it knows no
-- rule. It locks the chain head, then the run, and checks the guards the decision was made under; any that fails
-- answers 'stale', having written nothing, and the caller decides again from a fresh read. Then it writes the plan's
-- rows as given: the compensation moved from the status it was decided from, its attempt ended, its step moved; or
-- the run's unwind lease taken; then the next undo claimed (its step moved, the compensation with the run's next
-- step number and the defaults' version, its attempt) or the run's new columns and its checkpoint; the events.
DECLARE
    v_head tid;
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_threshold text;
    v_lease timestamptz;
    v_step integer;
    v_dv integer;
    v_moved integer;
    v_row ledger_action;
BEGIN
    -- The run as the caller decided from it: its status and the fields its events fingerprint, and its unwind lease
    -- when the decision read it.
    SELECT h.ctid, h.seq, h.hash,
           unwind_run_held(r, p_run_status, p_pivot, p_agent, p_on_behalf_of, p_goal, p_intent, p_plan)
           AND (NOT p_lease_compared OR r.lease_expires_at IS NOT DISTINCT FROM p_lease),
           r.next_seq
      INTO v_head, v_seq, v_prev, v_same, v_step
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- Its actions as the caller decided from them ([id, status] in order), and the tenant's approval threshold a
    -- claimed undo's approvals were decided with (when the plan claims one).
    IF NOT v_same OR p_steps <> unwind_run_steps(p_run) THEN
        RETURN jsonb_build_object('outcome', 'stale');
    END IF;
    IF p_threshold IS NOT NULL THEN
        SELECT n.approval_threshold INTO v_threshold FROM ledger_tenant n WHERE n.id = p_tenant;
        IF v_threshold IS DISTINCT FROM p_threshold THEN
            RETURN jsonb_build_object('outcome', 'stale');
        END IF;
    END IF;
    IF p_undo IS NOT NULL THEN
        UPDATE ledger_action a
           SET status = n.status, result = n.result, after = n.after, verification = n.verification,
               target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
               lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
               updated_at = n.updated_at, finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_undo_changes) n
         WHERE a.id = p_undo AND a.run_id = p_run AND a.status = p_undo_from;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RETURN jsonb_build_object('outcome', 'stale'); END IF;  -- moved since: nothing written
        UPDATE ledger_attempt t
           SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms,
               error_class = f.error_class, error_message = f.error_message
          FROM jsonb_populate_record(NULL::ledger_attempt, p_undo_attempt) f
         WHERE t.action_id = p_undo AND t.number = f.number AND t.finished_at IS NULL
           AND t.started_at >= coalesce((p_undo_attempt->>'partitions_from')::timestamptz, '-infinity');
        UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_forward_changes) n
         WHERE a.id = p_forward AND a.run_id = p_run AND a.status = p_forward_from;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_forward; END IF;
    END IF;
    -- Leases, as long as the caller made them, run from now on the database's clock: the locks are held, and no
    -- wait for them has eaten into them.
    IF p_take_lease IS NOT NULL THEN
        v_lease := clock_timestamp() + (p_take_lease - p_at);
        UPDATE ledger_run SET lease_expires_at = v_lease WHERE id = p_run;
    END IF;
    IF p_next IS NOT NULL THEN
        SELECT coalesce(max(v.version), 0) INTO v_dv FROM ledger_tenantpolicyversion v WHERE v.tenant_id = p_tenant;
        v_row := jsonb_populate_record(NULL::ledger_action, p_next);
        v_row.lease_expires_at := clock_timestamp() + (v_row.lease_expires_at - p_at);
        v_row.seq := v_step;
        v_row.defaults_version := v_dv;
        UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at
          FROM jsonb_populate_record(NULL::ledger_action, p_next_forward_changes) n
         WHERE a.id = p_next_forward AND a.run_id = p_run AND a.status = p_next_forward_from;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
        IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_next_forward; END IF;
        UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run;
        INSERT INTO ledger_action SELECT (v_row).*;
        INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                    error_message, latency_ms, resend_by)
        SELECT v_row.id, a.number, a.worker, a.started_at, a.finished_at, a.outcome, a.error_class, a.error_message,
               a.latency_ms, a.resend_by
          FROM jsonb_populate_record(NULL::ledger_attempt, p_next_attempt) a;
    ELSE
        v_step := NULL;
    END IF;
    IF p_run_changes IS NOT NULL THEN
        UPDATE ledger_run r SET status = n.status, lease_expires_at = n.lease_expires_at, updated_at = n.updated_at,
                                finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run;
    END IF;
    IF p_checkpoint IS NOT NULL THEN
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint);
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_head, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv, 'row', jsonb_build_object(
        'run_lease', v_lease, 'undo_lease', CASE WHEN p_next IS NOT NULL THEN v_row.lease_expires_at END));
END $$;
