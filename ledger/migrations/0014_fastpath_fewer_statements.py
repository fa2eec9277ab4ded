"""The same transactions in a third of the statements: each of the engine's functions now runs its locks, its checks
and its writes as a few statements instead of one per row.

Inside PostgreSQL, on 0013's functions (`perf record` of the backend during ok sagas), most of a call's CPU went to
what each SQL statement costs before and after its work, not to the work: starting and ending an executor (12 %),
revalidating and locking the cached plan, and planning again on every call (5 %) the checks whose condition began
with an argument alone (`p_content_key <> '' AND EXISTS (...)`): for a plan made for the call's values that
condition folds away, so the plan made for any values never looked cheaper and was never kept. A proposal ran 16
statements, a step's success 8.

- The chain's head and the run are locked in one statement, in that order (the order of its FROM, as the Python
  path locks them), and the head's number and hash come with the lock: the chain's own read of the head goes.
- A function's checks are one statement, each check a subquery of it; none is gated by an argument alone, so one
  plan serves every call (an empty list of roles, say, finds nothing by itself).
- Its writes and the chain's events and head are one statement, the writes as data-modifying CTEs: they all see
  the locked rows and commit together. Where a write must move exactly one row, it moves it first on its own (the
  step's success) or the others are counted with it and an error rolls everything back (the unwind's moves).
- The chain's hashes are computed first, by `unwind_chain_hashes` (HMAC-SHA256 of each event's body as
  `verify_chain` checks it, the key's padded halves passed for the call and never stored), with no statement: it
  only computes. `unwind_chain_append` is gone.

Every function keeps its arguments and its answers, and decides every case as before; the Python side is unchanged.
"""
import importlib

from django.db import migrations

EARLIER = importlib.import_module("ledger.migrations.0013_fastpath_fewer_entries")
FIRST = importlib.import_module("ledger.migrations.0010_fastpath_functions")

CHAIN_HASHES = """
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
"""

# The events, as a function's last data-modifying CTE, and the head's move after them: v_seq and v_prev are the head
# as locked, v_hashes what `unwind_chain_hashes` computed from them.
EVENTS = """chained AS (
        INSERT INTO ledger_auditevent (tenant_id, seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash,
                                       hash, key_id)
        SELECT p_tenant, v_seq + e.i, e.v->>0, e.v->>1, (e.v->>2)::bigint, (e.v->>3)::bigint, (e.v->>4)::jsonb, p_at,
               CASE WHEN e.i = 1 THEN v_prev ELSE v_hashes[e.i::integer - 1] END, v_hashes[e.i::integer], p_key_id
          FROM jsonb_array_elements(p_events) WITH ORDINALITY e(v, i))"""
HEAD = """UPDATE ledger_audithead
       SET seq = v_seq + cardinality(v_hashes), hash = coalesce(v_hashes[cardinality(v_hashes)], v_prev)
     WHERE tenant_id = p_tenant"""

# What a step's success (or a compensation's) sets on the action, from the row `n` its caller sent (the Python
# side's SUCCESS_FIELDS), and on its attempt, from `f`.
SUCCEEDED = """status = n.status, result = n.result, after = n.after, verification = n.verification,
           target_id = n.target_id, compensation_plan = n.compensation_plan, lease_owner = n.lease_owner,
           lease_expires_at = n.lease_expires_at, error_class = n.error_class, error_message = n.error_message,
           updated_at = n.updated_at, finished_at = n.finished_at"""
ENDED = ("finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms, error_class = '',"
         " error_message = ''")

# The head and the run, locked in that order.
LOCK_HEAD_AND_RUN = """FROM ledger_audithead h, ledger_run r
     WHERE h.tenant_id = p_tenant AND r.id = p_run AND r.tenant_id = p_tenant
       FOR NO KEY UPDATE"""

# The run's actions as [id, status] in order: what an unwinding caller read before the locks.
STEPS = """(SELECT coalesce(jsonb_agg(jsonb_build_array(a.id, a.status) ORDER BY a.seq), '[]'::jsonb)
                FROM ledger_action a WHERE a.run_id = p_run)"""

