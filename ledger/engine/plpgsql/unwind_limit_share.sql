CREATE OR REPLACE FUNCTION unwind_limit_share(p_args jsonb, p_path text[]) RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
-- What one step that acted or may still act adds to a limit (ledger/policy/limits.py): 1 to a count (no path), and
-- to a sum its value at the path when that is a number of at least 0, else 0. The one place both the limits' reads
-- (unwind_limits_used) and their running totals (unwind_limit_measure, unwind_limit_totals_keep) say it.
SELECT CASE WHEN p_path IS NULL THEN 1::numeric
            WHEN jsonb_typeof(p_args #> p_path) = 'number' THEN greatest((p_args #> p_path)::numeric, 0)
            ELSE 0::numeric END
$$;
