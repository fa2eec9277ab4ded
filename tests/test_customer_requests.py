"""Customer requests from the trail (issue 29), over real HTTP against a live server: the person a run acted for asks
for a correction from the share page; an operator sees it in the queue with its own label, answers, and the answer
reaches the page and the person's email (real SMTP on loopback). Every refusal (off by default, a wrong, expired or
other run's link, no CSRF token, oversized or empty text, a made-up choice, a flood, a closed window) is asserted
with nothing recorded."""
import re
import secrets
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from approvals.services import notifications_send
from ledger.models import AuditEvent, Run
from ledger.policy.document import parse_document
from ledger.engine.runs import run_complete
from ledger.policy.versions import tools_load
from recovery.models import CustomerRequest, RecoveryItem, TrailShareLink
from recovery.trail import trail_link_create
from tests.helpers import act, open_run
from tests.test_holds_pages import form_post, login
from tests.test_notifications import smtp  # noqa: F401

TOKEN = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
HOSTILE = 'Wrong hotel <script>alert(1)</script> "quoted" \u202eevil'


@pytest.fixture
def live(tools, live_server):
    tools.live_server = live_server
    return tools


def requests_on(world, window="7d"):
    tools_load(tenant=world.acme, document={"defaults": {"customer_requests": window}, "tools": {}}, actor="test")
    world.acme.refresh_from_db()


def done_run(world):
    run = open_run(world, goal="Book Carol's hotel")
    step = act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Avenida", "nights": 2})
    run_complete(run=run, actor="agent:booker")
    _, token = trail_link_create(run=run, user=world.oscar, sent_to="carol@example.com")
    return run, step, f"{world.live_server.url}/console/trail/{token}/"


def ask(session, url, **fields):
    return form_post(session, url, f"{url}ask/", **fields)


def nothing_asked(run):
    run.refresh_from_db()
    return not CustomerRequest.objects.filter(run=run).exists() and run.status == "completed" \
        and not RecoveryItem.objects.filter(run=run).exists()


def test_the_window_is_parsed_and_off_by_default(world):
    assert world.acme.customer_requests_seconds == 0
    assert parse_document({"defaults": {"customer_requests": "7d"}}).defaults == {"customer_requests_seconds": 604800}
    from ledger.errors import ValidationFailed
    with pytest.raises(ValidationFailed, match="defaults.customer_requests"):
        parse_document({"defaults": {"customer_requests": "1m"}})


def test_off_by_default_the_page_has_no_form_and_a_forged_post_is_refused(live):
    run, step, url = done_run(live)
    page = requests.get(url).text
    assert 'name="text"' not in page
    session = requests.Session()
    session.get(f"{live.live_server.url}/accounts/login/")  # a CSRF cookie from a page with a form
    answer = session.post(f"{url}ask/", data={"csrfmiddlewaretoken": session.cookies.get("csrftoken"), "kind": "undo",
                                              "text": "undo it"}, headers={"Referer": url}, allow_redirects=False)
    assert answer.status_code == 403 and "Requests cannot be made from this page." in answer.text
    assert nothing_asked(run)