# The tenant's policy version, recorded on each action inserted.
DEFAULTS_VERSION = ("(SELECT coalesce(max(v.version), 0) FROM ledger_tenantpolicyversion v"
                    " WHERE v.tenant_id = p_tenant)")

PROPOSE = """
CREATE OR REPLACE FUNCTION unwind_propose(
    p_tenant bigint, p_run bigint, p_action jsonb, p_attempt jsonb, p_key text, p_content_key text,
    p_matching text[], p_roles text[], p_gone text[], p_threshold text, p_tool_written timestamptz, p_slug text,
    p_twin_name text, p_twin bigint, p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_status text;
    v_cancelled boolean;
    v_step integer;
    v_dv integer;
    v_current boolean;
    v_twin bigint;
    v_slug text;
    v_threshold text;
    v_taken boolean;
    v_moved integer;
    v_row ledger_action;
BEGIN
    SELECT h.seq, h.hash, r.status, r.cancel_requested_at IS NOT NULL, r.next_seq
      INTO v_seq, v_prev, v_status, v_cancelled, v_step
      @LOCK@;
    IF NOT FOUND OR v_cancelled OR v_status NOT IN ('running', 'awaiting_approval') THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    -- What the caller decided from, as it stands now: the tool's version is still the current one (the very row:
    -- its id and when it was written, should ids ever be drawn again, after a restore), the compensation's twin
    -- (unless the tool pins its version) is still the version bound, the tenant's slug (which signs the call) and
    -- approval threshold are unchanged. The caller may have taken them from what its process keeps. Then what the
    -- Python path decides itself: the same content done or in flight, a step the ordering law refuses (a replay,
    -- the key taken, below).
    SELECT coalesce((SELECT t.is_current AND t.created_at = p_tool_written FROM ledger_tool t
                      WHERE t.id = (p_action->>'tool_id')::bigint AND t.tenant_id = p_tenant), false),
           (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = p_tenant AND t.name = p_twin_name AND t.is_current),
           n.slug, n.approval_threshold,
           EXISTS (SELECT 1 FROM ledger_action a WHERE a.run_id = p_run AND a.content_key = p_content_key
                         AND a.content_key <> '' AND a.status = ANY (p_matching))
           OR EXISTS (SELECT 1 FROM ledger_action a
                       WHERE a.run_id = p_run AND a.kind = 'forward' AND a.saga_role = ANY (p_roles)
                         AND a.status <> ALL (p_gone) AND NOT (a.status = 'failed' AND a.error_class = 'refused')
                         AND (SELECT t.action_class FROM ledger_tool t WHERE t.id = a.tool_id) <> 'read_only'),
           @DEFAULTS_VERSION@
      INTO v_current, v_twin, v_slug, v_threshold, v_taken, v_dv
      FROM ledger_tenant n WHERE n.id = p_tenant;
    IF NOT v_current OR (p_twin_name IS NOT NULL AND v_twin IS DISTINCT FROM p_twin)
            OR v_slug IS DISTINCT FROM p_slug OR v_threshold IS DISTINCT FROM p_threshold THEN
        RETURN jsonb_build_object('outcome', 'stale');
    END IF;
    IF v_taken THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- the Python path says which
    END IF;
    v_row := jsonb_populate_record(NULL::ledger_action, p_action);
    v_row.seq := v_step;
    v_row.defaults_version := v_dv;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    -- A key already taken is a replay, which the Python path answers: the insert does nothing, and nothing else is
    -- written, as every other write depends on it. (Checked by the key's unique index itself, so that no plan made
    -- while the table was small reads the tenant's actions instead.)
    WITH inserted AS (
        INSERT INTO ledger_action SELECT (v_row).*
        ON CONFLICT ON CONSTRAINT idempotency_key_unique_per_tenant DO NOTHING RETURNING id),
    numbered AS (UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run AND EXISTS (SELECT FROM inserted)),
    attempted AS (
        INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                    error_message, latency_ms)
        SELECT inserted.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
          FROM inserted, jsonb_populate_record(NULL::ledger_attempt, p_attempt) a),
    @GATED_EVENTS@
    @HEAD@ AND EXISTS (SELECT FROM inserted);
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- a replay
    END IF;
    -- The id of this caller's next proposal, drawn now: it spares that proposal a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv,
                              'next_id', nextval(pg_get_serial_sequence('ledger_action', 'id')));
END $$;
"""

