"""The correction trail: plain statements from the ledger, and the signed share link that needs no account."""
import json
import time

import pytest
from django.test import Client

from ledger.models import AuditEvent
from ledger.services.actions import action_propose
from ledger.services.runs import run_cancel
from recovery.services import recovery_close
from recovery.trail import correction_trail, trail_share_token
from tests.helpers import act, open_run
from tests.test_console_scenarios import (
    drift_run, email_correction_run, onboarding_compensated, open_item, step_failed_run,
)

KINDS = {"changed", "restored", "corrected", "not_undone", "reviewed", "pending"}


def texts(trail, kind) -> list[str]:
    return [s["text"] for s in trail["statements"] if s["kind"] == kind]


def test_shape_is_what_the_api_serves(tools):
    trail = correction_trail(onboarding_compensated(tools))
    assert set(trail) == {"run", "status", "headline", "statements", "reviewed_by", "audit"}
    assert {s["kind"] for s in trail["statements"]} <= KINDS
    assert set(trail["audit"]) == {"events", "verified", "reference"}
    json.dumps(trail)  # plain JSON, no model objects


def test_compensated_onboarding_run(tools):
    run = onboarding_compensated(tools)
    trail = correction_trail(run)
    user, license_ = run.actions.get(seq=1), run.actions.get(seq=2)
    assert trail["status"] == "compensated"
    assert trail["headline"] == "Everything the agent changed has been undone."
    changed = texts(trail, "changed")
    assert len(changed) == 2
    assert changed[0].startswith(f"Step 1: hr.create_user on user {user.target_id}")
    assert "ashu@company.com" in changed[0]
    assert changed[1].startswith(f"Step 2: licenses.provision on license {license_.target_id}")
    assert texts(trail, "corrected") == [
        "Why it was corrected: email.send (step 3) failed: email.send answered 504: injected fault: "
        "email.send answered 504 and applied nothing."]
    restored = texts(trail, "restored")
    assert restored == [  # in the order they were undone: newest first
        f"Undid step 2 (licenses.provision on license {license_.target_id}) with licenses.revoke "
        f"(license_id: {license_.target_id}).",
        f"Undid step 1 (hr.create_user on user {user.target_id}) with hr.delete_user (user_id: {user.target_id}).",
    ]
    assert texts(trail, "not_undone") == []
    assert texts(trail, "reviewed") == ["No person needed to review this run: Unwind handled it by its policy."]
    assert trail["reviewed_by"] == []
    assert trail["audit"]["verified"] is True
    assert trail["audit"]["events"] == AuditEvent.objects.filter(run_ref=run.pk).count() > 10
    assert trail["audit"]["reference"].startswith(f"Unwind audit chain of tenant acme, run {run.pk}, events #")


def test_drift_run_says_what_could_not_be_restored_and_why(tools):
    run = drift_run(tools)
    ticket = run.actions.get(seq=1).target_id
    trail = correction_trail(run)
    assert trail["status"] == "needs_attention"
    assert texts(trail, "changed") == [f"Step 1: crm.update_ticket changed ticket {ticket}: priority from normal to high."]
    assert texts(trail, "not_undone") == [
        f"step 1 (crm.update_ticket on ticket {ticket}) could not be restored because someone else changed it after "
        "the agent did (priority is now urgent); their change was kept rather than overwritten."]
    assert texts(trail, "corrected") == ["Why it was corrected: the agent cancelled the run before it finished."]
    assert "a person is deciding" in trail["headline"]
    assert any("put in front of a person" in t for t in texts(trail, "pending"))
    assert texts(trail, "reviewed") == ["No person has reviewed this run yet."]


