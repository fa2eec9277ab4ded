CREATE OR REPLACE FUNCTION unwind_limits_used(
    p_tenant bigint, p_run bigint, p_tool_name text, p_limits jsonb, p_counted text[], p_at timestamptz
) RETURNS numeric[] LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
-- What each of a tool's limits has used before a proposal (ledger/policy/limits.py says what a limit counts): its
-- forward steps (every version of the tool, by name) in the limit's scope, since its window's start, whose status
-- is one of p_counted (steps that acted or may still act); counted (no `path`) or their values at `path` added up,
-- each a number of at least 0 (anything else adds 0). p_limits: [{per: run|agent|tenant, path: [..] or null,
-- window: seconds or null}]. The Python path on PostgreSQL and unwind_propose both count with it, under the
-- tenant's chain lock their callers hold; trim_scale writes 4.00 as 4, as Python writes the sum.
DECLARE
    v_limit jsonb;
    v_path text[];
    v_since timestamptz;
    v_agent bigint;
    v_used numeric;
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
        -- One statement per scope, alike but for it: each gets a plan of its own (a run's steps by the run's index;
        -- an OR of the scopes in one statement would read every step of the tool for a run's limit).
        IF v_limit->>'per' = 'run' THEN
            SELECT sum(CASE WHEN v_path IS NULL THEN 1 WHEN jsonb_typeof(x.v) = 'number' THEN greatest(x.v::numeric, 0) END)
              INTO v_used
              FROM ledger_action a, LATERAL (SELECT CASE WHEN v_path IS NOT NULL THEN a.args #> v_path END AS v) x
             WHERE a.run_id = p_run AND a.kind = 'forward' AND a.status = ANY (p_counted)
               AND a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name)
               AND (v_since IS NULL OR a.created_at >= v_since);
        ELSIF v_limit->>'per' = 'agent' THEN
            SELECT sum(CASE WHEN v_path IS NULL THEN 1 WHEN jsonb_typeof(x.v) = 'number' THEN greatest(x.v::numeric, 0) END)
              INTO v_used
              FROM ledger_action a, LATERAL (SELECT CASE WHEN v_path IS NOT NULL THEN a.args #> v_path END AS v) x
             WHERE a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name)
               AND a.run_id IN (SELECT r.id FROM ledger_run r
                                 WHERE r.tenant_id = p_tenant AND r.agent_id IS NOT DISTINCT FROM v_agent)
               AND a.kind = 'forward' AND a.status = ANY (p_counted)
               AND (v_since IS NULL OR a.created_at >= v_since);
        ELSIF v_limit->>'per' = 'tenant' THEN
            SELECT sum(CASE WHEN v_path IS NULL THEN 1 WHEN jsonb_typeof(x.v) = 'number' THEN greatest(x.v::numeric, 0) END)
              INTO v_used
              FROM ledger_action a, LATERAL (SELECT CASE WHEN v_path IS NOT NULL THEN a.args #> v_path END AS v) x
             WHERE a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name)
               AND a.kind = 'forward' AND a.status = ANY (p_counted)
               AND (v_since IS NULL OR a.created_at >= v_since);
        ELSE
            RAISE EXCEPTION 'unwind_limits_used: a limit is per run, agent or tenant, not %', v_limit->>'per';
        END IF;
        v_all := v_all || trim_scale(coalesce(v_used, 0));
    END LOOP;
    RETURN v_all;
END $$;