SUCCEED = """
CREATE OR REPLACE FUNCTION unwind_succeed(
    p_tenant bigint, p_run bigint, p_action bigint, p_changes jsonb, p_pivot boolean, p_attempt jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_status text;
    v_open boolean;
    v_pivot boolean;
    v_moved integer;
BEGIN
    SELECT h.seq, h.hash, r.status, r.cancel_requested_at IS NULL, r.pivot_committed
      INTO v_seq, v_prev, v_status, v_open, v_pivot
      @LOCK@;
    IF NOT FOUND OR v_status <> 'running' OR NOT v_open OR (p_pivot AND NOT v_pivot) THEN
        RETURN 'fallback';
    END IF;
    UPDATE ledger_action a
       SET @SUCCEEDED@
      FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
     WHERE a.id = p_action AND a.run_id = p_run AND a.status = 'running';
    GET DIAGNOSTICS v_moved = ROW_COUNT;
    IF v_moved <> 1 THEN RETURN 'fallback'; END IF;  -- moved by someone else: the Python path says how
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH ended AS (
        UPDATE ledger_attempt t
           SET @ENDED@
          FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
         WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL),
    @EVENTS@
    @HEAD@;
    RETURN 'ok';
END $$;
"""

OPEN_RUN = """
CREATE OR REPLACE FUNCTION unwind_open_run(
    p_tenant bigint, p_run jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
BEGIN
    SELECT h.seq, h.hash INTO v_seq, v_prev FROM ledger_audithead h WHERE h.tenant_id = p_tenant FOR NO KEY UPDATE;
    IF NOT FOUND THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH opened AS (INSERT INTO ledger_run SELECT * FROM jsonb_populate_record(NULL::ledger_run, p_run)),
    @EVENTS@
    @HEAD@;
    -- The id of this caller's next run, drawn now: it spares that opening a read when it comes soon.
    RETURN jsonb_build_object('outcome', 'ok', 'next_id', nextval(pg_get_serial_sequence('ledger_run', 'id')));
END $$;
"""

COMPLETE = """
CREATE OR REPLACE FUNCTION unwind_complete(
    p_tenant bigint, p_run bigint, p_pivot boolean, p_agent bigint, p_on_behalf_of text, p_goal text, p_intent jsonb,
    p_plan jsonb, p_busy text[], p_done text[], p_unfinished text[], p_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_same boolean;
    v_busy boolean;
    v_newer boolean;
    v_run ledger_run;
    v_checkpoint ledger_checkpoint;
BEGIN
    v_checkpoint := jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint);
    -- Running, with the pivot and the fingerprinted fields the caller built the events from (else the Python path
    -- says which).
    SELECT h.seq, h.hash,
           r.status = 'running' AND r.pivot_committed = p_pivot AND r.agent_id IS NOT DISTINCT FROM p_agent
           AND r.on_behalf_of = p_on_behalf_of AND r.goal = p_goal AND r.intent = p_intent AND r.plan = p_plan
      INTO v_seq, v_prev, v_same
      @LOCK@;
    IF NOT FOUND OR NOT v_same THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    -- No step in flight; and the checkpoint's id was drawn before the locks: the run's checkpoints are read in id
    -- order, so none may have come after it. Its state as runstate.checkpoint_state builds it from the run's
    -- forward steps in order.
    SELECT EXISTS (SELECT 1 FROM ledger_action b WHERE b.run_id = p_run AND b.status = ANY (p_busy)),
           EXISTS (SELECT 1 FROM ledger_checkpoint c WHERE c.run_id = p_run AND c.id > v_checkpoint.id),
           jsonb_build_object(
               'run_status', 'completed', 'pivot_committed', p_pivot, 'recovery_mode', 'resume',
               'completed_action_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = ANY (p_done)), '[]'::jsonb),
               'pending_action_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = ANY (p_unfinished)), '[]'::jsonb),
               'awaiting_approval_ids',
               coalesce(jsonb_agg(a.id ORDER BY a.seq) FILTER (WHERE a.status = 'awaiting_approval'), '[]'::jsonb),
               'summary', coalesce(string_agg((SELECT t.name FROM ledger_tool t WHERE t.id = a.tool_id) || ' '
                                              || replace(a.status, '_', ' '), ', ' ORDER BY a.seq), 'no actions yet'))
      INTO v_busy, v_newer, v_checkpoint.state
      FROM ledger_action a WHERE a.run_id = p_run AND a.kind = 'forward';
    IF v_busy THEN RETURN jsonb_build_object('outcome', 'fallback'); END IF;
    IF v_newer THEN RETURN jsonb_build_object('outcome', 'stale'); END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH checkpointed AS (INSERT INTO ledger_checkpoint SELECT (v_checkpoint).*),
    @EVENTS@,
    head AS (@HEAD@)
    UPDATE ledger_run r SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
      FROM jsonb_populate_record(NULL::ledger_run, p_changes) n WHERE r.id = p_run
    RETURNING r.* INTO v_run;
    -- The id of this caller's next completion's checkpoint, drawn now: it spares that completion a read.
    RETURN jsonb_build_object('outcome', 'ok', 'row', to_jsonb(v_run),
                              'next_id', nextval(pg_get_serial_sequence('ledger_checkpoint', 'id')));
END $$;
"""

