"""Guarantee 9: the audit chain verifies, and any edit or deletion — of the chain or of the ledger behind it — is detected."""
import pytest
from django.core.management import CommandError, call_command

from ledger.db import sql
from ledger.audit.chain import ledger_transaction
from ledger.audit.verify import verify_chain
from ledger.models import Action, Attempt, AuditEvent, AuditHead, Run
from tests.helpers import act, fault, open_run


@pytest.fixture
def history(tools):
    run = open_run(tools)
    user = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    fault("email.send", "status", status=500, times=0)
    act(run, "email.send", {"to": "a@x.io", "subject": "Hi", "body": "b"})
    return tools


def problem(world):
    report = verify_chain(world.acme.pk)
    assert not report.ok
    return report.problem


def test_an_untouched_chain_verifies(history, capsys):
    report = verify_chain(history.acme.pk)
    assert report.ok and report.events > 20
    call_command("verify_audit")
    assert capsys.readouterr().out.startswith("ok: ")


def test_every_transition_is_recorded(history):
    kinds = set(AuditEvent.objects.filter(tenant=history.acme).values_list("kind", flat=True))
    assert {"run.opened", "forward.proposed", "forward.succeeded", "forward.failed", "run.unwinding",
            "compensation.succeeded", "forward.compensated", "run.compensated"} <= kinds


def test_an_edited_event_is_detected(history):
    event = AuditEvent.objects.filter(tenant=history.acme, kind="forward.succeeded").first()
    AuditEvent.objects.filter(pk=event.pk).update(actor="user:nobody")
    assert f"event #{event.seq}" in problem(history) and "edited" in problem(history)


def test_a_deleted_event_is_detected(history):
    event = AuditEvent.objects.filter(tenant=history.acme).order_by("seq")[5]
    AuditEvent.objects.filter(pk=event.pk).delete()
    assert "missing" in problem(history)


def test_removing_the_newest_events_is_detected(history):
    newest = AuditEvent.objects.filter(tenant=history.acme).order_by("-seq").first()
    AuditEvent.objects.filter(pk=newest.pk).delete()
    assert "removed" in problem(history)


def test_a_ledger_row_edited_behind_the_services_back_is_detected(history):
    action = Action.objects.filter(tenant=history.acme, status="compensated").first()
    Action.objects.filter(pk=action.pk).update(status="succeeded")
    assert f"action {action.pk}" in problem(history)


def test_a_run_edited_or_a_ledger_row_deleted_is_detected(history):
    run = Run.objects.get(tenant=history.acme)
    Run.objects.filter(pk=run.pk).update(status="completed")
    assert f"run {run.pk}" in problem(history)
    Run.objects.filter(pk=run.pk).update(status="compensated")
    assert verify_chain(history.acme.pk).ok
    Action.objects.filter(run=run, kind="compensation").first().delete()
    assert "deleted" in problem(history)


def test_the_command_names_the_first_broken_link(history):
    AuditHead.objects.filter(tenant=history.acme).update(seq=1)
    with pytest.raises(CommandError, match="tenant acme: broken at"):
        call_command("verify_audit")


def test_every_attempt_is_written_with_the_commit_that_makes_it(history):
    """Attempt rows ride in the audit append's statement: each action has exactly its attempts, all closed."""
    for action in Action.objects.filter(tenant=history.acme).exclude(attempts=0):
        numbers = list(Attempt.objects.filter(action=action).order_by("number").values_list("number", "outcome"))
        assert [n for n, _ in numbers] == list(range(1, action.attempts + 1)), action
        assert all(outcome for _, outcome in numbers), (action, numbers)
    assert verify_chain(history.acme.pk).ok


def test_a_nested_ledger_transaction_that_rolls_back_takes_its_events_and_writes_with_it(history):
    run = Run.objects.get(tenant=history.acme)
    with ledger_transaction(history.acme.pk) as outer:
        outer.record("test.kept", actor="test", run=run)
        with pytest.raises(RuntimeError):
            with ledger_transaction(history.acme.pk) as inner:
                inner.record("test.dropped", actor="test", run=run)
                inner.write_at_commit(sql.update_statement(Run, {"pk": run.pk}, goal="dropped"))
                raise RuntimeError("the inner block fails")
    kinds = set(AuditEvent.objects.filter(tenant=history.acme).values_list("kind", flat=True))
    assert "test.kept" in kinds and "test.dropped" not in kinds
    assert Run.objects.get(pk=run.pk).goal != "dropped"
    assert verify_chain(history.acme.pk).ok


def test_verifying_reads_the_steps_in_a_few_statements_however_many_there_are(history):
    """verify_audit once read each step's `approvals_required` with a query of its own (left out of the columns its
    seal checks load): 3,303 statements for 3,300 steps, most of its time at a million."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def statements():
        with CaptureQueriesContext(connection) as captured:
            assert verify_chain(history.acme.pk).ok
        return len(captured)

    few = statements()
    run = open_run(history)
    for n in range(4):
        act(run, "hr.create_user", {"email": f"v{n}@x.io", "name": "V"})
    assert statements() == few
