CREATE OR REPLACE FUNCTION unwind_chain_hashes(
    p_prev text, p_seq bigint, p_ikey bytea, p_okey bytea, p_events jsonb
) RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    v_hashes text[] := '{}';
    v_event jsonb;
BEGIN
    -- Each event: [kind, actor, run, action, data (its canonical text), the body before its number, after it].
    FOR i IN 0 .. jsonb_array_length(p_events) - 1 LOOP
        v_event := p_events -> i;
        p_seq := p_seq + 1;
        p_prev := encode(sha256(p_okey || sha256(p_ikey || convert_to(
            p_prev || (v_event->>5) || p_seq::text || (v_event->>6), 'UTF8'))), 'hex');
        v_hashes := v_hashes || p_prev;
    END LOOP;
    RETURN v_hashes;
END $$;
