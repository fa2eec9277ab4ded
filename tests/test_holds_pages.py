"""Stopping a held step from the pages, over real HTTP against a live server: the customer from the trail's share
page, operators and approvers from the console; and every way someone else tries it (a wrong, expired or revoked
link, another run's link, a step the customer may not stop, no CSRF token, a viewer, an approver who did not
approve it). Each refusal leaves the step held and the tool uncalled. Chromium presses the customer's Stop on a
390 px phone."""
import re
import secrets
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.models import Action, AuditEvent
from recovery.models import TrailShareLink
from recovery.trail import trail_link_create
from tests.helpers import act, open_run
from tests.test_browser import CHROMIUM, browser, page, sync_api  # noqa: F401
from tests.test_holds import calls, hold, trip
from tests.test_notifications import smtp  # noqa: F401

TOKEN = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


def held_charge(world, **hold_value):
    run, flight, hotel = trip(world, **({"for": "2s", "customer_can_stop": True} | hold_value))
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    assert charge.status == "held"
    return run, charge


def share(world, run) -> str:
    _, token = trail_link_create(run=run, user=world.oscar)
    return f"{world.live_server.url}/console/trail/{token}/"


def form_post(session: requests.Session, page_url: str, action_url: str, **extra):
    """GET the page (its CSRF cookie and the form's token), then POST the form as a browser would."""
    got = session.get(page_url)
    assert got.status_code == 200
    token = TOKEN.search(got.text).group(1)
    return session.post(action_url, data={"csrfmiddlewaretoken": token, **extra}, headers={"Referer": page_url},
                        allow_redirects=False)


def still_held(charge):
    charge.refresh_from_db()
    return charge.status == "held" and calls("payments.charge") == 0


@pytest.fixture
def live(tools, live_server):
    tools.live_server = live_server
    return tools


def test_the_customer_stops_a_held_step_from_the_trail_and_it_never_runs(live):
    run, charge = held_charge(live)
    url = share(live, run)
    page_text = requests.get(url).text
    assert "Stop it" in page_text and "unless you stop it" in page_text
    answer = form_post(requests.Session(), url, f"{url}stop/{charge.pk}/")
    assert answer.status_code == 302 and answer.headers["Location"].endswith("#trail")
    charge.refresh_from_db()
    run.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "customer" and run.status == "compensated"
    assert calls("payments.charge") == 0 and calls("travel.cancel_flight") == 1
    event = AuditEvent.objects.get(action_ref=charge.pk, kind="forward.skipped")
    assert event.actor.startswith("customer:") and event.data["stopped_by"] == "customer"
    after = requests.get(url).text
    assert 'id="trail"' in after  # where the redirect's #trail lands
    assert "You stopped this step while it was waiting, so it was never taken" in after and "Stop it" not in after


