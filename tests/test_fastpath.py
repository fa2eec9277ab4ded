"""Issue 17: on PostgreSQL a step's transactions are each one call of a database function (ledger/engine/fastpath.py).

The calls must leave exactly the ledger the Python path leaves (the same rows, the same events, a chain
`verify_chain` accepts), and whenever the case is not the plain one they handle, write nothing and let the
Python path decide it. The rest of the suite runs through them too; these tests pin the parts only they can.
"""
from __future__ import annotations

import json
import re

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from ledger.engine import attempts, fastpath, plans, plpgsql, runstate, runsteps, unwind_plans, unwinding
from ledger.audit.verify import verify_chain
from ledger.errors import RunCancelled, StateConflict, ValidationFailed
from ledger.models import Action, Attempt, AuditEvent, AuditHead, Checkpoint, Run, Tenant
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.runs import completion, run_cancel, run_complete
from ledger.policy.versions import tenant_defaults_set, tool_upsert
from tests.conftest import needs_postgres
from tests.helpers import act, open_run

pytestmark = needs_postgres


@pytest.fixture(autouse=True)
def _fast_path_on(settings):
    """These tests are about the fast path: on even in the run with UNWIND_FAST_PATH=0 (tests/test_parity.py compares
    the two paths)."""
    settings.UNWIND_FAST_PATH = True

def onboard(world, goal: str) -> Run:
    run = open_run(world, goal=goal)
    user = act(run, "hr.create_user", {"email": f"{goal}@company.com", "name": goal})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    return run_complete(run=run, actor="agent:booker")


