CREATE OR REPLACE FUNCTION unwind_propose(
    p_tenant bigint, p_run bigint, p_action jsonb, p_attempt jsonb, p_key text, p_key_free_in bigint[],
    p_run_status text, p_cancelled boolean, p_step integer, p_steps jsonb, p_threshold text,
    p_tool_written timestamptz, p_slug text, p_twin_name text, p_twin bigint, p_tool_name text, p_limits jsonb,
    p_counted text[], p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- The writer of a proposal Python decided (ledger/engine/proposal.py, runsteps.py): it knows no rule. It locks the
-- chain head, then the run, and checks the guards the decision was made under; any that fails answers 'stale',
-- having written nothing, and the caller decides again from a fresh read.
DECLARE
    v_head tid;
    v_seq bigint;
    v_prev text;
    v_same boolean;
    v_dv integer;
    v_current boolean;
    v_twin bigint;
    v_slug text;
    v_threshold text;
    v_steps jsonb;
    v_agent bigint;
    v_taken boolean;
    v_moved integer;
    v_row ledger_action;
    v_used numeric[];
BEGIN
    -- The run as the caller decided from it: its status, its cancel mark and its next step's number.
    SELECT h.ctid, h.seq, h.hash, r.status = p_run_status AND (r.cancel_requested_at IS NOT NULL) = p_cancelled
                          AND r.next_seq = p_step
      INTO v_head, v_seq, v_prev, v_same
      FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- The rest of what the caller decided from, as it stands now: the tool's version is still the current one (the
    -- very row: its id and when it was written, should ids ever be drawn again, after a restore), the compensation's
    -- twin (unless the tool pins its version) is still the version bound, the tenant's slug (which signs the call)
    -- and approval threshold are unchanged, and the run's actions are those it decided from ([id, status] in
    -- order: what the same-content match, the ordering law and the held steps were decided on). The caller may have
    -- taken them from what its process keeps. Then whether the key is taken in a scope the caller names besides its
    -- agent's (which the key's unique index checks at the insert, below).
    SELECT coalesce((SELECT t.is_current AND t.created_at = p_tool_written FROM ledger_tool t
                      WHERE t.id = (p_action->>'tool_id')::bigint AND t.tenant_id = p_tenant), false),
           (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_twin_name AND t.is_current),
           n.slug, n.approval_threshold,
           unwind_run_steps(p_run),
           (SELECT coalesce(max(v.version), 0) FROM ledger_tenantpolicyversion v WHERE v.tenant_id = p_tenant)
      INTO v_current, v_twin, v_slug, v_threshold, v_steps, v_dv
      FROM ledger_tenant n WHERE n.id = p_tenant;
    IF NOT v_same OR NOT v_current OR (p_twin_name IS NOT NULL AND v_twin IS DISTINCT FROM p_twin)
            OR v_slug IS DISTINCT FROM p_slug OR v_threshold IS DISTINCT FROM p_threshold OR v_steps <> p_steps THEN
        RETURN jsonb_build_object('outcome', 'stale');
    END IF;
    -- One look-up of the key's unique index per scope, each on all its columns, planned afresh each time (EXECUTE):
    -- with `key_agent = ANY (...)` the planner, on statistics older than the table, kept the scope as a filter and
    -- read every key of the tenant (1 ms a proposal at 4,000 actions, growing with the tenant); and a plan this
    -- session kept from when the table was small took the tenant's (tenant, created_at) index, reading every step of
    -- the tenant (tests/test_busy_tenant.py). Planned with the values, only the unique index fits.
    FOREACH v_agent IN ARRAY p_key_free_in LOOP
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM ledger_action a WHERE a.tenant_id = $1 AND a.key_agent = $2'
                ' AND a.idempotency_key = $3)' INTO v_taken USING p_tenant, v_agent, p_key;
        IF v_taken THEN
            RETURN jsonb_build_object('outcome', 'taken');  -- the Python path says whose key it is
        END IF;
    END LOOP;
    v_row := jsonb_populate_record(NULL::ledger_action, p_action);
    -- The tool's limits, counted under the tenant's chain lock taken above: the call goes on only with the room it
    -- needs in each (the caller's `limits.asked`, the one comparison); otherwise the Python path counts again and
    -- refuses it, saying why. What each had used is kept on the action, as the Python path keeps it.
    IF p_limits IS NOT NULL THEN
        v_used := unwind_limits_used(p_tenant, p_run, p_tool_name, p_limits, p_counted, p_at);
        FOR i IN 1 .. coalesce(cardinality(v_used), 0) LOOP
            IF v_used[i] > (p_limits->(i - 1)->>'room')::numeric THEN
                RETURN jsonb_build_object('outcome', 'full');
            END IF;
            v_row.policy_decision := jsonb_set(v_row.policy_decision, ARRAY['limits', (i - 1)::text, 'used'],
                                               to_jsonb(v_used[i]));
        END LOOP;
    END IF;
    -- The lease, as long as the caller made it, runs from now on the database's clock: the locks are held, and
    -- no wait for them has eaten into it.
    v_row.lease_expires_at := clock_timestamp() + (v_row.lease_expires_at - p_at);
    v_row.seq := p_step;
    v_row.defaults_version := v_dv;
    -- A key already taken is a replay, which the Python path answers: the insert does nothing, and nothing else is
    -- written, as every other write depends on it. (Checked by the key's unique index itself, so that no plan made
    -- while the table was small reads the tenant's actions instead.)
    WITH inserted AS (
        INSERT INTO ledger_action SELECT (v_row).*
        ON CONFLICT ON CONSTRAINT idempotency_key_unique_per_agent DO NOTHING RETURNING id),
    numbered AS (UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run AND EXISTS (SELECT FROM inserted))
    INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                error_message, latency_ms)
    SELECT inserted.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
      FROM inserted, jsonb_populate_record(NULL::ledger_attempt, p_attempt) a;
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN
        RETURN jsonb_build_object('outcome', 'taken');  -- a replay
    END IF;
    PERFORM unwind_chain_append(p_tenant, v_head, v_seq, v_prev, p_ikey, p_okey, p_key_id, p_at, p_events);
    -- The id of this caller's next proposal, drawn now: it spares that proposal a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'step', p_step, 'defaults_version', v_dv, 'used', to_jsonb(v_used),
                              'next_id', nextval(pg_get_serial_sequence('ledger_action', 'id')));
END $$;
