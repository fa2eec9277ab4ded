CREATE OR REPLACE FUNCTION unwind_limit_totals_forget() RETURNS trigger LANGUAGE plpgsql AS $$
-- The trigger on ledger_run (migration 0022) for a run whose agent changed (an agent deleted leaves its runs without
-- one): the tenant's running totals per agent no longer say what its steps add up to per agent, so they are dropped
-- and built again from the ledger the next time a limit counts them (unwind_limit_measure).
BEGIN
    DELETE FROM ledger_limittotal
     WHERE measure_id IN (SELECT m.id FROM ledger_limitmeasure m WHERE m.tenant_id = NEW.tenant_id AND m.per = 'agent');
    DELETE FROM ledger_limitmeasure WHERE tenant_id = NEW.tenant_id AND per = 'agent';
    RETURN NULL;
END $$;