def ledger_of(run: Run, name: str) -> dict:
    """What a run left, without ids, times and fingerprints (which differ between any two runs), with `name` (in its
    arguments and results) written as NAME."""
    text = json.dumps(_ledger(run), default=str).replace(name, "NAME")
    text = re.sub(r"\b([a-z]{2,5})_[0-9a-f]{8,}\b", r"\1_ID", text)  # the sandbox's record ids
    return json.loads(re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+\+00:00", "TIME", text))  # and its times


def _ledger(run: Run) -> dict:
    actions = list(Action.objects.filter(run=run).order_by("seq").select_related("tool"))
    strip = {"tool_id", "tool_version"}
    return {
        "run": (run.status, run.pivot_committed, run.next_seq),
        "actions": [(a.seq, a.kind, a.tool.name, a.status, a.args, a.args_text, a.result, a.key_source,
                     a.attempts, a.lease_owner, a.lease_expires_at is None, a.error_class, a.before, a.after,
                     a.verification, a.content_key != "", a.defaults_version,
                     {k: v for k, v in a.compensation_plan.items() if k not in strip}) for a in actions],
        "attempts": [(t.number, t.outcome, t.finished_at is not None, t.error_class)
                     for a in actions for t in a.attempt_set.order_by("number")],
        "events": [(e.kind, e.actor, e.run_ref == run.pk, sorted(e.data)) for e in
                   AuditEvent.objects.filter(run_ref=run.pk).order_by("seq")],
        "checkpoints": [(c.label, c.state["run_status"], c.state["recovery_mode"], c.state["summary"],
                         len(c.state["completed_action_ids"]))
                        for c in Checkpoint.objects.filter(run=run).order_by("id")],
    }


def cold() -> None:
    """Forget the ids this thread's last calls drew, as after a pause: each call then has one drawn first."""
    fastpath._next_action.id = fastpath._next_run.id = fastpath._next_checkpoint.id = None


def test_the_calls_leave_the_ledger_the_python_path_leaves(tools, settings):
    cold()
    with CaptureQueriesContext(connection) as fast_queries:
        fast = onboard(tools, "fast")
    settings.UNWIND_FAST_PATH = False
    with CaptureQueriesContext(connection) as slow_queries:
        slow = onboard(tools, "slow")
    called = [q["sql"] for q in fast_queries.captured_queries if "public.unwind_" in q["sql"]]
    assert [next(name for name in ("open_run", "propose", "outcome", "complete") if f"unwind_{name}(" in sql)
            for sql in called] == ["open_run", "propose", "outcome", "propose", "outcome", "complete"]
    assert not any("public.unwind_" in q["sql"] for q in slow_queries.captured_queries)
    # Opening: the run's id, the call. Each step: the tool's read, the proposal, the success. Completing: the
    # checkpoint's id, the call.
    assert statements(fast_queries) == 2 + 2 * 3 + 2 and statements(slow_queries) > 2 * statements(fast_queries)
    assert ledger_of(fast, "fast") == ledger_of(slow, "slow")
    assert verify_chain(tools.acme.pk).ok


def statements(captured) -> int:
    """The engine's statements on the ledger: not the test's savepoints, nor the check of the functions a connection
    makes once, nor the reads of the in-process sandbox tools and of the `act` helper, which go through the ORM
    (qualified columns, which `ledger/db/sql.py` never writes)."""
    return sum(1 for q in captured.captured_queries
               if ("ledger_" in q["sql"] or "public.unwind_" in q["sql"])
               and not q["sql"].startswith(("SAVEPOINT", "RELEASE", "SELECT pg_catalog.md5"))
               and not re.search(r'"ledger_[a-z]+"\."', q["sql"]))


def test_the_chain_they_append_is_the_one_verify_checks(tools, settings):
    onboard(tools, "chained")
    report = verify_chain(tools.acme.pk)
    assert report.ok, report.problem
    made = AuditEvent.objects.filter(tenant=tools.acme, kind="forward.succeeded").order_by("-seq").first()
    AuditEvent.objects.filter(pk=made.pk).update(data={**made.data, "status_from": "failed"})
    report = verify_chain(tools.acme.pk)
    assert not report.ok and report.check == "hmac" and f"#{made.seq}" in report.problem


def test_a_key_longer_than_a_block_signs_alike(tools, settings):
    """HMAC hashes a key longer than SHA-256's 64-byte block first; the database's HMAC must too."""
    long_key = bytes(range(100))
    settings.UNWIND_AUDIT_KEYS = {**settings.UNWIND_AUDIT_KEYS, "long": long_key}
    settings.UNWIND_AUDIT_KEY_ID = "long"
    onboard(tools, "longkey")
    assert AuditEvent.objects.filter(tenant=tools.acme, key_id="long").count() >= 6
    assert verify_chain(tools.acme.pk).ok


def head_of(world) -> tuple[int, str]:
    head = AuditHead.objects.get(pk=world.acme.pk)
    return head.seq, head.hash


@pytest.mark.parametrize("moved", ["elsewhere", "its sequence"])
def test_the_chain_moves_only_the_head_its_caller_locked(tools, moved):
    """`unwind_chain_append` moves the head at the ctid its caller locked (no second look-up by the tenant): given a
    head that is not there, or no longer at the number its caller read, it raises, and its events are not kept."""
    onboard(tools, "chained")
    seq, prev = head_of(tools)
    events = AuditEvent.objects.filter(tenant=tools.acme).count()
    with connection.cursor() as cursor:
        cursor.execute("SELECT ctid FROM ledger_audithead WHERE tenant_id = %s FOR NO KEY UPDATE", [tools.acme.pk])
        (head,) = cursor.fetchone()
        if moved == "elsewhere":
            head, seq_told = "(4294967295,1)", seq
        else:
            seq_told = seq - 1
        with pytest.raises(Exception, match="not where its caller locked it"), transaction.atomic():
            cursor.execute("SELECT unwind_chain_append(%s, %s::tid, %s, %s, %s, %s, 'k', now(), %s::jsonb)",
                           [tools.acme.pk, head, seq_told, prev, b"i" * 64, b"o" * 64,
                            json.dumps([["run.note", "agent:x", None, None, "{}", "a", "b"]])])
    assert head_of(tools) == (seq, prev) and AuditEvent.objects.filter(tenant=tools.acme).count() == events


def test_a_cancelled_run_is_refused_by_the_python_path(tools):
    run = open_run(tools)
    run_cancel(run=run, actor="agent:booker")
    before = head_of(tools)
    with pytest.raises(RunCancelled):
        action_propose(run=run, tool_name="hr.create_user", args={"email": "a@b.io", "name": "A"}, actor="agent:x")
    assert head_of(tools) == before and not Action.objects.filter(run=run).exists()


def test_a_run_marked_cancelled_but_still_running_takes_no_step_from_the_call(tools):
    """The services move a cancelled run out of running in the cancel's own commit, so only a write outside them (an
    insider's, or a path yet to come) leaves it running with its cancel recorded. The call still sees the cancel
    under its lock and writes nothing; the Python path refuses the step."""
    from django.utils import timezone

    run = open_run(tools)
    act(run, "hr.create_user", {"email": "c@b.io", "name": "C"})  # the tool is kept, the next id drawn
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())  # the caller's copy predates it
    before = head_of(tools)
    with pytest.raises(RunCancelled):
        action_propose(run=run, tool_name="hr.create_user", args={"email": "d@b.io", "name": "D"}, actor="agent:x")
    assert head_of(tools) == before and Action.objects.filter(run=run).count() == 1