COMPENSATED = """
CREATE OR REPLACE FUNCTION unwind_compensated(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_lease timestamptz, p_undo bigint, p_undo_changes jsonb,
    p_undo_attempt jsonb,
    p_forward bigint, p_forward_changes jsonb, p_next_forward bigint, p_next_forward_changes jsonb, p_next jsonb,
    p_next_attempt jsonb, p_threshold text, p_settle jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS jsonb LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_status text;
    v_lease timestamptz;
    v_step integer;
    v_steps jsonb;
    v_threshold text;
    v_dv integer;
    v_undone integer;
    v_ended integer;
    v_row ledger_action;
BEGIN
    SELECT h.seq, h.hash, r.status, r.lease_expires_at, r.next_seq INTO v_seq, v_prev, v_status, v_lease, v_step
      @LOCK@;
    IF NOT FOUND OR v_status <> 'unwinding' THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    IF p_lease IS NULL THEN
        -- The unwinder holds the run's lease (else the Python path queues another unwinder).
        IF v_lease IS NULL OR v_lease < now() THEN
            RETURN jsonb_build_object('outcome', 'fallback');
        END IF;
    ELSIF v_lease IS NOT NULL AND v_lease >= now() THEN
        RETURN jsonb_build_object('outcome', 'fallback');  -- another unwinder holds it
    END IF;
    -- Every action of the run as the caller read it before the locks: what it chose the next undo (or the
    -- settling) from; the tenant's approval threshold the next undo's claim was decided with.
    SELECT @STEPS@, n.approval_threshold, @DEFAULTS_VERSION@
      INTO v_steps, v_threshold, v_dv
      FROM ledger_tenant n WHERE n.id = p_tenant;
    IF v_steps <> p_steps OR (p_next IS NOT NULL AND v_threshold IS DISTINCT FROM p_threshold) THEN
        RETURN jsonb_build_object('outcome', 'fallback');
    END IF;
    IF p_lease IS NOT NULL THEN
        UPDATE ledger_run SET lease_expires_at = p_lease WHERE id = p_run;
    END IF;
    IF p_undo IS NOT NULL THEN
        WITH undone AS (
            UPDATE ledger_action a
               SET @SUCCEEDED@
              FROM jsonb_populate_record(NULL::ledger_action, p_undo_changes) n
             WHERE a.id = p_undo AND a.run_id = p_run AND a.status = 'running' RETURNING a.id),
        ended AS (
            UPDATE ledger_attempt t
               SET @ENDED@
              FROM jsonb_populate_record(NULL::ledger_attempt, p_undo_attempt) f
             WHERE t.action_id = p_undo AND t.number = f.number AND t.finished_at IS NULL),
        compensated AS (
            UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at, finished_at = n.finished_at
              FROM jsonb_populate_record(NULL::ledger_action, p_forward_changes) n
             WHERE a.id = p_forward AND a.status = 'compensating' RETURNING a.id)
        SELECT (SELECT count(*) FROM undone), (SELECT count(*) FROM compensated) INTO v_undone, v_ended;
        IF v_undone <> 1 THEN RAISE EXCEPTION 'unwind: undo % moved under the run lock', p_undo; END IF;
        IF v_ended <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_forward; END IF;
    END IF;
    IF p_next IS NOT NULL THEN
        v_row := jsonb_populate_record(NULL::ledger_action, p_next);
        v_row.seq := v_step;
        v_row.defaults_version := v_dv;
        WITH claimed AS (
            UPDATE ledger_action a SET status = n.status, updated_at = n.updated_at
              FROM jsonb_populate_record(NULL::ledger_action, p_next_forward_changes) n
             WHERE a.id = p_next_forward AND a.status = 'succeeded' RETURNING a.id),
        numbered AS (UPDATE ledger_run SET next_seq = next_seq + 1 WHERE id = p_run),
        inserted AS (INSERT INTO ledger_action SELECT (v_row).*)
        SELECT count(*) INTO v_ended FROM claimed;
        IF v_ended <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_next_forward; END IF;
        IF p_next_attempt IS NOT NULL THEN
            INSERT INTO ledger_attempt (action_id, number, worker, started_at, finished_at, outcome, error_class,
                                        error_message, latency_ms)
            SELECT v_row.id, a.number, a.worker, a.started_at, NULL, '', '', '', NULL
              FROM jsonb_populate_record(NULL::ledger_attempt, p_next_attempt) a;
        END IF;
    ELSE
        v_step := NULL;
        v_dv := NULL;
    END IF;
    IF p_settle IS NOT NULL THEN
        WITH checkpointed AS (
            INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint))
        UPDATE ledger_run r SET status = n.status, lease_expires_at = NULL, updated_at = n.updated_at,
                                finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_run, p_settle) n WHERE r.id = p_run;
    END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH @EVENTS@
    @HEAD@;
    RETURN jsonb_build_object('outcome', 'ok', 'step', v_step, 'defaults_version', v_dv);
END $$;
"""