def test_drift_run_closed_by_a_person_names_the_reviewer(tools):
    run = drift_run(tools)
    recovery_close(item=open_item(run), user=tools.oscar, reason="the customer asked for urgent")
    run.refresh_from_db()
    trail = correction_trail(run)
    assert trail["reviewed_by"] == ["oscar"]
    reviewed = texts(trail, "reviewed")
    assert len(reviewed) == 1
    assert reviewed[0].startswith("oscar reviewed the run and closed it as handled on ")
    assert reviewed[0].endswith("(the customer asked for urgent).")
    assert texts(trail, "pending") == []
    assert trail["headline"].startswith("A person reviewed this run and closed it")


def test_email_correction_run_says_what_cannot_be_unsent_and_the_correction(tools):
    run = email_correction_run(tools)
    trail = correction_trail(run)
    assert texts(trail, "changed") == [
        "Step 1: email.send: Send an email (to: customer@example.com, subject: Your refund, body: It is on its way.)."]
    assert texts(trail, "not_undone") == [
        "step 1 (email.send) cannot be taken back: Send an email."]
    corrected = texts(trail, "corrected")
    assert corrected[0].startswith("Why it was corrected: email.send (step 2) failed: email.send answered 400")
    assert corrected[1] == ("Instead, a correction was made: email.send (to: customer@example.com, "
                            "subject: Correction: Your refund).")
    assert texts(trail, "restored") == []
    assert trail["headline"] == ("The agent's changes were undone, except 1 that could not be taken back "
                                 "and was corrected instead.")


def test_trail_shows_no_prompts_or_model_reasoning(tools):
    run = open_run(tools, goal="Onboard Bea")
    secret = "SYSTEM PROMPT: you are a helpful onboarding agent; think step by step"
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "bea@company.com", "name": "Bea"},
                              actor="agent:booker", intent={"goal": "Onboard Bea", "reasoning": secret,
                                                            "confidence": 0.8, "model": "gpt-x"})
    from ledger.services import execution

    execution.execute(proposal.action.pk, owner=proposal.owner)
    run_cancel(run=run, actor="agent:booker", reason="the model's own words: " + secret)
    payload = json.dumps(correction_trail(run))
    assert "SYSTEM PROMPT" not in payload and "step by step" not in payload and "gpt-x" not in payload


def test_approvals_are_reviews(tools, django_capture_on_commit_callbacks):
    from approvals.models import ApprovalRequest
    from approvals.services import approval_decide

    run = open_run(tools, goal="Buy")
    charge = act(run, "payments.charge", {"customer": "cus_7", "amount_cents": 700, "currency": "EUR"})
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=tools.alice, approve=True,
                        reason="regular customer")
    run.refresh_from_db()
    trail = correction_trail(run)
    assert trail["reviewed_by"] == ["alice"]
    assert texts(trail, "reviewed")[0].startswith("alice reviewed and approved step 1 (payments.charge")
    assert texts(trail, "pending") == ["The run is still in progress, so this account is not final."]


def test_step_failed_after_pivot_is_pending_a_person(tools):
    run = step_failed_run(tools)
    trail = correction_trail(run)
    assert any(t.startswith("Step 1: payments.charge on charge ") for t in texts(trail, "changed"))
    assert texts(trail, "not_undone") == []


def test_audit_verification_notices_an_edited_event(tools):
    run = onboarding_compensated(tools)
    event = AuditEvent.objects.filter(run_ref=run.pk).order_by("seq").first()
    AuditEvent.objects.filter(pk=event.pk).update(actor="agent:someone-else")
    assert correction_trail(run)["audit"]["verified"] is False


# --- share link -------------------------------------------------------------------------------------

