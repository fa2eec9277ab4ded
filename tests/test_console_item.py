"""One recovery item: what failed, the suggested compensation, and Resume / Compensate / Close with confirmation."""
import pytest

from ledger.models import AuditEvent
from sandbox.models import Ticket
from tests.test_console_queue import client_for, csrf_token
from tests.test_console_scenarios import compensation_failed_run, drift_run, open_item, step_failed_run


def item_url(item, operation: str = "") -> str:
    return f"/console/recovery/{item.pk}/" + (f"{operation}/" if operation else "")


@pytest.fixture
def drift(tools):
    tools.run = drift_run(tools)
    tools.item = open_item(tools.run)
    return tools


def test_item_page_shows_what_failed_and_the_suggestion(drift):
    response = client_for(drift.oscar).get(item_url(drift.item))
    html = response.content.decode()
    assert response.status_code == 200
    assert "could not be compensated" in html and "not overwriting someone else&#x27;s change" in html
    assert "Someone changed the target after the agent did" in html  # item.suggestion
    assert "Failing step" in html and "crm.update_ticket" in html
    # The compensation plan with its resolved arguments preview.
    assert "&quot;priority&quot;: &quot;normal&quot;" in html
    # The run's timeline with the audit events.
    assert "run.cancel_requested" in html and "Checkpoint" in html
    for operation in ("compensate", "close"):
        assert f'data-op="{operation}"' in html
    # The agent cancelled this run: resuming it would be refused, so it is not offered, and the page says why.
    assert 'data-op="resume"' not in html
    assert "Resume is not offered: run " in html and " was cancelled; compensate or close it instead." in html


@pytest.mark.parametrize("persona", ["victor", "alice"])
def test_viewers_and_approvers_see_the_item_but_no_buttons(drift, persona):
    response = client_for(getattr(drift, persona)).get(item_url(drift.item))
    assert response.status_code == 200
    assert b"data-op=" not in response.content
    assert b"needs the operator role" in response.content


@pytest.mark.parametrize("operation", ["resume", "compensate", "close"])
@pytest.mark.parametrize("persona", ["victor", "alice"])
def test_post_from_viewer_or_approver_is_forbidden(drift, persona, operation):
    client = client_for(getattr(drift, persona), csrf=True)
    token = csrf_token(client, item_url(drift.item))
    response = client.post(item_url(drift.item, operation), {"reason": "let me", "csrfmiddlewaretoken": token})
    assert response.status_code == 403
    assert b"needs the operator role in acme" in response.content
    drift.item.refresh_from_db()
    assert drift.item.status == "open"
    assert not AuditEvent.objects.filter(run_ref=drift.run.pk, actor=f"user:{persona}").exists()


@pytest.mark.parametrize("persona", ["victor", "alice"])
def test_confirm_step_is_forbidden_for_viewers(drift, persona):
    response = client_for(getattr(drift, persona)).get(item_url(drift.item, "compensate"))
    assert response.status_code == 403


@pytest.mark.parametrize("url", ["", "compensate", "close"])
def test_other_tenant_gets_not_found(drift, url):
    client = client_for(drift.mallory)
    assert client.get(item_url(drift.item, url)).status_code == 404
    if url:
        assert client.post(item_url(drift.item, url), {"reason": "x"}).status_code == 404
    drift.item.refresh_from_db()
    assert drift.item.status == "open"


def test_unknown_operation_is_not_found(drift):
    assert client_for(drift.oscar).get(item_url(drift.item, "explode")).status_code == 404


def test_confirm_panel_for_htmx_and_confirm_page_without_js(drift):
    oscar = client_for(drift.oscar)
    panel = oscar.get(item_url(drift.item, "compensate"), HTTP_HX_REQUEST="true")
    assert panel.status_code == 200
    assert panel.content.decode().lstrip().startswith('<div class="panel confirm"')
    assert b"overwrites their change" in panel.content
    page = oscar.get(item_url(drift.item, "compensate"))
    assert b"<html" in page.content and b"Confirm: undo anyway, overwriting their change" in page.content
    drift.item.refresh_from_db()
    assert drift.item.status == "open"  # looking at the confirmation changes nothing


def test_compensate_through_the_page_with_csrf(drift):
    oscar = client_for(drift.oscar, csrf=True)
    token = csrf_token(oscar, item_url(drift.item, "compensate"))
    response = oscar.post(item_url(drift.item, "compensate"), {"reason": "dana agreed", "csrfmiddlewaretoken": token})
    assert response.status_code == 302 and response["Location"] == item_url(drift.item)
    drift.item.refresh_from_db()
    drift.run.refresh_from_db()
    assert (drift.item.status, drift.item.resolution, drift.item.resolved_by) == ("resolved", "compensated", "user:oscar")
    assert drift.item.resolution_note == "dana agreed"
    assert drift.run.status == "compensated"
    ticket_id = drift.run.actions.get(seq=1).target_id
    # forced restore of the before-state
    assert Ticket.objects.get(tenant__slug="acme", number=ticket_id).priority == "normal"
    decision = AuditEvent.objects.get(run_ref=drift.run.pk, kind="run.unwinding", actor="user:oscar")
    assert decision.data["reason"] == "dana agreed" and decision.data["force"] is True
    page = oscar.get(response["Location"])
    assert b"Compensated: every step of run" in page.content