def test_a_threshold_changed_after_the_read_falls_back_with_nothing_written(tools):
    """The approval decision used the threshold read with the tool; changed since, the call writes nothing."""
    from ledger.canonical import digest
    from ledger.engine.proposal import compensation_plan_of

    run = open_run(tools)
    tool, action_id, threshold, twin = fastpath.current_tool(tools.acme.pk, "hr.create_user")
    proposal_run = Run.objects.get(pk=run.pk)
    action = Action(pk=action_id, tenant_id=run.tenant_id, run=proposal_run, seq=0, kind="forward", tool=tool,
                    saga_role=tool.saga_role, risk=tool.risk, args={}, args_hash=digest({}), idempotency_key="k-1",
                    key_source="header", status="running", attempts=1, max_attempts=1, lease_owner="me",
                    intent={}, compensation_plan=compensation_plan_of(tool, run.tenant_id, twin=twin))
    before = head_of(tools), proposal_run.next_seq
    stale = "low" if threshold != "low" else "high"
    def guards(threshold):  # the run as read, without steps, and the threshold the decision used
        return fastpath.ProposeGuards(run_status=proposal_run.status, cancelled=False, step=proposal_run.next_seq,
                                      steps=runsteps.guard([]), threshold=threshold, key_free_in=(0,))

    assert fastpath.propose(action, guards=guards(stale), owner="me", actor="agent:x",
                            event={"tool": tool.name, "key_source": "header"}) == ("stale", None)
    assert (head_of(tools), Run.objects.get(pk=run.pk).next_seq) == before
    assert not Action.objects.filter(pk=action_id).exists()
    assert fastpath.propose(action, guards=guards(threshold), owner="me", actor="agent:x",
                            event={"tool": tool.name, "key_source": "header"}) == ("ok", None)
    assert Action.objects.get(pk=action_id).seq == before[1] and Attempt.objects.filter(action_id=action_id).exists()
    assert verify_chain(tools.acme.pk).ok


def test_a_success_on_an_action_someone_else_moved_writes_nothing(tools):
    """The outcome's conditional update must move exactly one row; otherwise the Python path says why."""
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "m@b.io", "name": "M"},
                              actor="agent:x")
    Action.objects.filter(pk=proposal.action.pk).update(status="lost")  # behind the engine's back
    before = head_of(tools)
    with pytest.raises(StateConflict):
        execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)
    assert head_of(tools) == before
    assert Attempt.objects.get(action_id=proposal.action.pk).finished_at is None
    assert Action.objects.get(pk=proposal.action.pk).status == "lost"


def _decided(run: Run, **copy_says) -> plans.Completion:
    """What `run_complete` decides for `run` as the ledger has it now (or as a copy that says `copy_says` has it), with
    its checkpoint's id drawn, as the call gets it."""
    read, steps = runsteps.run_with_steps(run.pk)
    for field, value in copy_says.items():
        setattr(read, field, value)
    return completion(read, steps, actor="agent:booker").numbered(fastpath.checkpoint_id())


def test_a_run_with_a_step_in_flight_since_the_decision_is_not_completed_by_the_call(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "s@b.io", "name": "S"})
    plan = _decided(run)
    Action.objects.filter(run=run).update(status="running")  # a step back in flight since the caller looked
    before = head_of(tools)
    assert fastpath.complete(plan) == plans.STALE
    assert head_of(tools) == before and Run.objects.get(pk=run.pk).status == "running"
    assert not Checkpoint.objects.filter(pk=plan.checkpoint.pk).exists()
    with pytest.raises(StateConflict, match="still running"):
        run_complete(run=run, actor="agent:booker")


