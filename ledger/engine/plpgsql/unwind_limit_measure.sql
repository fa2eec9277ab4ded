CREATE OR REPLACE FUNCTION unwind_limit_measure(
    p_tenant bigint, p_tool_name text, p_per text, p_path text[], p_counted text[]
) RETURNS bigint LANGUAGE plpgsql AS $$
-- The id of the running totals (ledger_limitmeasure) of a tool's limit per agent or per tenant: a count (no path)
-- or a sum of the arguments' values at p_path. The first time it is asked for, it is added and its totals filled
-- from the ledger: the tool's forward steps (every version, by name) whose status is one of p_counted, by the run's
-- agent (0 for none; 0 for every step per tenant) and by bucket; and the tool's steps marked `totalled`. From then
-- on the triggers on ledger_action (unwind_limit_totals_keep) keep the totals as marked steps are recorded and move
-- in or out of the counted statuses (ledger/policy/limits.keep_totals_of keeps a new step of the tool marked).
-- Its caller holds the tenant's chain lock, which every writer of the tenant's steps takes first: no step moves
-- between the fill's read and this transaction's commit unseen by the triggers.
DECLARE
    v_id bigint;
    v_path text := coalesce(array_to_string(p_path, '.'), '');
BEGIN
    SELECT m.id INTO v_id FROM ledger_limitmeasure m
     WHERE m.tenant_id = p_tenant AND m.tool_name = p_tool_name AND m.per = p_per AND m.path = v_path;
    IF FOUND THEN
        RETURN v_id;
    END IF;
    -- Every step of the tool is marked: only a marked step's moves call the triggers that keep the totals.
    UPDATE ledger_action a SET totalled = true
     WHERE a.tenant_id = p_tenant AND a.kind = 'forward' AND NOT a.totalled
       AND a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name);
    INSERT INTO ledger_limitmeasure (tenant_id, tool_name, per, path, created_at)
    VALUES (p_tenant, p_tool_name, p_per, v_path, clock_timestamp()) RETURNING id INTO v_id;
    INSERT INTO ledger_limittotal (measure_id, scope, span, bucket, value)
    SELECT v_id, CASE WHEN p_per = 'agent' THEN coalesce(r.agent_id, 0) ELSE 0 END, s.span,
           unwind_limit_bucket(a.created_at, s.span), sum(unwind_limit_share(a.args, p_path))
      FROM ledger_action a JOIN ledger_run r ON r.id = a.run_id,
           (VALUES (0), (60), (3600), (86400)) s (span)
     WHERE a.tenant_id = p_tenant AND a.kind = 'forward' AND a.status = ANY (p_counted)
       AND a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_tool_name)
     GROUP BY 2, 3, 4;
    RETURN v_id;
END $$;
