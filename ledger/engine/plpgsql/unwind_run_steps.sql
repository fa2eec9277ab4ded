CREATE OR REPLACE FUNCTION unwind_run_steps(p_run bigint) RETURNS jsonb LANGUAGE sql STABLE AS $$
-- The run's actions as a decision's guard names them (runsteps.guard): [id, status] of each, in order.
SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb)
  FROM ledger_action a WHERE a.run_id = p_run
$$;