@pytest.mark.parametrize("field, value", [("goal", "another goal"), ("on_behalf_of", "mallory@company.com"),
                                          ("intent", {"ticket": "other"}), ("plan", ["hr.create_user"]),
                                          ("pivot_committed", True), ("agent_id", None)])
def test_a_copy_that_differs_from_the_run_in_a_fingerprinted_field_completes_nothing(tools, field, value):
    """The events are built from the caller's copy of the run; a copy that no longer says what the run holds (in a
    field the completion's fingerprint covers) makes the call write nothing ('stale'), and the completion decided
    again from a fresh read completes the run."""
    run = open_run(tools, goal="as opened", intent={"ticket": "T-1"})
    act(run, "hr.create_user", {"email": "f@b.io", "name": "F"})
    plan = _decided(run, **{field: value})
    before = head_of(tools)
    assert fastpath.complete(plan) == plans.STALE
    assert head_of(tools) == before and Run.objects.get(pk=run.pk).status == "running"
    assert not Checkpoint.objects.filter(pk=plan.checkpoint.pk).exists()
    assert run_complete(run=Run.objects.get(pk=run.pk), actor="agent:booker").status == "completed"
    assert verify_chain(tools.acme.pk).ok


def test_a_checkpoint_id_drawn_before_the_runs_newest_checkpoint_is_not_used(tools):
    """The run's checkpoints are read in id order (the newest is the one resumed from): an id drawn before a
    checkpoint of the run was written would file the completion's before it."""
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "c@b.io", "name": "C"})
    plan = _decided(run)
    newer = Checkpoint.objects.create(tenant_id=run.tenant_id, run_id=run.pk, label="resumed", state={})
    assert newer.pk > plan.checkpoint.pk
    before = head_of(tools)
    assert fastpath.complete(plan) == plans.STALE
    assert head_of(tools) == before and not Checkpoint.objects.filter(pk=plan.checkpoint.pk).exists()
    done = run_complete(run=run, actor="agent:booker")
    assert done.status == "completed" and done.checkpoints.order_by("-id").first().label == "completed"


def test_the_completions_checkpoint_is_the_one_the_python_path_builds(tools):
    """The completion's checkpoint is decided in Python from the steps the caller holds, and `unwind_complete` writes
    it as given: for every kind of step a completed run may hold (here moved behind the caller's back, so its
    decision from the steps it held is found stale and made again), it says what `runstate.checkpoint_state` says of
    the steps as stored, and the run the call answers is the run as stored."""
    run = open_run(tools, goal="mixed")
    moved = ("failed", "lost", "compensated", "compensation_failed", "rejected", "expired", "skipped")
    steps = [act(run, "hr.create_user", {"email": f"m{i}@b.io", "name": f"M{i}"}) for i in range(len(moved) + 1)]
    for step, status in zip(steps[1:], moved):
        Action.objects.filter(pk=step.pk).update(status=status)  # (behind the chain's back: only the state is checked)
    cold()
    done = run_complete(run=run, actor="agent:booker")
    checkpoint = Checkpoint.objects.filter(run=run).order_by("-id").first()
    assert checkpoint.label == "completed"
    assert checkpoint.state == runstate.checkpoint_state(done, runstate.run_steps(run.pk))
    assert checkpoint.state["pending_action_ids"] == [steps[1].pk, steps[2].pk]
    stored = Run.objects.get(pk=run.pk)
    assert {f.attname: getattr(done, f.attname) for f in Run._meta.concrete_fields} == \
        {f.attname: getattr(stored, f.attname) for f in Run._meta.concrete_fields}


def test_a_run_without_steps_completes_with_the_python_paths_checkpoint(tools):
    run = open_run(tools, goal="empty")
    done = run_complete(run=run, actor="agent:booker")
    state = Checkpoint.objects.get(run=run).state
    assert done.status == "completed" and state == runstate.checkpoint_state(done, [])
    assert state["summary"] == "no actions yet"


def test_a_completion_soon_after_another_takes_the_checkpoint_id_the_last_one_drew(tools):
    onboard(tools, "earlier")
    reserved = fastpath._next_checkpoint.id
    run = open_run(tools, goal="later")
    act(run, "hr.create_user", {"email": "later@b.io", "name": "L"})
    with CaptureQueriesContext(connection) as queries:
        run_complete(run=run, actor="agent:booker")
    assert Checkpoint.objects.get(pk=reserved).run_id == run.pk
    assert statements(queries) == 1


