CREATE OR REPLACE FUNCTION unwind_run_held(
    r ledger_run, p_run_status text, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text,
    p_intent jsonb, p_plan jsonb
) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
-- Whether the run `r`, as its writer locked it, is the run a decision was made from (plans.RunGuards): its status
-- and the fields its events fingerprint. The writers of a completion and of a step's outcome ask it.
SELECT r.status = p_run_status AND r.pivot_committed = p_pivot AND r.agent_id IS NOT DISTINCT FROM p_agent
       AND r.on_behalf_of = p_on_behalf_of AND r.goal = p_goal AND r.intent = p_intent AND r.plan = p_plan
$$;
