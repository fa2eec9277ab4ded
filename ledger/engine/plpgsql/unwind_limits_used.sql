CREATE OR REPLACE FUNCTION unwind_limits_used(
    p_tenant bigint, p_run bigint, p_tool_name text, p_limits jsonb, p_counted text[], p_at timestamptz
) RETURNS numeric[] LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- What each of a tool's limits has used before a proposal (ledger/policy/limits.py says what a limit counts): its
-- forward steps (every version of the tool, by name) in the limit's scope, since its window's start, whose status
-- is one of p_counted (steps that acted or may still act), each adding its share (unwind_limit_share). p_limits:
-- [{per: run|agent|tenant, path: [..] or null, window: seconds or null}]. The Python path on PostgreSQL and
-- unwind_propose both count with it, under the tenant's chain lock their callers hold; trim_scale writes 4.00 as 4,
-- as Python writes the sum.
--
-- A run's steps are read (a run is short). Per agent and per tenant, where the steps grow with the traffic a limit
-- limits, the running totals are read (unwind_limit_measure; kept by unwind_limit_totals_keep): for all time, one
-- row; for a window, the steps of its first partial minute exactly, then its whole minutes up to the hour, whole
-- hours up to the day and whole days to the end: at most 59 + 23 + 365 rows, whatever the traffic.
-- Both reads of steps are materialized first, then kept to the tool's: otherwise PostgreSQL joins them with the
-- index of steps by tool, which holds every step of the tool (0.9 ms at 20,000; tests/test_busy_tenant.py).
DECLARE
    v_limit jsonb;
    v_path text[];
    v_since timestamptz;
    v_edge timestamptz;
    v_hour timestamptz;
    v_day timestamptz;
    v_agent bigint;
    v_measure bigint;
    v_scope bigint;
    v_used numeric;
    v_total numeric;
    v_all numeric[] := '{}';
BEGIN
    IF p_limits @> '[{"per": "agent"}]' THEN
        SELECT r.agent_id INTO v_agent FROM ledger_run r WHERE r.id = p_run AND r.tenant_id = p_tenant;
    END IF;
    FOR v_limit IN SELECT e FROM jsonb_array_elements(p_limits) e LOOP
        v_path := CASE WHEN jsonb_typeof(v_limit->'path') = 'array'
                       THEN ARRAY(SELECT jsonb_array_elements_text(v_limit->'path')) END;
        v_since := CASE WHEN jsonb_typeof(v_limit->'window') = 'number'
                        THEN p_at - make_interval(secs => (v_limit->>'window')::double precision) END;
        IF v_limit->>'per' = 'run' THEN
            WITH steps AS MATERIALIZED (
                SELECT a.args, a.tool_id FROM ledger_action a
                 WHERE a.run_id = p_run AND a.kind = 'forward' AND a.status = ANY (p_counted)
                   AND (v_since IS NULL OR a.created_at >= v_since))
            SELECT sum(unwind_limit_share(s.args, v_path)) INTO v_used
              FROM steps s
             WHERE s.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name);
        ELSIF v_limit->>'per' IN ('agent', 'tenant') THEN
            v_measure := unwind_limit_measure(p_tenant, p_tool_name, v_limit->>'per', v_path, p_counted);
            v_scope := CASE WHEN v_limit->>'per' = 'agent' THEN coalesce(v_agent, 0) ELSE 0 END;
            IF v_since IS NULL THEN
                SELECT t.value INTO v_used FROM ledger_limittotal t
                 WHERE t.measure_id = v_measure AND t.scope = v_scope AND t.span = 0 AND t.bucket = timestamptz 'epoch';
            ELSE
                -- [v_since, v_edge): read; [v_edge, v_hour) in minutes, [v_hour, v_day) in hours, then days.
                v_edge := unwind_limit_bucket(v_since, 60);
                v_edge := v_edge + CASE WHEN v_edge < v_since THEN interval '1 minute' ELSE interval '0' END;
                v_hour := unwind_limit_bucket(v_edge, 3600);
                v_hour := v_hour + CASE WHEN v_hour < v_edge THEN interval '1 hour' ELSE interval '0' END;
                v_day := unwind_limit_bucket(v_hour, 86400);
                v_day := v_day + CASE WHEN v_day < v_hour THEN interval '1 day' ELSE interval '0' END;
                WITH steps AS MATERIALIZED (
                    SELECT a.args, a.tool_id, a.run_id FROM ledger_action a
                     WHERE a.tenant_id = p_tenant AND a.created_at >= v_since AND a.created_at < v_edge
                       AND a.kind = 'forward' AND a.status = ANY (p_counted))
                SELECT sum(unwind_limit_share(s.args, v_path)) INTO v_used
                  FROM steps s
                 WHERE s.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name)
                   AND (v_limit->>'per' = 'tenant'
                        OR (SELECT r.agent_id FROM ledger_run r WHERE r.id = s.run_id) IS NOT DISTINCT FROM v_agent);
                -- Three ranges of the (measure, scope, span, bucket) index, one per span.
                SELECT sum(x.value) INTO v_total FROM (
                    SELECT t.value FROM ledger_limittotal t
                     WHERE t.measure_id = v_measure AND t.scope = v_scope AND t.span = 60
                       AND t.bucket >= v_edge AND t.bucket < v_hour
                    UNION ALL
                    SELECT t.value FROM ledger_limittotal t
                     WHERE t.measure_id = v_measure AND t.scope = v_scope AND t.span = 3600
                       AND t.bucket >= v_hour AND t.bucket < v_day
                    UNION ALL
                    SELECT t.value FROM ledger_limittotal t
                     WHERE t.measure_id = v_measure AND t.scope = v_scope AND t.span = 86400 AND t.bucket >= v_day) x;
                v_used := coalesce(v_used, 0) + coalesce(v_total, 0);
            END IF;
        ELSE
            RAISE EXCEPTION 'unwind_limits_used: a limit is per run, agent or tenant, not %', v_limit->>'per';
        END IF;
        v_all := v_all || trim_scale(coalesce(v_used, 0));
    END LOOP;
    RETURN v_all;
END $$;