def onboard_and_fail(world, goal: str) -> Run:
    """Two steps, then a refusal the tool's policy unwinds (email.send: on_refusal unwind) on its first attempt."""
    from tests.helpers import fault

    run = open_run(world, goal=goal)
    user = act(run, "hr.create_user", {"email": f"{goal}@company.com", "name": goal})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=422)
    act(run, "email.send", {"to": f"{goal}@home.example", "subject": "Welcome", "body": "Hi"})
    run.refresh_from_db()
    return run


def test_a_failure_and_its_unwind_leave_the_ledger_the_python_path_leaves(tools, settings):
    from sandbox.models import Fault

    with CaptureQueriesContext(connection) as fast_queries:
        fast = onboard_and_fail(tools, "fastfail")
    Fault.objects.all().delete()
    settings.UNWIND_FAST_PATH = False
    with CaptureQueriesContext(connection) as slow_queries:
        slow = onboard_and_fail(tools, "slowfail")
    assert fast.status == slow.status == "compensated"
    # The two undos' seals (sealed.check_undo) are read once for the unwind, by the run, on either path.
    for queries in (fast_queries, slow_queries):
        seal_reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT e.")
                      and "e.kind IN ('forward.succeeded'" in q["sql"]]
        assert len(seal_reads) == 1 and "e.run_ref =" in seal_reads[0], seal_reads
    called = [name for q in fast_queries.captured_queries for name in ("outcome", "compensated")
              if f"unwind_{name}(" in q["sql"]]
    # The two successes and the failure, one writer; the lease with the first undo; the second undo; the settling.
    assert called == ["outcome", "outcome", "outcome", "compensated", "compensated", "compensated"]
    # The run is read once, before the failure: the lease and each undo start from what the call before them left
    # (and are checked again under the locks).
    assert sum("WITH ids AS MATERIALIZED" in q["sql"] for q in fast_queries.captured_queries) == 1
    assert ledger_of(fast, "fastfail") == ledger_of(slow, "slowfail")
    assert verify_chain(tools.acme.pk).ok


def test_the_run_an_unwind_answers_is_the_run_as_recorded(tools):
    """The settling call's run is the unwind's answer (no re-read, no lease to release): it must be the row as it
    is, every field of it."""
    from tests.helpers import fault

    run = open_run(tools, goal="answer")
    user = act(run, "hr.create_user", {"email": "answer@company.com", "name": "A"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=422)
    proposal = action_propose(run=run, tool_name="email.send", args={"to": "a@home.example", "subject": "W",
                                                                      "body": "Hi"}, actor="agent:booker")
    execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True)
    with CaptureQueriesContext(connection) as queries:
        answered = execution.unwind(run.pk, tenant_id=run.tenant_id)
    statements = [q["sql"] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]]  # the test's transaction
    assert "unwind_compensated(" in statements[-1]  # the settling call was the last statement
    fields = [field.attname for field in Run._meta.concrete_fields]
    fresh = Run.objects.get(pk=run.pk)
    assert answered.status == "compensated"
    assert {name: getattr(answered, name) for name in fields} == {name: getattr(fresh, name) for name in fields}


def test_a_failure_its_caller_cannot_unwind_now_goes_to_the_worker(tools, django_capture_on_commit_callbacks):
    """The one-call failure queues no unwind (its caller unwinds next); a caller whose time is up says so, and the
    unwind is queued. The tests run queued tasks at once (UNWIND_TASKS_SYNC)."""
    from tests.helpers import fault

    run = open_run(tools, goal="later")
    act(run, "hr.create_user", {"email": "later@company.com", "name": "L"})
    fault("email.send", "status", status=422)
    proposal = action_propose(run=run, tool_name="email.send", args={"to": "l@home.example", "subject": "W",
                                                                      "body": "Hi"}, actor="agent:booker")
    with django_capture_on_commit_callbacks(execute=True) as queued:
        execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True)
    assert not queued and Run.objects.get(pk=run.pk).status == "unwinding"
    with django_capture_on_commit_callbacks(execute=True) as queued:
        unwinding.unwind_elsewhere(run.pk)
        unwinding.unwind_elsewhere(run.pk)  # told twice: queued once
    assert len(queued) == 1 and Run.objects.get(pk=run.pk).status == "compensated"
    assert verify_chain(tools.acme.pk).ok


