"""One decision per run (issue 29): compensating a run whose last step has an unknown outcome asks what became of
that step on the same page, and settles the whole run at once instead of bringing it back for a second decision."""
import pytest

from ledger.executors.call import ToolError
from ledger.models import Action, AuditEvent
from ledger.engine import execution, outcomes
from ledger.engine.proposal import action_propose
from recovery.models import RecoveryItem
from recovery.services import recovery_compensate
from sandbox.selectors import call_list
from tests.helpers import acme, act, open_run
from tests.test_console_item import item_url
from tests.test_console_queue import client_for, csrf_token

EMAIL = {"to": "carol@example.com", "subject": "Ticket escalated", "body": "We escalated it."}


def unknown_last_step(world):
    """A ticket escalated (done), then an email whose outcome is unknown: the run waits for a person."""
    run = open_run(world, goal="Escalate and tell the customer")
    ticket = act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    proposal = action_propose(run=run, tool_name="email.send", args=EMAIL, actor="agent:booker")
    outcomes.record_unknown(proposal.action, ToolError("no answer", transient=True), why="its outbox is unreadable",
                             latency_ms=None, actor="system:engine")
    run.refresh_from_db()
    assert run.status == "needs_attention"
    return run, ticket, Action.objects.get(pk=proposal.action.pk), RecoveryItem.objects.get(run=run, status="open")


def emails(subject):
    return [c for c in call_list(tenant=acme(), tool="email.send")["results"]
            if c["effect_applied"] and c["args"]["subject"] == subject]


def test_the_compensate_page_asks_about_the_unknown_step_and_settles_the_run_at_once(tools):
    run, ticket, email, item = unknown_last_step(tools)
    oscar = client_for(tools.oscar, csrf=True)
    page = oscar.get(item_url(item, "compensate")).content.decode()
    assert "it happened: undo it" in page and "it did not happen" in page and "leave it to me" in page
    assert f"step {email.seq}" in page
    token = csrf_token(oscar, item_url(item, "compensate"))
    refused = oscar.post(item_url(item, "compensate"), {"reason": "checked", "csrfmiddlewaretoken": token})
    assert refused.status_code == 400 and b"Say what became of the step" in refused.content
    run.refresh_from_db()
    assert run.status == "needs_attention"  # nothing was decided
    done = oscar.post(item_url(item, "compensate"), {"reason": "the relay shows no such message",
                                                     "unknown": "not_happened", "csrfmiddlewaretoken": token})
    assert done.status_code == 302
    run.refresh_from_db()
    email.refresh_from_db()
    ticket.refresh_from_db()
    assert run.status == "compensated" and email.status == "failed" and ticket.status == "compensated"
    assert RecoveryItem.objects.filter(run=run).count() == 1  # no second item: one decision
    assert emails("Correction: Ticket escalated") == []


def test_it_happened_undoes_it_with_the_rest_newest_first(tools):
    run, ticket, email, item = unknown_last_step(tools)
    recovery_compensate(item=item, user=tools.oscar, reason="the relay sent it", unknown="happened")
    run.refresh_from_db()
    assert run.status == "compensated" and RecoveryItem.objects.filter(run=run).count() == 1
    undo = list(Action.objects.filter(run=run, kind="compensation").order_by("seq")
                .values_list("compensates_id", flat=True))
    assert undo == [email.pk, ticket.pk]
    assert len(emails("Correction: Ticket escalated")) == 1
    assert AuditEvent.objects.filter(action_ref=email.pk, kind="forward.succeeded", actor="user:oscar").exists()


def test_leave_it_to_me_undoes_the_rest_and_closes_the_run_naming_who_took_it(tools):
    run, ticket, email, item = unknown_last_step(tools)
    recovery_compensate(item=item, user=tools.oscar, reason="I will call the relay", unknown="mine")
    run.refresh_from_db()
    email.refresh_from_db()
    assert run.status == "closed" and email.status == "lost"
    assert email.decision_reason == "left to user:oscar to settle by hand"
    assert RecoveryItem.objects.filter(run=run).count() == 1
    assert Action.objects.get(pk=ticket.pk).status == "compensated"


def test_without_an_answer_the_service_keeps_the_old_two_step_behaviour(tools):
    run, ticket, email, item = unknown_last_step(tools)
    recovery_compensate(item=item, user=tools.oscar, reason="undo what you can")
    run.refresh_from_db()
    assert run.status == "needs_attention" and RecoveryItem.objects.filter(run=run).count() == 2


def test_a_made_up_answer_is_refused_with_nothing_done(tools):
    from ledger.errors import ValidationFailed

    run, ticket, email, item = unknown_last_step(tools)
    with pytest.raises(ValidationFailed, match="one of happened, not_happened, mine"):
        recovery_compensate(item=item, user=tools.oscar, reason="x", unknown="maybe")
    run.refresh_from_db()
    assert run.status == "needs_attention" and Action.objects.get(pk=email.pk).status == "lost"
