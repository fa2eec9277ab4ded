"""The correction trail: plain statements from the ledger, and the random share links that need no account."""
import datetime
import hashlib
import json
import secrets

import pytest
import requests
from django.core import signing
from django.test import Client
from django.utils import timezone

from ledger.errors import PermissionDenied
from ledger.models import AuditEvent
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_cancel
from recovery.services import recovery_close
from recovery.models import TrailShareLink
from recovery.trail import correction_trail, trail_link_create
from tests.helpers import act, open_run
from tests.test_console_scenarios import (
    drift_run, email_correction_run, onboarding_compensated, open_item, step_failed_run,
)

KINDS = {"changed", "not_done", "restored", "corrected", "not_undone", "reviewed", "pending"}


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
    assert trail["status"] == "compensated"
    assert trail["headline"] == "Everything the agent changed has been undone."
    assert texts(trail, "changed") == [  # in the tools' own words (sandbox/policy.yaml, describe.done)
        "We created an HR account for Ashu Kumar (ashu@company.com).",
        "We provisioned a paid workspace license.",
    ]
    assert texts(trail, "not_done") == [  # describe.failed, not "email.send answered 504: injected fault"
        "We could not send the email \u201cWelcome\u201d to ashu@home.example."]
    assert texts(trail, "corrected") == [
        "Why it was corrected: a later step could not be completed, so we began undoing the changes made before it."]
    assert texts(trail, "restored") == [  # in the order they were undone: newest first (describe.undone)
        "We revoked the workspace license we had provisioned.",
        "We removed the HR account we had created for Ashu Kumar.",
    ]
    assert texts(trail, "not_undone") == []
    assert texts(trail, "reviewed") == [
        "No person needed to review this: it was handled automatically, by the rules set for it."]
    assert trail["reviewed_by"] == []
    assert trail["audit"]["verified"] is True
    assert trail["audit"]["events"] == AuditEvent.objects.filter(run_ref=run.pk).count() > 10
    assert trail["audit"]["reference"].startswith(f"Unwind audit chain of tenant acme, run {run.pk}, events #")


def test_drift_run_says_what_could_not_be_restored_and_why(tools):
    run = drift_run(tools)
    ticket = run.actions.get(seq=1).target_id
    trail = correction_trail(run)
    assert trail["status"] == "needs_attention"
    assert texts(trail, "changed") == [f"We set the priority of ticket {ticket} to high."]
    assert texts(trail, "not_undone") == [
        f"This could not be undone: we set the priority of ticket {ticket} to high. The reason: someone else "
        "changed it after the agent did (priority is now urgent), and their change was kept rather than overwritten."]
    assert texts(trail, "corrected") == ["Why it was corrected: the agent stopped before it finished."]
    assert "a person is deciding" in trail["headline"]
    assert any("put in front of a person" in t for t in texts(trail, "pending"))
    assert texts(trail, "reviewed") == ["No person has reviewed this yet."]


def test_drift_run_closed_by_a_person_names_the_reviewer(tools):
    run = drift_run(tools)
    recovery_close(item=open_item(run), user=tools.oscar, reason="the customer asked for urgent")
    run.refresh_from_db()
    trail = correction_trail(run)
    assert trail["reviewed_by"] == ["an operator at Acme"]
    reviewed = texts(trail, "reviewed")
    assert len(reviewed) == 1
    assert reviewed[0].startswith("An operator at Acme reviewed it and closed it as handled on ")
    assert reviewed[0].endswith("(the customer asked for urgent).")
    assert texts(trail, "pending") == []
    assert trail["headline"].startswith("A person at Acme reviewed this and closed it")


def test_email_correction_run_says_what_cannot_be_unsent_and_the_correction(tools):
    run = email_correction_run(tools)
    trail = correction_trail(run)
    sent = "we sent an email to customer@example.com with the subject \u201cYour refund\u201d"
    assert texts(trail, "changed") == [f"W{sent[1:]}."]
    assert texts(trail, "not_undone") == [f"This cannot be taken back: {sent}."]
    corrected = texts(trail, "corrected")
    assert texts(trail, "not_done") == ["We could not send the email \u201cRefund issued\u201d to finance@example.com."]
    assert corrected[0] == ("Why it was corrected: a later step could not be completed, so we began undoing the "
                            "changes made before it.")
    assert corrected[1] == ("Instead, a correction was made: we sent an email to customer@example.com with the "
                            "subject \u201cCorrection: Your refund\u201d.")
    assert texts(trail, "restored") == []
    assert trail["headline"] == ("The agent's changes were undone, except 1 that could not be taken back "
                                 "and was corrected instead.")