def test_a_request_opens_an_item_and_the_reply_reaches_the_page_and_the_email(live, smtp, settings):
    settings.UNWIND_BASE_URL = live.live_server.url
    requests_on(live)
    run, step, url = done_run(live)
    customer = requests.Session()
    sent = ask(customer, url, kind="undo", action=str(step.pk), text=HOSTILE)
    assert sent.status_code == 302 and sent.headers["Location"].endswith("#requests")
    asked = CustomerRequest.objects.get(run=run)
    assert (asked.kind, asked.action_id, asked.text) == ("undo", step.pk, HOSTILE)
    run.refresh_from_db()
    item = RecoveryItem.objects.get(run=run, status="open")
    assert run.status == "needs_attention" and item.reason == "customer_request" and asked.item_id == item.pk
    event = AuditEvent.objects.get(run_ref=run.pk, kind="customer.request")
    assert event.actor.startswith("customer:carol@example.com") and event.data["text"] == HOSTILE
    page = requests.get(url).text
    assert 'id="requests"' in page  # where the redirect's #requests lands
    assert "Not answered yet." in page and "<script>alert(1)" not in page and "&lt;script&gt;" in page
    assert "[U+202E]" in page  # the bidi control is shown, not obeyed

    oscar = login(live, "oscar")
    queue = oscar.get(f"{live.live_server.url}/console/recovery/").text
    assert "the customer asks for a correction" in queue and "<script>alert(1)" not in queue
    item_url = f"{live.live_server.url}/console/recovery/{item.pk}/"
    item_page = oscar.get(item_url).text
    assert "What the customer asked" in item_page and "&lt;script&gt;" in item_page and "<script>alert" not in item_page
    victor = login(live, "victor")
    assert form_post(victor, item_url, f"{live.live_server.url}/console/requests/{asked.pk}/reply/",
                     reply="no").status_code == 403
    replied = form_post(oscar, item_url, f"{live.live_server.url}/console/requests/{asked.pk}/reply/",
                        reply="We cancelled the booking <b>today</b>.")
    assert replied.status_code == 302
    page = requests.get(url).text
    assert "answered on" in page and "We cancelled the booking &lt;b&gt;today&lt;/b&gt;." in page
    assert notifications_send() >= 1
    mail = [m for m in smtp.messages if m["To"] == "carol@example.com" and "answered your request" in m["Subject"]]
    assert len(mail) == 1
    text = mail[0].get_body(("plain",)).get_content()
    assert "We cancelled the booking <b>today</b>." in text
    link = next(word for word in text.split() if "/console/trail/" in word)
    assert "We cancelled the booking &lt;b&gt;today&lt;/b&gt;." in requests.get(link).text  # the link works
    assert AuditEvent.objects.filter(run_ref=run.pk, kind="customer.reply", actor="user:oscar").exists()
    # The operator compensates as today: the booking is undone.
    from recovery.services import recovery_compensate
    recovery_compensate(item=item, user=live.oscar, reason="the customer asked")
    run.refresh_from_db()
    assert run.status == "compensated"


def test_a_wrong_expired_or_other_runs_link_cannot_ask(live):
    requests_on(live)
    run, step, url = done_run(live)
    base = live.live_server.url
    session = requests.Session()
    session.get(url)
    csrf = session.cookies.get("csrftoken")

    def attempt(token, **fields):
        return session.post(f"{base}/console/trail/{token}/ask/", allow_redirects=False, headers={"Referer": url},
                            data={"csrfmiddlewaretoken": csrf, "kind": "undo", "text": "undo it", **fields})

    assert attempt(secrets.token_urlsafe(32)).status_code == 404
    link, token = trail_link_create(run=run, user=live.oscar)
    TrailShareLink.objects.filter(pk=link.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert attempt(token).status_code == 404
    other, other_step, other_url = done_run(live)
    assert attempt(url.rstrip("/").rsplit("/", 1)[1], action=str(other_step.pk)).status_code == 404  # not its run
    assert requests.post(f"{url}ask/", data={"kind": "undo", "text": "x"}, allow_redirects=False).status_code == 403
    assert nothing_asked(run) and nothing_asked(other)


@pytest.mark.parametrize("fields, status, says", [
    ({"kind": "undo", "text": "x" * 1001}, 400, "at most 1000 are accepted"),
    ({"kind": "undo", "text": "   "}, 400, "Say in a few words what is wrong."),
    ({"kind": "refund-me-twice", "text": "hi"}, 400, "Choose what is wrong"),
])
def test_bad_input_is_refused_with_a_clear_sentence_and_nothing_recorded(live, fields, status, says):
    requests_on(live)
    run, step, url = done_run(live)
    answer = ask(requests.Session(), url, **fields)
    assert answer.status_code == status and says in answer.text
    assert nothing_asked(run)


def test_a_flood_through_one_link_is_refused_after_three_an_hour(live):
    requests_on(live)
    run, step, url = done_run(live)
    session = requests.Session()
    for n in range(3):
        assert ask(session, url, kind="other", text=f"message {n}").status_code == 302
    answer = ask(session, url, kind="other", text="message 4")
    assert answer.status_code == 429 and "already been used for 3 requests in the last hour" in answer.text
    assert CustomerRequest.objects.filter(run=run).count() == 3
    assert RecoveryItem.objects.filter(run=run).count() == 1  # one item for the run, with all three on it


def test_after_the_window_the_form_is_gone_and_a_post_is_refused(live):
    requests_on(live, "1h")
    run, step, url = done_run(live)
    Run.objects.filter(pk=run.pk).update(created_at=timezone.now() - timedelta(hours=2))
    assert 'name="text"' not in requests.get(url).text
    session = requests.Session()
    session.get(f"{live.live_server.url}/accounts/login/")
    answer = session.post(f"{url}ask/", data={"csrfmiddlewaretoken": session.cookies.get("csrftoken"), "kind": "undo",
                                              "text": "undo it"}, headers={"Referer": url}, allow_redirects=False)
    assert answer.status_code == 403 and "has passed" in answer.text
    assert nothing_asked(run)
