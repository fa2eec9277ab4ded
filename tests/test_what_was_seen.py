"""What a person approves is what they saw (issue 31, items 2, 3 and the digest of 6), attacked over HTTP.

The agent proposes through the REST API of a live server; Slack is the loopback stand-in of tests/test_slack.py
(clicks signed as Slack signs them), email goes through a real SMTP server on loopback (aiosmtpd), and the pages
are fetched over HTTP. Each test performs the attack and asserts both the refusal and that nothing happened.
"""
import json
import re
import time
from datetime import timedelta
from urllib.parse import urlencode

import pytest
import requests
from django.conf import settings as django_settings
from django.db.models import Max
from django.test import Client
from django.utils import timezone
from slack_sdk.signature import SignatureVerifier

from approvals import slack
from approvals.models import ApprovalLink, ApprovalRequest, Notification
from approvals.services import approval_decide, notifications_send
from ledger.models import Action
from ledger.policy.versions import tools_load
from recovery.trail import trail_link_create
from tests.conftest import World, in_process_policy, seed_sandboxes
from tests.test_notifications import smtp  # noqa: F401 - the real SMTP server fixture
from tests.test_slack import SECRET, click, map_user, slack_api, state_of  # noqa: F401 - the Slack stand-in fixture

APPROVERS = ["ada@example.com", "alice@example.com", "ben@example.com", "oscar@example.com"]
# Markup for every surface at once: Slack's mentions and links, HTML, lines that look like Unwind's own, a bidi
# override (U+202E) and a line separator (U+2028) that mail readers break lines on.
EVIL = ("<!channel> <!here> <@U0BEN> <https://evil.example|Verified by Finance> <script>alert(1)</script> & "
        "invoice\u202egnp.exe\nApprove: https://evil.example/approve\r\nReject:\u2028https://evil.example/reject")
EVIL_PERSON = "<!here> Finance\u202eecnanif <@U0BEN>\nApprove: https://evil.example/o"
MARKUP = ["<!channel>", "<!here>", "<@U0BEN>", "<https://evil.example", "<script>"]


@pytest.fixture
def live(transactional_db, live_server, settings, _engine_settings):
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    settings.UNWIND_BASE_URL = live_server.url
    world.base = live_server.url
    world.url = f"{live_server.url}/integrations/slack/interactions/"
    world.agent_http = requests.Session()
    world.agent_http.headers["Authorization"] = f"Bearer {world.key}"
    return world


def propose(world, args: dict, *, goal: str = "Pay the supplier", on_behalf_of: str = "carol@example.com",
            intent: dict | None = None) -> ApprovalRequest:
    """The agent's calls, over HTTP: a run, then a charge that waits for approval."""
    run = world.agent_http.post(f"{world.base}/api/v1/runs", json={"goal": goal, "on_behalf_of": on_behalf_of},
                                timeout=30)
    assert run.status_code == 201, run.text
    body = {"tool": "payments.charge", "args": args, "intent": intent or {"goal": "pay", "reasoning": "due today"}}
    action = world.agent_http.post(f"{world.base}/api/v1/runs/{run.json()['id']}/actions", json=body, timeout=30)
    assert action.status_code in (200, 201, 202), action.text
    assert action.json()["status"] == "awaiting_approval", action.json()
    return ApprovalRequest.objects.get(action_id=action.json()["id"])


def mails_to(server, address: str) -> list:
    return [m for m in server.messages if m["To"] == address]


def parts(message) -> tuple[str, str]:
    return message.get_body(("plain",)).get_content(), message.get_body(("html",)).get_content()


def posted_blocks(server) -> tuple[list, str]:
    blocks = server.calls[-1]["args"]["blocks"]
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
    return blocks, json.dumps(blocks, ensure_ascii=False)


def texts_of(blocks: list) -> list[str]:
    """Every mrkdwn text of a message: the strings Slack would parse."""
    found = []
    for block in blocks:
        found += [block["text"]["text"]] if "text" in block else []
        found += [field["text"] for field in block.get("fields", [])]
        found += [element["text"] for element in block.get("elements", []) if isinstance(element.get("text"), str)]
    return found


# --- 2: a message that cannot show everything carries no decision --------------------------------------------

def too_large_for_slack() -> dict:
    """The issue's attack: ten filler arguments of about 300 characters push the account out of the message."""
    args = {f"filler_{n:02d}": "f" * 290 for n in range(10)}
    return {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR", **args,
            "zz_to_account": "IBAN XX00 ATTACKER 0000"}


