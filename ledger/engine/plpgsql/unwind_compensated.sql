CREATE OR REPLACE FUNCTION unwind_compensated(
    p_tenant bigint, p_run bigint, p_run_status text, p_from text[], p_steps jsonb, p_lease timestamptz, p_undo bigint,
    p_undo_changes jsonb,
    p_undo_attempt jsonb,
    p_forward bigint, p_forward_changes jsonb, p_next_forward bigint, p_next_forward_changes jsonb, p_next jsonb,
    p_next_attempt jsonb, p_threshold text, p_settle jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_status text;
    v_lease timestamptz;
    v_step integer;
    v_steps jsonb;
    v_threshold text;
    v_dv integer;
    v_undone integer;
    v_ended integer;
    v_row ledger_action;
BEGIN
    SELECT h.seq, h.hash, r.status, r.lease_expires_at, r.next_seq INTO v_seq, v_prev, v_status, v_lease, v_step
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    -- The run in the status the caller decided under; p_from: the statuses the undo, its step and the next step
    -- to undo move from, as the caller decided.
    IF NOT FOUND OR v_status IS DISTINCT FROM p_run_status THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    IF p_lease IS NULL THEN
        -- The unwinder holds the run's lease (else the Python path queues another unwinder).
        IF v_lease IS NULL OR v_lease < now() THEN
            RETURN jsonb_build_object('outcome', 'fallback');
        END IF;
    ELSIF v_lease IS NOT NULL AND v_lease >= now() THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- another unwinder holds it
    END IF;
    -- Every action of the run as the caller read it before the locks: what it chose the next undo (or the
    -- settling) from; the tenant's approval threshold the next undo's claim was decided with.
    SELECT unwind_run_steps(p_run), n.approval_threshold, (SELECT coalesce(max(v.version), 0) FROM ledger_tenantpolicyversion v WHERE v.tenant_id = p_tenant)
      INTO v_steps, v_threshold, v_dv
      FROM ledger_tenant n WHERE n.id = p_tenant;
    IF v_steps <> p_steps OR (p_next IS NOT NULL AND v_threshold IS DISTINCT FROM p_threshold) THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- Leases, as long as the caller made them, run from now on the database's clock: the locks are held, and no
    -- wait for them has eaten into them.
    IF p_lease IS NOT NULL THEN
        v_lease := clock_timestamp() + (p_lease - p_at);
        UPDATE ledger_run SET lease_expires_at = v_lease WHERE id = p_run;
    END IF;
    IF p_undo IS NOT NULL THEN
        WITH undone AS (
            UPDATE ledger_action a
               SET status = n.status, result = n.result, after = n.after, verification = n.verification,
           target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
           lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
           updated_at = n.updated_at, finished_at = n.finished_at
              FROM jsonb_populate_record(NULL::ledger_action, p_undo_changes) n
             WHERE a.id = p_undo AND a.run_id = p_run AND a.status = p_from[1] RETURNING a.id),
        ended AS (
            UPDATE ledger_attempt t
               SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = '', error_message = ''
              FROM jsonb_populate_record(NULL::ledger_attempt, p_undo_attempt) f
             WHERE t.action_id = p_undo AND t.number = f.number AND t.finished_at IS NULL),
        compensated AS (
            UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
              FROM jsonb_populate_record(NULL::ledger_action, p_forward_changes) n
             WHERE a.id = p_forward AND a.status = p_from[2] RETURNING a.id)
        SELECT (SELECT count(*) FROM undone), (SELECT count(*) FROM compensated) INTO v_undone, v_ended;
        IF v_undone <> 1 THEN RAISE EXCEPTION 'unwind: undo % moved under the run lock', p_undo; END IF;
        IF v_ended <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_forward; END IF;
    END IF;
    IF p_next IS NOT NULL THEN
        v_row := jsonb_populate_record(NULL::ledger_action, p_next);
        v_row.lease_expires_at := clock_timestamp() + (v_row.lease_expires_at - p_at);
        v_row.seq := v_step;
        v_row.defaults_version := v_dv;
        WITH claimed AS (
            UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at
              FROM jsonb_populate_record(NULL::ledger_action, p_next_forward_changes) n
             WHERE a.id = p_next_forward AND a.status = p_from[3] RETURNING a.id),
        numbered AS (UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run),
        inserted AS (INSERT INTO ledger_action SELECT (v_row).*)
        SELECT count(*) INTO v_ended FROM claimed;
        IF v_ended <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_next_forward; END IF;
        IF p_next_attempt IS NOT NULL THEN
            INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                        error_message, latency_ms)
            SELECT v_row.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
              FROM jsonb_populate_record(NULL::ledger_attempt, p_next_attempt) a;
        END IF;
    ELSE
        v_step := NULL;
        v_dv := NULL;
    END IF;
    IF p_settle IS NOT NULL THEN
        WITH checkpointed AS (
            INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint))
        UPDATE ledger_run r SET status = n.status, lease_expires_at = NULL, updated_at = n.updated_at,
                                finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_run, p_settle) n WHERE r.id = p_run;
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv, 'row', jsonb_build_object(
        'run_lease', CASE WHEN p_lease IS NOT NULL THEN v_lease END,
        'undo_lease', CASE WHEN p_next IS NOT NULL THEN v_row.lease_expires_at END));
END $$;
