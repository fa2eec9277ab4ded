CREATE OR REPLACE FUNCTION unwind_limit_totals_keep() RETURNS trigger LANGUAGE plpgsql AS $$
-- The triggers on ledger_action (migrations 0022 and 0029) that keep the running totals of the tool's limits per
-- agent and per tenant (ledger_limittotal; unwind_limit_measure says what they hold): a forward step marked
-- `totalled` that is recorded in, or moves into, one of the counted statuses (the trigger's arguments, TG_ARGV:
-- ledger/policy/limits.py's COUNTED) adds its share to each of its tool's measures, in its bucket of each span; one
-- that moves out of them, or is deleted in one (archived), takes it back. The triggers' WHEN clauses call it only
-- then. A step's arguments, tool, run, kind and time never change once recorded (nothing in the engine writes them
-- again).
DECLARE
    v_row record;
    v_sign integer;
BEGIN
    -- Most tenants keep no totals: one look at the index, and out.
    IF NOT EXISTS (SELECT FROM ledger_limitmeasure m WHERE m.tenant_id IN (NEW.tenant_id, OLD.tenant_id)) THEN
        RETURN NULL;
    END IF;
    FOREACH v_sign IN ARRAY ARRAY[-1, 1] LOOP
        IF v_sign = -1 THEN  -- what the step held before: taken back
            CONTINUE WHEN TG_OP = 'INSERT' OR OLD.kind <> 'forward' OR NOT OLD.status = ANY (TG_ARGV);
            v_row := OLD;
        ELSE                 -- what it holds now: added
            CONTINUE WHEN TG_OP = 'DELETE' OR NEW.kind <> 'forward' OR NOT NEW.status = ANY (TG_ARGV);
            v_row := NEW;
        END IF;
        INSERT INTO ledger_limittotal AS t (measure_id, scope, span, bucket, value)
        SELECT m.id, CASE WHEN m.per = 'agent'
                          THEN coalesce((SELECT r.agent_id FROM ledger_run r WHERE r.id = v_row.run_id), 0)
                          ELSE 0 END,
               s.span, unwind_limit_bucket(v_row.created_at, s.span),
               v_sign * unwind_limit_share(v_row.args, CASE WHEN m.path <> '' THEN string_to_array(m.path, '.') END)
          FROM ledger_limitmeasure m, (VALUES (0), (60), (3600), (86400)) s (span)
         WHERE m.tenant_id = v_row.tenant_id
           AND m.tool_name = (SELECT t.name FROM ledger_tool t WHERE t.id = v_row.tool_id)
        ON CONFLICT (measure_id, scope, span, bucket) DO UPDATE SET value = t.value + EXCLUDED.value;
    END LOOP;
    RETURN NULL;
END $$;