def test_a_tool_without_describe_reads_from_its_description_never_its_name(tools):
    """The fallback: a plain sentence from the tool's description and arguments (or its target), no tool id."""
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    for name in ("hr.create_user", "licenses.provision", "email.send", "hr.delete_user", "licenses.revoke"):
        spec = {k: v for k, v in in_process_policy()["tools"][name].items() if k != "describe"}
        if name == "licenses.provision":
            spec["description"] = ""
        tool_upsert(tenant=tools.acme, name=name, spec=spec, actor="test")
    run = onboarding_compensated(tools)
    trail = correction_trail(run)
    assert texts(trail, "changed") == [
        "We took this step: create a user in the HR directory (email: ashu@company.com, name: Ashu Kumar).",
        "We took this step: a change to a license.",  # its id is for staff
    ]
    assert texts(trail, "corrected") == [
        "Why it was corrected: a later step could not be completed, so we began undoing the changes made before it."]
    assert texts(trail, "not_done") == [
        "This step could not be completed: send an email (to: ashu@home.example, subject: Welcome, body: Hi)."]
    assert texts(trail, "restored") == [
        "We undid this step: a change to a license.",
        "We undid this step: create a user in the HR directory (email: ashu@company.com, name: Ashu Kumar).",
    ]
    assert_customer_safe(json.dumps(trail["statements"]) + trail["headline"], run)


def test_trail_shows_no_prompts_or_model_reasoning(tools):
    run = open_run(tools, goal="Onboard Bea")
    secret = "SYSTEM PROMPT: you are a helpful onboarding agent; think step by step"
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "bea@company.com", "name": "Bea"},
                              actor="agent:booker", intent={"goal": "Onboard Bea", "reasoning": secret,
                                                            "confidence": 0.8, "model": "gpt-x"})
    from ledger.engine import execution

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
    assert trail["reviewed_by"] == ["a reviewer at Acme"]
    reviewed = texts(trail, "reviewed")[0]
    assert reviewed.startswith("A reviewer at Acme approved this step on ")
    # what was approved, not what was done (the charge may still fail), as money, without the customer's id
    assert reviewed.endswith(" UTC (regular customer): charge a customer's card (€7.00).")
    assert texts(trail, "pending") == ["The work is still in progress, so this account is not final."]


def test_step_failed_after_pivot_is_pending_a_person(tools):
    run = step_failed_run(tools)
    trail = correction_trail(run)
    assert texts(trail, "changed") == ["We took a card payment of €49.00."]
    assert texts(trail, "not_undone") == []


def test_audit_verification_notices_an_edited_event(tools):
    run = onboarding_compensated(tools)
    event = AuditEvent.objects.filter(run_ref=run.pk).order_by("seq").first()
    AuditEvent.objects.filter(pk=event.pk).update(actor="agent:someone-else")
    assert correction_trail(run)["audit"]["verified"] is False


# --- share link -------------------------------------------------------------------------------------

NOT_FOUND_SENTENCE = b"This link does not open a correction trail."


def share(world, run, person="oscar") -> str:
    """A share link made through the service, as the console does; returns its path."""
    _, token = trail_link_create(run=run, user=getattr(world, person))
    return f"/console/trail/{token}/"


def test_share_link_needs_no_account(tools):
    run = onboarding_compensated(tools)
    response = Client().get(share(tools, run))
    html = response.content.decode()
    assert response.status_code == 200
    assert "Everything the agent changed has been undone." in html
    assert "We removed the HR account we had created for Ashu Kumar." in html
    assert "tamper-evident record, and that record checks out" in html
    assert response["X-Robots-Tag"] == "noindex"
    assert "Log out" not in html


def test_a_link_is_random_stored_hashed_and_expires_after_the_max_age(tools, settings):
    settings.UNWIND_TRAIL_LINK_MAX_AGE = 3600
    run = onboarding_compensated(tools)
    link, token = trail_link_create(run=run, user=tools.oscar)
    again, other = trail_link_create(run=run, user=tools.oscar)
    assert token != other and len(token) == 43 and str(run.pk) not in (token, other)
    assert link.token_hash == hashlib.sha256(token.encode()).hexdigest()
    stored = TrailShareLink.objects.filter(pk=link.pk).values().get()
    assert token not in json.dumps(stored, default=str)  # no column holds the token itself
    assert 3599 <= (link.expires_at - link.created_at).total_seconds() <= 3601
    created = AuditEvent.objects.get(kind="trail.link_created", data__link=link.pk)
    assert created.actor == "user:oscar" and created.run_ref == run.pk


def test_share_link_max_age_defaults_to_seven_days(tools):
    from recovery.trail import share_max_age

    assert share_max_age() == 7 * 24 * 3600


