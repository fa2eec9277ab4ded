"""Guarantee 2: every run ends completed, compensated, or needs_attention with an open recovery item."""
from recovery.models import RecoveryItem
from tests.helpers import acme, act, fault, open_run


def test_failure_after_the_pivot_opens_a_recovery_item_naming_what_is_left(tools):
    tools.acme.approval_threshold = "critical"
    tools.acme.save()
    run = open_run(tools)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    act(run, "payments.charge", {"customer": "cus_1", "amount_cents": 5000})
    fault("email.send", "status", status=503, times=0)
    mail = act(run, "email.send", {"to": "p@x.io", "subject": "Booked", "body": "ok"})
    run.refresh_from_db()
    assert mail.status == "failed" and mail.attempts == mail.max_attempts
    assert run.status == "needs_attention"
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "step_failed" and "email.send" in item.detail and "after the pivot" in item.detail
    assert item.action_id == mail.pk


def test_a_compensation_that_keeps_failing_leaves_the_run_in_the_queue_not_failed(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    user2 = act(run, "hr.create_user", {"email": "b@x.io", "name": "B"})
    fault("hr.delete_user", "status", status=500, times=0)
    fault("licenses.provision", "status", status=400, times=1)
    act(run, "licenses.provision", {"user_id": user2.result["id"]})
    run.refresh_from_db()
    assert run.status == "needs_attention"
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "compensation_failed"
    assert item.detail.count("could not be compensated") == 2


def test_completed_and_compensated_runs_have_no_open_item(tools):
    from ledger.engine.runs import run_complete

    ok = open_run(tools)
    act(ok, "hr.create_user", {"email": "a@x.io", "name": "A"})
    run_complete(run=ok, actor="agent:booker")
    bad = open_run(tools)
    act(bad, "hr.create_user", {"email": "b@x.io", "name": "B"})
    fault("travel.reserve_hotel", "status", status=409)
    act(bad, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    bad.refresh_from_db()
    ok.refresh_from_db()
    assert (ok.status, bad.status) == ("completed", "compensated")
    assert not RecoveryItem.objects.exists()


def test_a_step_that_acted_early_and_was_refused_later_is_read_back_not_failed(tools):
    """The first attempt took effect but answered 502; the retries then got 429s. The last error alone says
    'not carried out', but an earlier one may have acted: the step is read back, found, and recorded."""
    from sandbox.selectors import record_get

    fault("crm.update_ticket", "error_after_effect", status=502, times=1)
    fault("crm.update_ticket", "status", status=429, nth=2, times=5)
    run = open_run(tools)
    change = act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    run.refresh_from_db()
    assert record_get("tickets", "T-204", tenant=acme())["priority"] == "high"
    assert change.status == "succeeded" and change.verification["read_back"]["by"] == "target"
    assert change.result["priority"] == "high"  # the ticket as read back: the record is the result
    assert run.status == "running"


def test_an_undo_whose_outcome_is_unknown_puts_the_run_before_a_person(tools, django_capture_on_commit_callbacks):
    """Found by chaos (seed 872911): a compensation reclaimed after a lost worker got no answer and could not be read
    back, so it ended lost; the next unwinder found its step still compensating and waited for good, leaving the run
    unwinding with nothing in the recovery queue. It must go to a person, naming the undo that may have acted."""
    from ledger.db import sql
    from ledger.engine import outcomes, runstate, unwind_plans, unwinding
    from ledger.audit.chain import ledger_transaction
    from ledger.executors.call import ToolError
    from ledger.models import Run
    from ledger.engine import execution

    run = open_run(tools)
    act(run, "hr.create_user", {"email": "lost-undo@x.io", "name": "L"})
    with django_capture_on_commit_callbacks(execute=False):
        with ledger_transaction(run.tenant_id) as log:
            runstate.start_unwind(sql.get_locked(Run, run.pk), "test: unwind", log=log, actor="test", cause="operator")
        claimed, undo = unwind_plans.claim_unwind(run.pk, tenant_id=run.tenant_id, owner="unwinder-1#")
        assert claimed and undo is not None
        outcomes.record_unknown(undo, ToolError("no answer", transient=True), why="it cannot be read back",
                                 latency_ms=None, actor="system:engine")
    Run.objects.filter(pk=run.pk).update(lease_expires_at=None)  # that unwinder is gone
    assert execution.unwind(run.pk).status == "needs_attention"
    item = RecoveryItem.objects.get(run=run)
    assert item.reason in ("outcome_unknown", "lease_lost") and "hr.delete_user" in item.detail
