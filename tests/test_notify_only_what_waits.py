"""Issue 38, finding 4: nobody is asked to decide a request that no longer waits.

A message that asks people to decide an approval request (its email, the digest that lists it, its Slack message) is
checked against the request as it leaves: one about a request decided, withdrawn, voided or expired is not sent, and
its outbox row says so and why. A digest lists, and counts, only the requests still waiting when it is composed.

Everything a person or the agent does goes over HTTP to a live server: the agent proposes and cancels through the
REST API, approvers decide on the approval page or with a signed Slack click, operators read the outbox page. Email
goes through a real SMTP server on loopback (aiosmtpd) and Slack is the loopback stand-in of tests/test_slack.py.
"""
import json
import re
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from approvals import slack
from approvals.models import ApprovalLink, ApprovalRequest, Notification, SlackMessage
from approvals.services import notifications_send
from ledger.models import Action
from ledger.policy.versions import tools_load
from sandbox.crawl import login
from tests.conftest import World, in_process_policy, seed_sandboxes
from tests.test_notifications import smtp  # noqa: F401 - the real SMTP server fixture
from tests.test_slack import FakeSlack, click, map_user, slack_api  # noqa: F401 - the Slack stand-in fixture

APPROVERS = ["ada@example.com", "alice@example.com", "ben@example.com", "oscar@example.com"]
WINDOW = 60


@pytest.fixture
def live(transactional_db, live_server, settings, _engine_settings):
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    settings.UNWIND_BASE_URL = live_server.url
    settings.UNWIND_APPROVAL_DIGEST_WINDOW = WINDOW
    world.base = live_server.url
    world.agent_http = requests.Session()
    world.agent_http.headers["Authorization"] = f"Bearer {world.key}"
    return world


def propose(world, cents: int) -> ApprovalRequest:
    """The agent, over HTTP: a run, then a charge that waits for approval."""
    run = world.agent_http.post(f"{world.base}/api/v1/runs", json={"goal": f"Pay invoice {cents}",
                                                                    "on_behalf_of": "carol@example.com"}, timeout=30)
    assert run.status_code == 201, run.text
    action = world.agent_http.post(f"{world.base}/api/v1/runs/{run.json()['id']}/actions", timeout=30, json={
        "tool": "payments.charge", "args": {"customer": "cus_ana", "amount_cents": cents, "currency": "EUR"}})
    assert action.status_code in (200, 201, 202) and action.json()["status"] == "awaiting_approval", action.text
    return ApprovalRequest.objects.get(action_id=action.json()["id"])