def test_only_an_operator_makes_a_link(tools):
    run = onboarding_compensated(tools)
    with pytest.raises(PermissionDenied):
        trail_link_create(run=run, user=tools.victor)
    with pytest.raises(PermissionDenied):
        trail_link_create(run=run, user=tools.mallory)
    assert not TrailShareLink.objects.exists()


@pytest.fixture
def live_tools(transactional_db, live_server, _engine_settings):
    """The in-process sandbox tools with a live server: the share links are attacked over real HTTP."""
    from ledger.policy.versions import tools_load
    from tests.conftest import World, in_process_policy, seed_sandboxes

    world = World()
    seed_sandboxes(world)
    for tenant in (world.acme, world.globex):
        tools_load(tenant=tenant, document=in_process_policy(), actor="test")
    world.live_server = live_server
    return world


def assert_refused(url: str) -> None:
    response = requests.get(url, timeout=10)
    assert response.status_code == 404, (url, response.status_code)
    assert NOT_FOUND_SENTENCE in response.content
    for hint in (b"expired", b"revoked", b"altered", b"no longer exists"):
        assert hint not in response.content  # one answer for every refusal: no hint which
    assert b"We removed the HR account" not in response.content and b"could not be undone" not in response.content


def test_forged_and_guessed_links_open_nothing(live_tools):
    run = onboarding_compensated(live_tools)
    genuine = share(live_tools, run)
    base = f"{live_tools.live_server.url}/console/trail"
    old_style = signing.TimestampSigner(salt="unwind.recovery.correction-trail").sign(str(run.pk))
    token = genuine.split("/")[3]
    for guess in (secrets.token_urlsafe(32), old_style, str(run.pk), token[:-1], token[:-1] + "A" * 2,
                  token.upper() if token.upper() != token else token.lower(), "nonsense"):
        assert_refused(f"{base}/{guess}/")
    assert requests.get(f"{live_tools.live_server.url}{genuine}", timeout=10).status_code == 200


def test_an_expired_link_opens_nothing(live_tools):
    run = onboarding_compensated(live_tools)
    link, token = trail_link_create(run=run, user=live_tools.oscar)
    url = f"{live_tools.live_server.url}/console/trail/{token}/"
    assert requests.get(url, timeout=10).status_code == 200
    TrailShareLink.objects.filter(pk=link.pk).update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    assert_refused(url)


def console(live_server, user: str) -> requests.Session:
    """A browser-like session of `user` in the console: logged in through the form, CSRF cookie and all."""
    session = requests.Session()
    login = f"{live_server.url}/accounts/login/"
    session.get(login, timeout=10)
    response = session.post(login, data={"username": user, "password": f"pw-{user}",
                                         "csrfmiddlewaretoken": session.cookies["csrftoken"]},
                            headers={"Referer": login}, timeout=10)
    assert response.status_code == 200 and "sessionid" in session.cookies, response.status_code
    return session


def post_form(session: requests.Session, url: str, **data) -> requests.Response:
    return session.post(url, data={"csrfmiddlewaretoken": session.cookies["csrftoken"], **data},
                        headers={"Referer": url}, timeout=10)


def test_an_operator_makes_and_revokes_a_link_from_the_console(live_tools):
    run = onboarding_compensated(live_tools)
    oscar = console(live_tools.live_server, "oscar")
    page_url = f"{live_tools.live_server.url}/console/runs/{run.pk}/"
    assert "Make a share link" in oscar.get(page_url, timeout=10).text
    made = post_form(oscar, f"{page_url}trail/links/")
    assert made.status_code == 200
    url = made.text.split('id="share-url" type="text" readonly value="', 1)[1].split('"', 1)[0]
    assert url.startswith(f"{live_tools.live_server.url}/console/trail/")
    assert requests.get(url, timeout=10).status_code == 200
    link = TrailShareLink.objects.get(run=run)
    assert f'id="share-link-{link.pk}"' in oscar.get(page_url, timeout=10).text
    assert url not in oscar.get(page_url, timeout=10).text  # shown once, never again

    revoked = post_form(oscar, f"{page_url}trail/links/{link.pk}/revoke/")
    assert revoked.status_code == 200 and "The share link is revoked" in revoked.text
    assert_refused(url)
    assert f'id="share-link-{link.pk}"' not in revoked.text
    event = AuditEvent.objects.get(kind="trail.link_revoked", data__link=link.pk)
    assert event.actor == "user:oscar" and event.run_ref == run.pk
    link.refresh_from_db()
    assert link.revoked_by == "user:oscar"