def test_an_undo_recorded_on_stale_facts_writes_nothing(tools):
    """The unwinder chose the next undo from what it read; a step that moved since makes the call write nothing."""
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "u@b.io", "name": "U"})
    Run.objects.filter(pk=run.pk).update(status="unwinding")
    plan = unwind_plans.claimed(unwinding.UnwindState.read(run.pk), owner="unwinder")
    assert plan.claim is not None and plan.claim.undo.pk is not None
    Action.objects.filter(run=run).update(status="compensating")  # moved since the read
    before = head_of(tools)
    assert fastpath.compensated(plan) == plans.STALE
    assert head_of(tools) == before and Run.objects.get(pk=run.pk).status == "unwinding"
    assert Run.objects.get(pk=run.pk).lease_expires_at is None
    assert not Action.objects.filter(pk=plan.claim.undo.pk).exists()


def test_a_second_unwinder_does_not_take_a_held_lease(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "l@b.io", "name": "L"})
    held = attempts.lease_until()
    Run.objects.filter(pk=run.pk).update(status="unwinding", lease_expires_at=held)
    before = head_of(tools)
    assert unwind_plans.claim_unwind(run.pk, tenant_id=run.tenant_id, owner="other") == (False, None)
    assert head_of(tools) == before and Run.objects.get(pk=run.pk).lease_expires_at == held
    # The same race inside the call: read while the lease was free, taken by another unwinder before the call.
    Run.objects.filter(pk=run.pk).update(lease_expires_at=None)
    plan = unwind_plans.claimed(unwinding.UnwindState.read(run.pk), owner="unwinder")
    Run.objects.filter(pk=run.pk).update(lease_expires_at=held)
    assert fastpath.compensated(plan) == plans.STALE
    assert head_of(tools) == before and Run.objects.get(pk=run.pk).lease_expires_at == held


def test_a_function_replaced_to_keep_the_key_is_never_called_with_it(tools, caplog):
    """Someone with the database's credentials replaces the chain's function with one that keeps the key it is
    passed. The guard in the calling statement sees the definition changed and never calls it: nothing is kept, the
    steps take the Python path, and the chain still verifies."""
    assert onboard(tools, "before").status == "completed"  # this connection has checked the functions: the guard's turn
    installed = plpgsql.functions()["unwind_chain_hashes"].text
    keeping = installed.replace("BEGIN\n", "BEGIN\n    INSERT INTO public.kept_keys VALUES (p_ikey, p_okey);\n", 1)
    assert keeping != installed
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE public.kept_keys (ikey bytea, okey bytea)")
        cursor.execute(keeping)  # CREATE OR REPLACE: the same name and arguments, a body that keeps the key
    try:
        run = onboard(tools, "guarded")
        assert run.status == "completed"
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM public.kept_keys")
            assert cursor.fetchone()[0] == 0
        assert fastpath._altered and "differ from those" in caplog.text
        assert AuditEvent.objects.filter(run_ref=run.pk).count() >= 6 and verify_chain(tools.acme.pk).ok
    finally:
        fastpath._altered = False  # the test's transaction rolls the function back


def test_a_function_whose_settings_changed_is_not_called(tools, caplog):
    """The functions run with the settings the migration gave them (`plan_cache_mode`), which are part of what the
    connection checks: with one of them reset, the functions are not called with the key."""
    assert onboard(tools, "before").status == "completed"
    with connection.cursor() as cursor:
        cursor.execute("ALTER FUNCTION unwind_outcome RESET plan_cache_mode")
    try:
        run = onboard(tools, "reset")
        assert run.status == "completed"
        assert fastpath._altered and "differ from those" in caplog.text
        assert verify_chain(tools.acme.pk).ok
    finally:
        fastpath._altered = False  # the test's transaction rolls the change back


# --- the tools a process keeps (fastpath.kept_tool): the call checks them, so nothing stale is ever recorded ---

def _spec(name: str) -> dict:
    from tests.conftest import in_process_policy

    return in_process_policy()["tools"][name]


def _propose_now(run, tool: str, args: dict):
    """A proposal right after another on this thread: the kept tool and the id its call drew are both used."""
    return action_propose(run=run, tool_name=tool, args=args, actor="agent:booker")


