CREATE OR REPLACE FUNCTION unwind_limit_bucket(p_at timestamptz, p_span integer) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
-- The start of the bucket of `p_span` seconds (60, 3600, 86400; counted from the Unix epoch, so in UTC whatever the
-- session's time zone) that holds `p_at`; span 0 is all time, one bucket at the epoch. A limit's running totals are
-- kept (unwind_limit_totals_keep, unwind_limit_measure) and read (unwind_limits_used) by it.
SELECT CASE WHEN p_span = 0 THEN timestamptz 'epoch'
            ELSE date_bin(make_interval(secs => p_span), p_at, timestamptz 'epoch') END
$$;