FAILED = """
CREATE OR REPLACE FUNCTION unwind_failed(
    p_tenant bigint, p_run bigint, p_steps jsonb, p_action bigint, p_changes jsonb, p_attempt jsonb,
    p_run_changes jsonb, p_checkpoint jsonb,
    p_ikey bytea, p_okey bytea, p_key_id text, p_at timestamptz, p_events jsonb
) RETURNS text LANGUAGE plpgsql @SETTINGS@ AS $$
DECLARE
    v_seq bigint;
    v_prev text;
    v_hashes text[];
    v_status text;
    v_pivot boolean;
    v_leased boolean;
    v_steps jsonb;
    v_moved integer;
BEGIN
    SELECT h.seq, h.hash, r.status, r.pivot_committed, r.lease_expires_at IS NOT NULL
      INTO v_seq, v_prev, v_status, v_pivot, v_leased
      @LOCK@;
    IF NOT FOUND OR v_status <> 'running' OR v_pivot OR v_leased THEN
        RETURN 'fallback';
    END IF;
    SELECT @STEPS@ INTO v_steps;
    IF v_steps <> p_steps THEN RETURN 'fallback'; END IF;
    v_hashes := unwind_chain_hashes(v_prev, v_seq, p_ikey, p_okey, p_events);
    WITH failed AS (
        UPDATE ledger_action a
           SET status = n.status, lease_owner = n.lease_owner, lease_expires_at = n.lease_expires_at,
               error_class = n.error_class, error_message = n.error_message, updated_at = n.updated_at,
               finished_at = n.finished_at
          FROM jsonb_populate_record(NULL::ledger_action, p_changes) n
         WHERE a.id = p_action AND a.run_id = p_run AND a.status = 'running' RETURNING a.id),
    ended AS (
        UPDATE ledger_attempt t
           SET finished_at = f.finished_at, outcome = f.outcome, latency_ms = f.latency_ms,
               error_class = f.error_class, error_message = f.error_message
          FROM jsonb_populate_record(NULL::ledger_attempt, p_attempt) f
         WHERE t.action_id = p_action AND t.number = f.number AND t.finished_at IS NULL),
    unwinding AS (
        UPDATE ledger_run r SET status = n.status, attention_detail = n.attention_detail, updated_at = n.updated_at
          FROM jsonb_populate_record(NULL::ledger_run, p_run_changes) n WHERE r.id = p_run),
    checkpointed AS (
        INSERT INTO ledger_checkpoint SELECT * FROM jsonb_populate_record(NULL::ledger_checkpoint, p_checkpoint)),
    @EVENTS@,
    head AS (@HEAD@)
    SELECT count(*) INTO v_moved FROM failed;
    IF v_moved <> 1 THEN RAISE EXCEPTION 'unwind: step % moved under the run lock', p_action; END IF;
    RETURN 'ok';
END $$;
"""