def test_a_kept_tool_is_used_and_checked_by_the_call(tools):
    run = open_run(tools, goal="kept")
    act(run, "hr.create_user", {"email": "k1@company.com", "name": "K"})  # reads the tool, keeps it, draws an id
    reserved = fastpath._next_action.id
    with CaptureQueriesContext(connection) as queries:
        proposal = _propose_now(run, "hr.create_user", {"email": "k2@company.com", "name": "K"})
    assert proposal.action.pk == reserved
    assert not any("FROM ledger_tool WHERE" in q["sql"] for q in queries.captured_queries)  # no read first


def test_a_tool_changed_since_it_was_kept_binds_the_new_version(tools):
    run = open_run(tools, goal="newer")
    act(run, "hr.create_user", {"email": "n1@company.com", "name": "N"})
    spec = {**_spec("hr.create_user"), "retry": {"max_attempts": 5, "backoff": 0.2}}
    newer, _ = tool_upsert(tenant=tools.acme, name="hr.create_user", spec=spec, actor="user:adam")
    proposal = _propose_now(run, "hr.create_user", {"email": "n2@company.com", "name": "N"})
    assert proposal.action.tool_id == newer.pk and proposal.action.max_attempts == 5
    assert Action.objects.get(pk=proposal.action.pk).tool_id == newer.pk


def test_a_twin_changed_since_the_tool_was_kept_is_bound_as_it_is_now(tools):
    run = open_run(tools, goal="twin")
    act(run, "hr.create_user", {"email": "t1@company.com", "name": "T"})
    spec = {**_spec("hr.delete_user"), "retry": {"max_attempts": 2, "backoff": 0.2}}
    twin, _ = tool_upsert(tenant=tools.acme, name="hr.delete_user", spec=spec, actor="user:adam")
    proposal = _propose_now(run, "hr.create_user", {"email": "t2@company.com", "name": "T"})
    plan = Action.objects.get(pk=proposal.action.pk).compensation_plan
    assert (plan["tool_id"], plan["tool_version"]) == (twin.pk, twin.version)


def test_a_threshold_lowered_since_the_tool_was_kept_gates_the_next_step(tools):
    """The attack a stale cache would allow: the tenant lowers its approval threshold (every low-risk step now
    needs a person) and the agent proposes at once, hoping the process still decides from what it kept."""
    run = open_run(tools, goal="gate")
    act(run, "hr.create_user", {"email": "g1@company.com", "name": "G"})
    tenant_defaults_set(tenant=tools.acme, values={"approval_threshold": "low"}, actor="user:ada")
    proposal = _propose_now(run, "hr.create_user", {"email": "g2@company.com", "name": "G"})
    recorded = Action.objects.get(pk=proposal.action.pk)
    assert not proposal.claimed and recorded.status == "awaiting_approval" and recorded.attempts == 0
    assert verify_chain(tools.acme.pk).ok


def test_arguments_valid_only_for_the_kept_version_are_refused(tools):
    run = open_run(tools, goal="schema")
    act(run, "hr.create_user", {"email": "s1@company.com", "name": "S"})
    spec = _spec("hr.create_user")
    spec["args_schema"]["properties"]["name"]["maxLength"] = 3
    tool_upsert(tenant=tools.acme, name="hr.create_user", spec=spec, actor="user:adam")
    with pytest.raises(ValidationFailed):
        _propose_now(run, "hr.create_user", {"email": "s2@company.com", "name": "Too long"})
    assert not Action.objects.filter(run=run, args__email="s2@company.com").exists()


def test_an_id_drawn_long_ago_is_not_used(tools):
    run = open_run(tools, goal="late")
    act(run, "hr.create_user", {"email": "l1@company.com", "name": "L"})
    reserved = fastpath._next_action.id
    fastpath._next_action.at -= fastpath.NEXT_ID_SECONDS + 1
    proposal = _propose_now(run, "hr.create_user", {"email": "l2@company.com", "name": "L"})
    assert proposal.action.pk > reserved


def test_arguments_valid_only_for_the_new_version_are_taken(tools):
    run = open_run(tools, goal="wider")
    act(run, "hr.create_user", {"email": "w1@company.com", "name": "W"})
    spec = _spec("hr.create_user")
    spec["args_schema"]["properties"]["team"] = {"type": "string"}
    newer, _ = tool_upsert(tenant=tools.acme, name="hr.create_user", spec=spec, actor="user:adam")
    proposal = _propose_now(run, "hr.create_user", {"email": "w2@company.com", "name": "W", "team": "ops"})
    assert Action.objects.get(pk=proposal.action.pk).tool_id == newer.pk