def test_a_wrong_expired_revoked_or_other_runs_link_cannot_stop(live):
    run, charge = held_charge(live)
    url = share(live, run)
    base = live.live_server.url
    session = requests.Session()
    session.get(url)  # a CSRF cookie, as the attacker's browser would have
    csrf = session.cookies.get("csrftoken")

    def attempt(token):
        return session.post(f"{base}/console/trail/{token}/stop/{charge.pk}/", data={"csrfmiddlewaretoken": csrf},
                            headers={"Referer": url}, allow_redirects=False)

    assert attempt(secrets.token_urlsafe(32)).status_code == 404  # a guessed link of the right shape
    assert attempt("not-a-token").status_code == 404
    other = open_run(live, goal="another trip")
    _, other_token = trail_link_create(run=other, user=live.oscar)
    assert attempt(other_token).status_code == 404  # a live link, but to another run
    link, token = trail_link_create(run=run, user=live.oscar)
    TrailShareLink.objects.filter(pk=link.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert attempt(token).status_code == 404  # expired
    link, token = trail_link_create(run=run, user=live.oscar)
    TrailShareLink.objects.filter(pk=link.pk).update(revoked_at=timezone.now(), revoked_by="user:oscar")
    assert attempt(token).status_code == 404  # revoked
    good = url.rstrip("/").rsplit("/", 1)[1]
    no_csrf = requests.post(f"{url}stop/{charge.pk}/", allow_redirects=False)
    assert no_csrf.status_code == 403  # CSRF-protected
    assert attempt(good).status_code == 302  # the real link works: the attempts above changed nothing
    assert not AuditEvent.objects.filter(action_ref=charge.pk, kind="forward.skipped").exclude(
        data__stopped_by="customer").exists()


def test_the_customer_cannot_stop_a_step_whose_policy_does_not_allow_it(live):
    run, charge = held_charge(live, customer_can_stop=False)
    url = share(live, run)
    assert "Stop it" not in requests.get(url).text
    session = requests.Session()
    session.get(f"{live.live_server.url}/accounts/login/")  # a CSRF cookie from a page that has a form
    answer = session.post(f"{url}stop/{charge.pk}/", data={"csrfmiddlewaretoken": session.cookies.get("csrftoken")},
                          headers={"Referer": url}, allow_redirects=False)
    assert answer.status_code == 403 and "cannot be stopped from the trail" in answer.text
    assert still_held(charge)


def login(live, username) -> requests.Session:
    session = requests.Session()
    url = f"{live.live_server.url}/accounts/login/"
    answer = form_post(session, url, url, username=username, password=f"pw-{username}")
    assert answer.status_code == 302, answer.text[:300]
    return session


def test_an_operator_stops_from_the_run_page_and_a_viewer_cannot(live):
    run, charge = held_charge(live)
    run_url = f"{live.live_server.url}/console/runs/{run.pk}/"
    stop_url = f"{live.live_server.url}/console/steps/{charge.pk}/stop/"
    victor = login(live, "victor")
    assert "data-stop" not in victor.get(run_url).text
    assert form_post(victor, run_url, stop_url).status_code == 403
    assert still_held(charge)
    mallory = login(live, "mallory")  # another tenant: the step is not there for her
    assert form_post(mallory, f"{live.live_server.url}/console/runs/", stop_url).status_code == 404
    assert still_held(charge)
    oscar = login(live, "oscar")
    queue_url = f"{live.live_server.url}/console/recovery/"
    assert f'data-held="{charge.pk}"' in oscar.get(queue_url).text  # listed above the queue, with its Stop
    assert f'data-held="{charge.pk}"' not in victor.get(queue_url).text  # a viewer's queue lists none
    page_text = oscar.get(run_url).text
    assert f'data-stop="{charge.pk}"' in page_text and "can stop it" in page_text
    assert form_post(oscar, run_url, stop_url).status_code == 302
    charge.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "operator"
    assert "stopped by user:oscar (operator)" in oscar.get(run_url).text
    queue = oscar.get(f"{live.live_server.url}/console/recovery/").text
    assert f'data-held="{charge.pk}"' not in queue


def test_an_approver_who_approved_the_step_may_stop_it_another_may_not(live):
    hold(live, "payments.charge", {"for": "2s"}, approval="manual")
    run = open_run(live, goal="Approved charge")
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    assert charge.status == "awaiting_approval"
    approval_decide(request=ApprovalRequest.objects.get(action=charge), user=live.alice, approve=True, reason="ok")
    charge.refresh_from_db()
    assert charge.status == "held"
    stop_url = f"{live.live_server.url}/console/steps/{charge.pk}/stop/"
    run_url = f"{live.live_server.url}/console/runs/{run.pk}/"
    ben = login(live, "ben")  # an approver, but not of this step
    assert form_post(ben, run_url, stop_url).status_code == 403
    assert still_held(charge)
    alice = login(live, "alice")
    assert form_post(alice, run_url, stop_url).status_code == 302
    charge.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "approver" and calls("payments.charge") == 0


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed")
def test_the_customer_presses_stop_on_a_390_px_phone(live, browser):  # noqa: F811
    run, charge = held_charge(live, **{"for": "30s"})
    url = share(live, run)
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    try:
        phone = context.new_page()
        phone.goto(url)
        button = phone.get_by_role("button", name="Stop it")
        sync_api.expect(button).to_be_visible()
        assert phone.evaluate("() => document.documentElement.scrollWidth") <= 390
        button.click()
        sync_api.expect(phone.locator(".statements")).to_contain_text("You stopped this step while it was waiting")
        assert phone.get_by_role("button", name="Stop it").count() == 0
    finally:
        context.close()
    charge.refresh_from_db()
    assert charge.status == "skipped" and calls("payments.charge") == 0


def test_the_customer_is_emailed_the_link_and_deadline_and_the_link_stops_it(live, smtp, settings):
    """Real SMTP on loopback: the notice carries the trail's link and the deadline; following the link shows the
    Stop button, and pressing it stops the step."""
    from urllib.parse import urlsplit

    from approvals.services import notifications_send

    from recovery.customers import known_customer_add

    settings.UNWIND_BASE_URL = live.live_server.url
    known_customer_add(tenant=live.acme, address="carol@example.com", user=live.ada)  # notices go to known ones only
    run, charge = held_charge(live, **{"for": "30s"})
    assert notifications_send() >= 1
    notice = [m for m in smtp.messages if m["To"] == "carol@example.com"]
    assert len(notice) == 1 and "about to act on your request" in notice[0]["Subject"]
    text = notice[0].get_body(("plain",)).get_content()
    assert f"{charge.next_attempt_at:%Y-%m-%d %H:%M:%S} UTC" in text
    link = next(word for word in text.split() if word.startswith(live.live_server.url + "/console/trail/"))
    assert urlsplit(link).path.startswith("/console/trail/")
    assert "Stop it" in requests.get(link).text
    assert form_post(requests.Session(), link, f"{link}stop/{charge.pk}/").status_code == 302
    charge.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "customer"


def test_no_notice_when_the_customer_may_not_stop_or_has_no_address(live, smtp):
    from approvals.models import Notification

    held_charge(live, customer_can_stop=False)
    assert not Notification.objects.filter(kind="hold_notice").exists()


def test_the_approver_sees_the_countdown_on_the_steps_page_and_can_stop_it_there(live):
    hold(live, "payments.charge", {"for": "30s"}, approval="manual")
    run = open_run(live, goal="Approved charge")
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    page_url = f"{live.live_server.url}/approvals/{ApprovalRequest.objects.get(action=charge).pk}/"
    alice = login(live, "alice")
    decided = form_post(alice, page_url, f"{page_url}decide/", decision="approve", reason="ok")
    assert decided.status_code in (200, 302)
    charge.refresh_from_db()
    assert charge.status == "held"
    page = alice.get(page_url).text
    assert f"until {charge.next_attempt_at:%H:%M:%S} UTC, then it runs unless stopped" in page
    assert "Unwind runs the action now" not in page  # the outcome sentence says it is held, not run
    assert f"Its tool holds it until {charge.next_attempt_at:%H:%M:%S} UTC" in page
    assert f'data-stop="{charge.pk}"' in page
    ben = login(live, "ben")  # an approver who did not approve it: no Stop for him
    assert f'data-stop="{charge.pk}"' not in ben.get(page_url).text
    stop_url = f"{live.live_server.url}/console/steps/{charge.pk}/stop/"
    assert form_post(alice, page_url, stop_url).status_code == 302
    charge.refresh_from_db()
    assert charge.status == "skipped" and charge.stopped_by == "approver" and calls("payments.charge") == 0