def test_close_needs_a_reason(drift):
    oscar = client_for(drift.oscar, csrf=True)
    token = csrf_token(oscar, item_url(drift.item, "close"))
    response = oscar.post(item_url(drift.item, "close"), {"reason": "  ", "csrfmiddlewaretoken": token})
    assert response.status_code == 400
    assert b"Say why this can be closed" in response.content
    drift.item.refresh_from_db()
    assert drift.item.status == "open"


def test_close_through_the_page_keeps_their_change(drift):
    oscar = client_for(drift.oscar, csrf=True)
    token = csrf_token(oscar, item_url(drift.item, "close"))
    response = oscar.post(item_url(drift.item, "close"), {"reason": "dana's priority is right",
                                                          "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    drift.item.refresh_from_db()
    drift.run.refresh_from_db()
    assert (drift.item.resolution, drift.run.status) == ("closed", "closed")
    assert Ticket.objects.get(tenant__slug="acme", number=drift.run.actions.get(seq=1).target_id).priority == "urgent"
    closed = AuditEvent.objects.get(run_ref=drift.run.pk, kind="run.closed")
    assert (closed.actor, closed.data["reason"]) == ("user:oscar", "dana's priority is right")


def test_resolving_twice_is_refused_because_the_state_moved_on(drift):
    oscar = client_for(drift.oscar, csrf=True)
    token = csrf_token(oscar, item_url(drift.item, "close"))
    first = oscar.post(item_url(drift.item, "close"), {"reason": "handled", "csrfmiddlewaretoken": token})
    assert first.status_code == 302
    events = AuditEvent.objects.filter(run_ref=drift.run.pk).count()
    second = oscar.post(item_url(drift.item, "compensate"), {"reason": "undo it", "csrfmiddlewaretoken": token})
    assert second.status_code == 409
    html = second.content.decode()
    assert "Refused: this item was already closed by user:oscar" in html
    assert AuditEvent.objects.filter(run_ref=drift.run.pk).count() == events  # nothing more happened
    stale = oscar.get(item_url(drift.item, "resume"))
    assert stale.status_code == 409 and b"Refused: this item was already closed by user:oscar" in stale.content
    panel = oscar.get(item_url(drift.item, "resume"), HTTP_HX_REQUEST="true")
    assert panel.status_code == 409 and panel.content.startswith(b'<div class="panel refusal"')
    drift.run.refresh_from_db()
    assert drift.run.status == "closed"


def test_compensate_retries_a_failed_compensation(tools):
    run = compensation_failed_run(tools)
    item = open_item(run)
    oscar = client_for(tools.oscar, csrf=True)
    token = csrf_token(oscar, item_url(item))
    response = oscar.post(item_url(item, "compensate"), {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == "compensated"


def test_resume_of_a_cancelled_run_is_refused_with_the_reason(tools):
    run = compensation_failed_run(tools)
    item = open_item(run)
    oscar = client_for(tools.oscar, csrf=True)
    token = csrf_token(oscar, item_url(item))
    response = oscar.post(item_url(item, "resume"), {"csrfmiddlewaretoken": token})
    assert response.status_code == 409
    assert b"Refused: run %d was cancelled; compensate or close it instead" % run.pk in response.content
    item.refresh_from_db()
    assert item.status == "open"


def test_resume_retries_the_failed_step_with_its_key(tools, django_capture_on_commit_callbacks):
    run = step_failed_run(tools)
    item = open_item(run)
    failed = run.actions.get(seq=2)
    oscar = client_for(tools.oscar, csrf=True)
    token = csrf_token(oscar, item_url(item, "resume"))
    confirm = oscar.get(item_url(item, "resume"))
    assert b"email.send" in confirm.content and b"same idempotency keys" in confirm.content
    with django_capture_on_commit_callbacks(execute=True):
        response = oscar.post(item_url(item, "resume"), {"reason": "the address is fixed",
                                                         "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    item.refresh_from_db()
    run.refresh_from_db()
    failed.refresh_from_db()
    assert (item.resolution, item.resolved_by) == ("resumed", "user:oscar")
    assert run.status == "running"
    assert failed.status == "succeeded" and failed.attempts == 2


def test_item_page_after_resolution_shows_who_and_why(drift):
    client_for(drift.oscar).post(item_url(drift.item, "close"), {"reason": "handled by phone"})
    response = client_for(drift.victor).get(item_url(drift.item))
    html = response.content.decode()
    assert "closed by user:oscar" in html and "handled by phone" in html
    assert 'id="decide"' not in html