def test_share_link_needs_no_account(tools):
    run = onboarding_compensated(tools)
    response = Client().get(f"/console/trail/{trail_share_token(run)}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert "Everything the agent changed has been undone." in html
    assert "Undid step 1" in html and "audit chain of tenant acme" in html
    assert response["X-Robots-Tag"] == "noindex"
    assert "Log out" not in html


def test_tampered_share_link_is_not_found(tools):
    run = onboarding_compensated(tools)
    other = drift_run(tools)
    token = trail_share_token(run)
    forged = f"{other.pk}:{token.split(':', 1)[1]}"
    for bad in (forged, token[:-2] + ("AA" if not token.endswith("AA") else "BB"), "nonsense"):
        response = Client().get(f"/console/trail/{bad}/")
        assert response.status_code == 404
        assert b"This link is not valid" in response.content
        assert b"could not be restored" not in response.content


def test_expired_share_link_is_not_found(tools, settings):
    run = onboarding_compensated(tools)
    token = trail_share_token(run)
    settings.UNWIND_TRAIL_LINK_MAX_AGE = 1
    time.sleep(2.1)
    response = Client().get(f"/console/trail/{token}/")
    assert response.status_code == 404
    assert b"This link has expired" in response.content


def test_share_link_max_age_defaults_to_seven_days(tools):
    from recovery.trail import share_max_age

    assert share_max_age() == 7 * 24 * 3600


@pytest.mark.parametrize("persona", ["oscar", "victor"])
def test_share_link_on_the_run_page_opens_the_trail(tools, persona):
    run = drift_run(tools)
    member = Client()
    member.force_login(getattr(tools, persona))
    page = member.get(f"/console/runs/{run.pk}/").content.decode()
    url = page.split('id="share-url" type="text" readonly value="', 1)[1].split('"', 1)[0]
    assert url.startswith("http://testserver/console/trail/")
    response = Client().get(url.removeprefix("http://testserver"))
    assert response.status_code == 200
    assert b"could not be restored because someone else changed it" in response.content


# --- by email ---------------------------------------------------------------------------------------

def test_operator_emails_the_trail_to_the_person_it_acted_for(tools):
    from django.core import mail

    from approvals.models import Notification
    from approvals.services import notifications_send

    run = onboarding_compensated(tools)
    oscar = Client(enforce_csrf_checks=False)
    oscar.force_login(tools.oscar)
    assert b"Email it to carol@example.com" in oscar.get(f"/console/runs/{run.pk}/").content
    response = oscar.post(f"/console/runs/{run.pk}/trail/email/")
    assert response.status_code == 302
    note = Notification.objects.get(kind="correction_trail")
    assert note.recipients == ["carol@example.com"]
    assert "Everything the agent changed has been undone." in note.body_text
    assert AuditEvent.objects.filter(run_ref=run.pk, kind="trail.sent", actor="user:oscar").exists()
    notifications_send()
    assert mail.outbox[-1].to == ["carol@example.com"]
    link = next(line for line in note.body_text.splitlines() if "/console/trail/" in line)
    shared = Client().get(link[link.index("/console/trail/"):])
    assert shared.status_code == 200 and b"Undid step 1" in shared.content


def test_viewer_cannot_email_the_trail(tools):
    from approvals.models import Notification

    run = onboarding_compensated(tools)
    victor = Client()
    victor.force_login(tools.victor)
    assert b"Email it to" not in victor.get(f"/console/runs/{run.pk}/").content
    assert victor.post(f"/console/runs/{run.pk}/trail/email/").status_code == 403
    mallory = Client()
    mallory.force_login(tools.mallory)
    assert mallory.post(f"/console/runs/{run.pk}/trail/email/").status_code == 404
    assert not Notification.objects.filter(kind="correction_trail").exists()


def test_trail_email_needs_an_address(tools):
    from approvals.models import Notification

    run = run_open_for(tools, on_behalf_of="Carol in accounting")
    oscar = Client()
    oscar.force_login(tools.oscar)
    response = oscar.post(f"/console/runs/{run.pk}/trail/email/", follow=True)
    assert b"Not sent: run" in response.content and b"not an email address" in response.content
    assert not Notification.objects.filter(kind="correction_trail").exists()


def run_open_for(world, *, on_behalf_of):
    from ledger.services.runs import run_open

    return run_open(tenant=world.acme, agent=world.agent, goal="Something", on_behalf_of=on_behalf_of,
                    actor="agent:booker")