def test_revoking_needs_an_operator_of_the_tenant_and_a_csrf_token(live_tools):
    run = onboarding_compensated(live_tools)
    link, token = trail_link_create(run=run, user=live_tools.oscar)
    url = f"{live_tools.live_server.url}/console/trail/{token}/"
    revoke = f"{live_tools.live_server.url}/console/runs/{run.pk}/trail/links/{link.pk}/revoke/"
    make = f"{live_tools.live_server.url}/console/runs/{run.pk}/trail/links/"

    victor = console(live_tools.live_server, "victor")
    assert "Make a share link" not in victor.get(f"{live_tools.live_server.url}/console/runs/{run.pk}/",
                                                 timeout=10).text
    assert post_form(victor, revoke).status_code == 403
    assert post_form(victor, make).status_code == 403
    mallory = console(live_tools.live_server, "mallory")
    assert post_form(mallory, revoke).status_code == 404
    assert post_form(mallory, make).status_code == 404
    oscar = console(live_tools.live_server, "oscar")
    no_token = oscar.post(revoke, headers={"Referer": revoke}, timeout=10)  # a cross-site form has no token
    assert no_token.status_code == 403
    assert requests.post(revoke, timeout=10, allow_redirects=False).status_code in (302, 403)  # anonymous

    assert requests.get(url, timeout=10).status_code == 200
    assert TrailShareLink.objects.filter(revoked_at__isnull=False).count() == 0
    assert TrailShareLink.objects.count() == 1
    assert not AuditEvent.objects.filter(kind="trail.link_revoked").exists()


def test_a_link_of_one_run_cannot_be_revoked_through_another(tools):
    run = onboarding_compensated(tools)
    other = drift_run(tools)
    link, token = trail_link_create(run=run, user=tools.oscar)
    oscar = Client()
    oscar.force_login(tools.oscar)
    assert oscar.post(f"/console/runs/{other.pk}/trail/links/{link.pk}/revoke/").status_code == 404
    assert Client().get(f"/console/trail/{token}/").status_code == 200


# --- by email ---------------------------------------------------------------------------------------

def test_operator_emails_the_trail_to_the_person_it_acted_for(tools):
    from django.core import mail

    from approvals.models import Notification
    from approvals.services import notifications_send

    run = onboarding_compensated(tools)
    oscar = Client(enforce_csrf_checks=False)
    oscar.force_login(tools.oscar)
    assert b"Email a link to carol@example.com" in oscar.get(f"/console/runs/{run.pk}/").content
    response = oscar.post(f"/console/runs/{run.pk}/trail/email/")
    assert response.status_code == 302
    note = Notification.objects.get(kind="correction_trail")
    assert note.recipients == ["carol@example.com"]
    assert "Everything the agent changed has been undone." in note.body_text
    assert AuditEvent.objects.filter(run_ref=run.pk, kind="trail.sent", actor="user:oscar").exists()
    assert TrailShareLink.objects.get(run=run).sent_to == "carol@example.com"
    assert AuditEvent.objects.filter(run_ref=run.pk, kind="trail.link_created", actor="user:oscar").exists()
    notifications_send()
    assert mail.outbox[-1].to == ["carol@example.com"]
    link = next(line for line in note.body_text.splitlines() if "/console/trail/" in line)
    shared = Client().get(link[link.index("/console/trail/"):])
    assert shared.status_code == 200 and b"We removed the HR account" in shared.content
    assert_customer_safe(note.body_text.split("Read it online")[0], run)  # the share link itself is the one URL


def test_viewer_cannot_email_the_trail(tools):
    from approvals.models import Notification

    run = onboarding_compensated(tools)
    victor = Client()
    victor.force_login(tools.victor)
    assert b"Email a link to" not in victor.get(f"/console/runs/{run.pk}/").content
    assert victor.post(f"/console/runs/{run.pk}/trail/email/").status_code == 403
    mallory = Client()
    mallory.force_login(tools.mallory)
    assert mallory.post(f"/console/runs/{run.pk}/trail/email/").status_code == 404
    assert not Notification.objects.filter(kind="correction_trail").exists()
    assert not TrailShareLink.objects.exists()


def test_trail_email_needs_an_address(tools):
    from approvals.models import Notification

    run = run_open_for(tools, on_behalf_of="Carol in accounting")
    oscar = Client()
    oscar.force_login(tools.oscar)
    response = oscar.post(f"/console/runs/{run.pk}/trail/email/", follow=True)
    assert b"Not sent: run" in response.content and b"not an email address" in response.content
    assert not Notification.objects.filter(kind="correction_trail").exists()


def run_open_for(world, *, on_behalf_of):
    from ledger.engine.runs import run_open

    return run_open(tenant=world.acme, agent=world.agent, goal="Something", on_behalf_of=on_behalf_of,
                    actor="agent:booker")


def assert_customer_safe(text: str, run) -> None:
    """What the customer reads holds no URL, tool id, error text, HTTP status or audit event number."""
    from tests.test_trail_customer import customer_leaks

    leaks = customer_leaks(text, run)
    assert not leaks, leaks