# Each statement of these functions keeps the one plan made for any values. Left to choose, PostgreSQL planned the
# checks again at every call: planned for the call's values they looked cheaper (an empty list of roles finds
# nothing, a key that is the empty string matches nothing), so the plan for any values was never kept. The setting
# holds only while the function runs. The fast path's guard checks it with the bodies (`CONFIG`; from 0017 on,
# `ledger.engine.plpgsql` reads it from the files).
SETTINGS = "SET plan_cache_mode = force_generic_plan"


def _filled(text: str) -> str:
    gated = EVENTS[:-1] + "\n          WHERE EXISTS (SELECT FROM inserted))"  # the proposal's: only with its action
    parts = {"@LOCK@": LOCK_HEAD_AND_RUN, "@GATED_EVENTS@": gated, "@EVENTS@": EVENTS, "@STEPS@": STEPS,
             "@DEFAULTS_VERSION@": DEFAULTS_VERSION, "@HEAD@": HEAD, "@SETTINGS@": SETTINGS,
             "@SUCCEEDED@": SUCCEEDED, "@ENDED@": ENDED}
    for name, part in parts.items():
        text = text.replace(name, part)
    assert "@" not in text, text  # every placeholder filled
    return text


CHANGED = {"unwind_propose": PROPOSE, "unwind_succeed": SUCCEED, "unwind_open_run": OPEN_RUN,
           "unwind_complete": COMPLETE, "unwind_compensated": COMPENSATED, "unwind_failed": FAILED}

# Every function by name: ledger/engine/fastpath.py fingerprints their definitions (see `fastpath.GUARD`), so what runs with
# the audit key is exactly this text.
FUNCTIONS = {"unwind_chain_hashes": CHAIN_HASHES, **{name: _filled(text) for name, text in CHANGED.items()}}
CONFIG = {name: "plan_cache_mode=force_generic_plan" for name in CHANGED}  # as pg_proc.proconfig lists it
assert set(FUNCTIONS) == set(EARLIER.FUNCTIONS) - {"unwind_chain_append"} | {"unwind_chain_hashes"}

DROP_CHAIN_APPEND = "DROP FUNCTION IF EXISTS unwind_chain_append(bigint, bytea, bytea, text, timestamptz, jsonb);"
DROP_CHAIN_HASHES = "DROP FUNCTION IF EXISTS unwind_chain_hashes(text, bigint, bytea, bytea, jsonb);"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for text in FUNCTIONS.values():  # the same arguments and answers: each replaces its 0013 version
            schema_editor.execute(text, params=None)  # no placeholders: the bodies hold "%"
        schema_editor.execute(DROP_CHAIN_APPEND, params=None)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(EARLIER.FUNCTIONS["unwind_chain_append"], params=None)
        for name in CHANGED:
            schema_editor.execute(EARLIER.FUNCTIONS[name], params=None)
        schema_editor.execute(DROP_CHAIN_HASHES, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0013_fastpath_fewer_entries"),
    ]

    operations = [migrations.RunPython(create, restore)]
