CREATE OR REPLACE FUNCTION unwind_run_steps(p_run bigint) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
-- The run's actions as a decision's guard names them (runsteps.guard): [id, status] of each, in order.
-- PL/pgSQL, not SQL: a SQL function called from a statement of another function is planned again on each
-- execution of that statement (60-70 µs a call here), a PL/pgSQL one keeps its plan for the session (20-30 µs).
BEGIN
    RETURN (SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb)
              FROM ledger_action a WHERE a.run_id = p_run);
END $$;
