"""Guarantee 9: the audit chain verifies, and any edit or deletion — of the chain or of the ledger behind it — is detected."""
import pytest
from django.core.management import CommandError, call_command

from ledger.audit import verify_chain
from ledger.models import Action, AuditEvent, AuditHead, Run
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