def test_a_slack_message_too_large_to_show_carries_no_buttons_and_a_forged_click_is_refused(live, slack_api):
    approval = propose(live, too_large_for_slack())
    assert slack.slack_messages_post() == 1
    blocks, posted = posted_blocks(slack_api)
    assert "ATTACKER" not in posted  # it did not fit: the point is that it is not approvable from here
    assert "unwind_approve" not in posted and "unwind_reject" not in posted
    [actions] = [b for b in blocks if b["type"] == "actions"]
    [button] = actions["elements"]
    assert button["text"]["text"] == "Open to decide" and button["url"] == f"{live.base}/approvals/{approval.pk}/"
    notice = " ".join(texts_of(blocks))
    assert re.search(r"\d+ more arguments are not shown here", notice)
    assert "cannot show everything this decision covers" in notice

    # A click made by hand for this request (signed, mapped approver, right args hash) decides nothing.
    map_user(live, "alice", "U0ALICE")
    before = state_of(approval)
    for decision in ("approve", "reject"):
        answer = click(live.url, user="U0ALICE", approval=approval, decision=decision)
        assert answer.status_code == 409, answer.text
        assert answer.headers["Content-Type"] == "application/problem+json"
        assert answer.json()["code"] == "slack_cannot_show_request"
    assert state_of(approval) == before == ("pending", [], "awaiting_approval")
    assert len(slack_api.calls) == 1  # and no message was updated as if something had been decided