def test_a_slug_changed_since_the_tool_was_kept_signs_with_the_new_one(tools):
    run = open_run(tools, goal="slug")
    act(run, "hr.create_user", {"email": "u1@company.com", "name": "U"})
    Tenant.objects.filter(pk=tools.acme.pk).update(slug="acme-renamed")
    run = Run.objects.get(pk=run.pk)  # as the API reads it for each request
    proposal = _propose_now(run, "hr.create_user", {"email": "u2@company.com", "name": "U"})
    assert proposal.action.tool.tenant.slug == "acme-renamed"


def test_a_run_opened_soon_after_another_takes_the_id_the_last_opening_drew(tools):
    open_run(tools, goal="first")
    reserved = fastpath._next_run.id
    with CaptureQueriesContext(connection) as queries:
        run = open_run(tools, goal="second")
    assert run.pk == reserved and Run.objects.get(pk=reserved).goal == "second"
    assert not any("nextval" in q["sql"] and "ledger_run" in q["sql"] and "unwind_open_run" not in q["sql"]
                   for q in queries.captured_queries)  # no id drawn first
    assert fastpath._next_run.id not in (None, reserved)


def test_a_run_id_drawn_long_ago_is_not_used(tools):
    open_run(tools, goal="early")
    reserved = fastpath._next_run.id
    fastpath._next_run.at -= fastpath.NEXT_ID_SECONDS + 1
    assert open_run(tools, goal="late").pk > reserved
    assert not Run.objects.filter(pk=reserved).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fast", [True, False], ids=["function", "python"])
def test_a_proposal_that_waited_on_a_lock_gets_its_whole_lease(fast, settings, _engine_settings):
    """Issue 32: the lease runs from when the proposal holds its locks, on both paths. Held up on the chain head's
    lock for longer than the lease, the step used to be inserted with its lease already run out, and the sweep
    reclaimed a step its caller was about to send."""
    import threading
    import time

    from django.db import connections, transaction

    from ledger.policy.versions import tools_load
    from tests.conftest import World, in_process_policy, seed_sandboxes

    settings.UNWIND_FAST_PATH = fast
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    spec = dict(in_process_policy()["tools"]["hr.create_user"], timeout=0.5)  # a lease of 1.5 s
    tool_upsert(tenant=world.acme, name="hr.create_user", spec=spec, actor="test")
    run = open_run(world)
    locked, release = threading.Event(), threading.Event()

    def hold_the_head():
        try:
            with transaction.atomic():
                AuditHead.objects.select_for_update().get(tenant=world.acme)
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_head)
    holder.start()
    assert locked.wait(10)
    threading.Timer(2.0, release.set).start()
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "w@company.com", "name": "W"},
                              actor="agent:booker", inline=True)
    committed = time.time()
    holder.join()
    assert release.is_set()  # it did wait for the lock
    lease = Action.objects.get(pk=proposal.action.pk).lease_expires_at.timestamp()
    assert lease - committed > 1.0, (lease - committed)


def test_the_functions_digest_of_a_runs_steps_is_pythons(tools):
    """`unwind_run_steps` (what every writer compares under its locks) and `runsteps.guard` (what a decision sends)
    digest a run's steps alike: none, several, and after one moved; and a move changes the digest."""
    from ledger.db import sql

    def in_sql(run_id):
        return sql.fetch_one("SELECT unwind_run_steps(%s)", [run_id])[0]

    run = open_run(tools)
    assert json.loads(in_sql(run.pk)) == runsteps.guard([]) == runsteps.guard(runsteps.read(run.pk))
    act(run, "hr.create_user", {"email": "d1@b.io", "name": "D"})
    second = act(run, "hr.create_user", {"email": "d2@b.io", "name": "E"})
    before = runsteps.guard(runsteps.read(run.pk))
    assert json.loads(in_sql(run.pk)) == before
    Action.objects.filter(pk=second.pk).update(status="failed")
    assert json.loads(in_sql(run.pk)) == runsteps.guard(runsteps.read(run.pk)) != before