def cancel(world, approval: ApprovalRequest) -> None:
    """The agent cancels its run over HTTP: the request it left waiting is withdrawn."""
    answer = world.agent_http.post(f"{world.base}/api/v1/runs/{approval.run_id}/cancel",
                                   json={"reason": "the customer changed plans"}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "withdrawn"


def decide(world, username: str, approval: ApprovalRequest, *, approve: bool = True) -> None:
    """A person decides on the approval page, as a browser does: logged in, with the page's CSRF token."""
    person = login(world.base, username, f"pw-{username}")
    page = f"{world.base}/approvals/{approval.pk}/"
    assert person.get(page, timeout=10).status_code == 200
    form = {"csrfmiddlewaretoken": person.cookies["csrftoken"], "decision": "approve" if approve else "reject",
            "reason": "" if approve else "not this supplier"}
    answer = person.post(f"{page}decide/", data=form, headers={"Referer": page}, timeout=30, allow_redirects=False)
    assert answer.status_code == 302, answer.text
    assert ApprovalRequest.objects.get(pk=approval.pk).status == ("approved" if approve else "rejected")


def outbox_page(world, note: Notification) -> str:
    """The operator's view of one outbox row."""
    answer = login(world.base, "oscar", "pw-oscar").get(f"{world.base}/console/outbox/{note.pk}/", timeout=10)
    assert answer.status_code == 200
    return answer.text


def text_of(message) -> str:
    return message.get_body(("plain",)).get_content()


def later() -> timezone.datetime:
    return timezone.now() + timedelta(seconds=WINDOW + 1)


# --- a single approval email -------------------------------------------------------------------------------

def test_a_request_withdrawn_before_its_email_leaves_sends_nothing(live, smtp):
    approval = propose(live, 48200)
    assert Notification.objects.filter(request=approval, kind="approval_requested", status="pending").count() == 4
    assert ApprovalLink.objects.filter(request=approval).count() == 4  # one-tap links ride in these emails
    cancel(live, approval)

    assert notifications_send() == 0
    assert smtp.messages == []  # no "Approval needed", no one-tap links, for a request nobody can decide
    rows = list(Notification.objects.filter(kind="approval_requested"))
    assert sorted(r.recipients[0] for r in rows) == APPROVERS
    for row in rows:
        assert row.status == "withheld" and row.sent_at is None
        assert re.fullmatch(rf"not sent: request {approval.pk} was withdrawn at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC: "
                            r".*the customer changed plans.*", row.last_error), row.last_error
    page = outbox_page(live, rows[0])
    assert "withheld" in page and f"not sent: request {approval.pk} was withdrawn" in page
    assert notifications_send(now=timezone.now() + timedelta(hours=1)) == 0 and smtp.messages == []


def test_an_email_about_a_request_decided_on_the_page_is_not_sent_and_another_still_is(live, smtp):
    decided, waiting = propose(live, 48200), propose(live, 51000)
    decide(live, "alice", decided)
    assert notifications_send() == 4  # the waiting one's, one per approver
    assert {re.search(r"/approvals/(\d+)/", text_of(m)).group(1) for m in smtp.messages} == {str(waiting.pk)}
    withheld = Notification.objects.filter(request=decided)
    assert {(r.status, r.last_error.split(" at ")[0]) for r in withheld} == {
        ("withheld", f"not sent: request {decided.pk} was approved")}


def test_an_email_whose_request_expired_unswept_is_not_sent(live, smtp):
    approval = propose(live, 48200)
    past_expiry = approval.expires_at + timedelta(seconds=1)  # due, and the sweep has not expired it yet
    assert notifications_send(now=past_expiry) == 0 and smtp.messages == []
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    assert {r.last_error for r in Notification.objects.filter(request=approval)} == {
        f"not sent: request {approval.pk} expired at {approval.expires_at:%Y-%m-%d %H:%M:%S} UTC"}


# --- the digest --------------------------------------------------------------------------------------------

def test_a_digest_composed_after_one_of_its_requests_was_approved_lists_only_the_others(live, smtp, settings):
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 0  # every request goes into a digest
    first, second, third = propose(live, 10100), propose(live, 10200), propose(live, 10300)
    decide(live, "alice", second)  # a minute before the digest leaves
    assert notifications_send() == 0  # the digest waits for its window

    assert notifications_send(now=later()) == 4  # one digest per approver
    for address in APPROVERS:
        [digest] = [m for m in smtp.messages if m["To"] == address]
        assert digest["Subject"] == "[Unwind] 2 approval requests waiting for you"
        text = text_of(digest)
        assert text.startswith("2 approval requests wait for you.")
        assert "1 other request that came for you meanwhile no longer waits" in text
        assert set(re.findall(r"/approvals/(\d+)/", text)) == {str(first.pk), str(third.pk)}
        html = digest.get_body(("html",)).get_content()
        assert set(re.findall(r"/approvals/(\d+)/", html)) == {str(first.pk), str(third.pk)}
    entries = Notification.objects.filter(kind="approval_digest_entry")
    assert {(e.request_id, e.status) for e in entries} == {(first.pk, "sent"), (second.pk, "withheld"),
                                                            (third.pk, "sent")}
    assert all(e.last_error.startswith(f"not sent: request {second.pk} was approved at ")
               for e in entries.filter(request=second))
    assert notifications_send(now=later() + timedelta(hours=1)) == 0 and len(smtp.messages) == 4


def test_a_digest_with_no_request_left_waiting_is_not_sent_and_says_why(live, smtp, settings):
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 0
    approved, withdrawn = propose(live, 10100), propose(live, 10200)
    decide(live, "ben", approved)
    cancel(live, withdrawn)

    assert notifications_send(now=later()) == 0
    assert smtp.messages == []
    digests = list(Notification.objects.filter(kind="approval_digest"))
    assert sorted(d.recipients[0] for d in digests) == APPROVERS
    for digest in digests:
        assert digest.status == "withheld" and digest.sent_at is None
        assert digest.subject == "[Unwind] Approval digest not sent: nothing waits"
        assert digest.last_error.startswith("not sent: none of the requests it would list waits any more: ")
        assert f"request {approved.pk} was approved at " in digest.last_error
        assert f"request {withdrawn.pk} was withdrawn at " in digest.last_error
    assert set(Notification.objects.filter(kind="approval_digest_entry").values_list("status", flat=True)) == {
        "withheld"}
    page = outbox_page(live, digests[0])
    assert "Approval digest not sent: nothing waits" in page and f"request {withdrawn.pk} was withdrawn" in page


def test_withheld_emails_do_not_count_towards_the_digest_threshold(live, smtp, settings):
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 1
    withdrawn = propose(live, 10100)
    cancel(live, withdrawn)
    assert notifications_send() == 0  # withheld: nobody received it
    fresh = propose(live, 10200)
    assert notifications_send() == 4  # an email of its own, with its one-tap links, not a digest a window later
    assert {re.search(r"/approvals/(\d+)/", text_of(m)).group(1) for m in smtp.messages} == {str(fresh.pk)}
    assert not Notification.objects.filter(kind="approval_digest").exists()


# --- Slack -------------------------------------------------------------------------------------------------

def test_a_slack_message_for_a_withdrawn_request_is_not_posted(live, slack_api):
    approval = propose(live, 48200)
    cancel(live, approval)
    assert slack.slack_messages_post() == 0
    assert [c["method"] for c in slack_api.calls] == []
    message = SlackMessage.objects.get(request=approval)
    assert message.ts == "" and message.posted_at is None and message.next_attempt_at is None
    assert message.last_error.startswith(f"not posted: request {approval.pk} was withdrawn at ")
    assert slack.slack_messages_post(now=timezone.now() + timedelta(hours=1)) == 0 and slack_api.calls == []


class ClickedWhilePosting(FakeSlack):
    """Slack's side, where an approver clicks Approve on the message in the instant before Slack answers the post
    (a second channel, a fast hand): the decision commits while Unwind does not yet know the message's ts."""

    def do_POST(self):
        if self.path.endswith("chat.postMessage") and self.server.while_posting:
            self.server.while_posting.pop()()
        super().do_POST()


def test_a_request_decided_while_its_message_was_being_posted_still_shows_the_outcome(live, slack_api):
    slack_api.RequestHandlerClass = ClickedWhilePosting
    map_user(live, "alice", "U0ALICE")
    approval = propose(live, 48200)
    answers = []
    slack_api.while_posting = [lambda: answers.append(
        click(f"{live.base}/integrations/slack/interactions/", user="U0ALICE", approval=approval))]

    assert slack.slack_messages_post() == 1
    assert answers[0].status_code == 200, answers[0].text
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "approved"
    assert [c["method"] for c in slack_api.calls] == ["chat.postMessage", "chat.update"]
    update = slack_api.calls[-1]["args"]
    assert update["ts"] == SlackMessage.objects.get(request=approval).ts
    blocks = json.dumps(update["blocks"]) if not isinstance(update["blocks"], str) else update["blocks"]
    assert "Approved by alice" in blocks and "unwind_approve" not in blocks  # no buttons left for a decided request
    assert Action.objects.get(pk=approval.action_id).status == "succeeded"