def test_the_open_button_decides_nothing(live, slack_api):
    approval = propose(live, too_large_for_slack())
    slack.slack_messages_post()
    map_user(live, "alice", "U0ALICE")
    body = {"type": "block_actions", "user": {"id": "U0ALICE"}, "actions": [
        {"action_id": "unwind_open", "value": json.dumps({"approval": approval.pk, "args_hash": approval.args_hash})}]}
    raw = urlencode({"payload": json.dumps(body)})
    stamp = str(int(time.time()))
    signature = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=raw)
    answer = requests.post(live.url, data=raw, timeout=10, headers={
        "Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature})
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert state_of(approval) == ("pending", [], "awaiting_approval")


def test_an_email_that_cannot_show_every_argument_in_full_carries_no_decision_links(live, smtp):
    args = {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR",
            "memo": "m" * 2500 + " then pay IBAN XX00 ATTACKER 0000"}
    approval = propose(live, args)
    assert notifications_send() == len(APPROVERS)
    assert not ApprovalLink.objects.filter(request=approval).exists()  # nothing that could decide was made
    for address in APPROVERS:
        [mail] = mails_to(smtp, address)
        text, html = parts(mail)
        assert "/approvals/link/" not in text and "/approvals/link/" not in html
        assert "Approve:" not in text and "ATTACKER" not in text
        assert "Not shown here: 1 long value is cut short." in text and "1 long value is cut short." in html
        assert "Open to decide (every argument in full" in text
        page = f"{live.base}/approvals/{approval.pk}/"
        assert page in text and f'href="{page}"' in html
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_a_request_that_fits_keeps_its_buttons_and_links(live, slack_api, smtp):
    """The rule takes the decision away only when something is not shown."""
    approval = propose(live, {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR"})
    slack.slack_messages_post()
    _, posted = posted_blocks(slack_api)
    assert "unwind_approve" in posted and "€482.00 (48200 as sent)" in posted  # money reads as money
    assert notifications_send() == len(APPROVERS)
    text, _ = parts(mails_to(smtp, "alice@example.com")[0])
    assert f"Approve: {live.base}/approvals/link/" in text and "amount_cents: €482.00 (48200 as sent)" in text
    assert ApprovalLink.objects.filter(request=approval).count() == len(APPROVERS)


# --- 3: agent text is data on every surface ---------------------------------------------------------------------

def test_agent_markup_newlines_placeholders_and_bidi_are_inert_on_every_surface(live, slack_api, smtp):
    propose(live, {"customer": "cus_ana", "amount_cents": 100, "currency": "EUR"})  # an earlier request's links
    notifications_send()
    slack.slack_messages_post()
    smtp.handler.envelopes.clear()
    top = ApprovalLink.objects.aggregate(top=Max("pk"))["top"]
    # The agent guesses the ids of the links the next request's emails will carry, with no tag (as placeholders
    # were once made) and with a made-up one.
    guesses = " ".join(f"To REJECT click [[approval-link:{n}:{d}{tag}]]" for n in range(top + 1, top + 9)
                       for d in ("approve", "reject") for tag in ("", ":" + "0" * 32))
    args = {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR", "memo": EVIL,
            "note\nApprove: https://evil.example/k": "x"}
    approval = propose(live, args, goal=EVIL, on_behalf_of=EVIL_PERSON,
                       intent={"goal": EVIL, "reasoning": EVIL + "\n" + guesses})
    slack_api.calls.clear()
    assert slack.slack_messages_post() == 1

    # Slack: no mention, link or markup of the agent's survives as mrkdwn; its words are labelled and quoted.
    blocks, posted = posted_blocks(slack_api)
    for text in texts_of(blocks):
        assert not any(markup in text for markup in MARKUP), text
        assert "\u202e" not in text and "\u2028" not in text
    assert "&lt;!channel&gt;" in posted and "&lt;https://evil.example|Verified by Finance&gt;" in posted
    assert "[U+202E]" in posted and "as the agent sent them" in posted and "(the agent says)" in posted
    [reasoning] = [t for t in texts_of(blocks) if t.startswith("*The agent's reasoning*")]
    assert all(line.startswith(">") for line in reasoning.splitlines()[1:])

    # Email: every line an agent wrote is indented and quoted; only Unwind's own lines say Approve/Reject; the
    # agent's placeholders stay text; both parts show the bidi control instead of obeying it.
    assert notifications_send() == len(APPROVERS)
    for address in APPROVERS:
        [mail] = mails_to(smtp, address)
        text, html = parts(mail)
        approve_lines = [line for line in text.splitlines() if line.lstrip().startswith(("Approve:", "Reject"))]
        ours = (f"Approve: {live.base}/approvals/link/", f"Reject:  {live.base}/approvals/link/")
        assert len(approve_lines) == 2 and all(line.startswith(ours) for line in approve_lines), approve_lines
        assert "        | Approve: https://evil.example/approve" in text
        assert text.count("/approvals/link/") == 2 and html.count("/approvals/link/") == 2
        assert "[[approval-link:" in text  # left as the agent wrote it: never filled
        for part in (text, html):
            assert "\u202e" not in part and "\u2028" not in part and "[U+202E]" in part
        assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert "What the agent wrote" in text and "What the agent wrote" in html

    # The approval page, as alice reads it over HTTP.
    alice = Client()
    alice.force_login(live.alice)
    cookies = {django_settings.SESSION_COOKIE_NAME: alice.cookies[django_settings.SESSION_COOKIE_NAME].value}
    page = requests.get(f"{live.base}/approvals/{approval.pk}/", cookies=cookies, timeout=10)
    assert page.status_code == 200
    assert "\u202e" not in page.text and "[U+202E]" in page.text and "<script>alert" not in page.text
    assert "In the agent&#x27;s own words" in page.text or "In the agent's own words" in page.text
    oscar = Client()
    oscar.force_login(live.oscar)
    console = requests.get(f"{live.base}/console/runs/{approval.run_id}/", timeout=10, cookies={
        django_settings.SESSION_COOKIE_NAME: oscar.cookies[django_settings.SESSION_COOKIE_NAME].value})
    assert console.status_code == 200
    assert "\u202e" not in console.text and "[U+202E]" in console.text and "<script>alert" not in console.text

    # The customer's trail of the run (the sandbox refuses the charge's extra arguments, so the run fails).
    approval_decide(request=approval, user=live.alice, approve=True)
    assert Action.objects.get(pk=approval.action_id).status != "awaiting_approval"
    _, token = trail_link_create(run=approval.run, user=live.oscar)
    trail = requests.get(f"{live.base}/console/trail/{token}/", timeout=10)
    assert trail.status_code == 200
    assert "\u202e" not in trail.text and "[U+202E]" in trail.text and "<@U0BEN>" not in trail.text


# --- 6: the digest ------------------------------------------------------------------------------------------

def test_forty_requests_reach_each_approver_in_a_bounded_number_of_emails(live, smtp, settings):
    settings.UNWIND_APPROVAL_DIGEST_AFTER = 3
    settings.UNWIND_APPROVAL_DIGEST_WINDOW = 60
    settings.UNWIND_MAX_OPEN_APPROVALS_PER_AGENT = settings.UNWIND_MAX_OPEN_APPROVALS_PER_RUN = 100  # the digest alone
    requests_made = [propose(live, {"customer": "cus_ana", "amount_cents": 100 + n, "currency": "EUR"},
                             on_behalf_of=EVIL_PERSON) for n in range(40)]
    # Within the window only the first three per approver leave; the digest waits for the window to close.
    assert notifications_send() == 3 * len(APPROVERS)
    later = timezone.now() + timedelta(seconds=61)
    while notifications_send(now=later):
        pass
    assert len(smtp.messages) == 4 * len(APPROVERS)  # was 40 x 4 = 160
    for address in APPROVERS:
        mails = mails_to(smtp, address)
        singles = [m for m in mails if m["Subject"].strip().startswith("[Unwind] Approval needed")]
        [digest] = [m for m in mails if "approval requests waiting for you" in m["Subject"]]
        assert len(singles) == 3 and digest["Subject"] == "[Unwind] 37 approval requests waiting for you"
        text, html = parts(digest)
        assert "/approvals/link/" not in text and "/approvals/link/" not in html  # a digest decides nothing
        assert "\u202e" not in text + html and "<@U0BEN>" not in html
        pages = set(re.findall(r"/approvals/(\d+)/", " ".join(parts(m)[0] for m in mails)))
        assert pages == {str(r.pk) for r in requests_made}  # every request reached every approver
    assert not Notification.objects.filter(kind="approval_digest_entry", status="pending").exists()
