"""Approving from Slack, against a loopback HTTP server that plays Slack's Web API (chat.postMessage,
chat.update; it records every call) and Unwind's live server, to which the test sends signed interaction
payloads as Slack would. Mapping Slack users to people goes through the admin's command only.
"""
import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode

import pytest
import requests
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.utils import timezone
from slack_sdk.signature import SignatureVerifier

from approvals import slack
from approvals.models import ApprovalDecision, ApprovalRequest, SlackIdentity, SlackMessage
from approvals.services import approval_decide
from ledger.models import Action, AuditEvent
from ledger.tenancy import membership_set
from ledger.policy.versions import tool_upsert, tools_load
from tests.conftest import World, in_process_policy, seed_sandboxes
from tests.helpers import act, open_run
from tests.quick_server import QUICK_SHUTDOWN

SECRET = "slack-signing-secret-for-tests"
CHARGE = {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR"}


class FakeSlack(BaseHTTPRequestHandler):
    """Slack's side of chat.postMessage and chat.update: answers as Slack does and records each call."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Type", "").startswith("application/json"):
            args = json.loads(body)
        else:
            args = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        method = self.path.rsplit("/", 1)[-1]
        self.server.calls.append({"method": method, "args": args, "auth": self.headers.get("Authorization")})
        if self.server.down:
            answer, status = {"ok": False, "error": "service_unavailable"}, 503
        elif method == "chat.postMessage":
            stamp = f"1700000000.{len(self.server.calls):06d}"
            answer, status = {"ok": True, "channel": "C0APPROVALS", "ts": stamp}, 200
        elif method == "chat.update":
            answer, status = {"ok": True, "channel": args.get("channel"), "ts": args.get("ts")}, 200
        else:
            answer, status = {"ok": False, "error": "unknown_method"}, 200
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def slack_api(settings):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSlack)
    server.calls, server.down = [], False
    thread = threading.Thread(target=server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True)
    thread.start()
    settings.UNWIND_SLACK_BOT_TOKEN = "xoxb-test-token"
    settings.UNWIND_SLACK_SIGNING_SECRET = SECRET
    settings.UNWIND_SLACK_CHANNEL = "C0APPROVALS"
    settings.UNWIND_SLACK_API_URL = f"http://127.0.0.1:{server.server_port}/api/"
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def live(transactional_db, live_server, _engine_settings):
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    world.url = live_server.url + "/integrations/slack/interactions/"
    return world


def posted_request(world, server, **spec) -> ApprovalRequest:
    if spec:
        tool_upsert(tenant=world.acme, name="payments.charge", actor="test",
                    spec=dict(in_process_policy()["tools"]["payments.charge"], **spec))
    action = act(open_run(world, goal="Book the Lisbon trip"), "payments.charge", CHARGE,
                 intent={"goal": "pay", "reasoning": "the holds are in place", "confidence": 0.8})
    assert action.status == "awaiting_approval"
    assert slack.slack_messages_post() == 1
    return ApprovalRequest.objects.get(action=action)


def map_user(world, username: str, slack_user: str, tenant: str = "acme") -> None:
    call_command("slack_identity", tenant=tenant, user=username, slack_user=slack_user)


def click(url: str, *, user: str, approval: ApprovalRequest, decision: str = "approve", args_hash: str | None = None,
          secret: str = SECRET, timestamp: int | None = None):
    """POST a block_actions payload to Unwind, signed as Slack signs it."""
    value = json.dumps({"approval": approval.pk, "args_hash": args_hash or approval.args_hash})
    payload = {"type": "block_actions", "user": {"id": user, "username": "someone"}, "team": {"id": "T1"},
               "actions": [{"action_id": f"unwind_{decision}", "value": value, "type": "button"}]}
    body = urlencode({"payload": json.dumps(payload)})
    stamp = str(timestamp or int(time.time()))
    signature = SignatureVerifier(secret).generate_signature(timestamp=stamp, body=body)
    return requests.post(url, data=body, timeout=10, headers={
        "Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature})


def state_of(approval: ApprovalRequest) -> tuple:
    approval = ApprovalRequest.objects.get(pk=approval.pk)
    return (approval.status, list(ApprovalDecision.objects.filter(request=approval).values_list("user_id", "decision")),
            Action.objects.filter(pk=approval.action_id).values_list("status", flat=True).get())


def test_a_request_is_posted_with_its_preview_and_buttons(live, slack_api):
    approval = posted_request(live, slack_api)
    [call] = slack_api.calls
    assert call["method"] == "chat.postMessage" and call["auth"] == "Bearer xoxb-test-token"
    assert call["args"]["channel"] == "C0APPROVALS"
    blocks = call["args"]["blocks"]
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
    text = json.dumps(blocks)
    assert "payments.charge" in text and "high risk" in text and "48200" in text and "the holds are in place" in text
    buttons = blocks[-1]["elements"]
    assert [b["action_id"] for b in buttons] == ["unwind_approve", "unwind_reject", "unwind_open"]
    assert buttons[2]["url"].endswith(f"/approvals/{approval.pk}/") and "value" not in buttons[2]
    assert json.loads(buttons[0]["value"]) == {"approval": approval.pk, "args_hash": approval.args_hash}
    message = SlackMessage.objects.get(request=approval)
    assert message.ts and message.posted_at and message.channel == "C0APPROVALS"
    assert slack.slack_messages_post() == 0 and len(slack_api.calls) == 1  # posted once


def test_a_slack_outage_loses_nothing(live, slack_api):
    slack_api.down = True
    act(open_run(live), "payments.charge", CHARGE)
    assert slack.slack_messages_post() == 0
    message = SlackMessage.objects.get()
    assert message.posted_at is None and message.attempts == 1 and "service_unavailable" in message.last_error
    assert slack.slack_messages_post() == 0 and len(slack_api.calls) == 1  # not again before its backoff
    slack_api.down = False
    assert slack.slack_messages_post(now=timezone.now() + timedelta(seconds=5)) == 1
    assert SlackMessage.objects.get().ts and len(slack_api.calls) == 2


def test_a_request_decided_before_it_was_posted_is_not_posted(live, slack_api):
    action = act(open_run(live), "payments.charge", CHARGE)
    approval = ApprovalRequest.objects.get(action=action)
    approval_decide(request=approval, user=live.alice, approve=False, reason="not now")
    assert slack.slack_messages_post() == 0 and slack_api.calls == []  # nobody is asked about a decided request
    message = SlackMessage.objects.get(request=approval)
    assert message.posted_at is None and message.ts == "" and message.next_attempt_at is None
    assert message.last_error.startswith(f"not posted: request {approval.pk} was rejected at ")
    assert message.last_error.endswith(": not now")
    assert slack.slack_messages_post(now=timezone.now() + timedelta(hours=1)) == 0 and slack_api.calls == []


def test_nothing_is_posted_without_a_channel(live, settings):
    settings.UNWIND_SLACK_CHANNEL = ""
    act(open_run(live), "payments.charge", CHARGE)
    assert not SlackMessage.objects.exists() and slack.slack_messages_post() == 0


def test_the_api_base_must_be_an_http_origin(settings):
    for bad in ("file:///etc/passwd", "http://user:pw@slack.example/api/", "http://exa mple.com/"):
        settings.UNWIND_SLACK_API_URL = bad
        with pytest.raises(ImproperlyConfigured):
            slack.api_base()


def test_approve_from_slack_as_the_mapped_person_and_the_message_shows_it(live, slack_api):
    approval = posted_request(live, slack_api)
    map_user(live, "alice", "U0ALICE")
    answer = click(live.url, user="U0ALICE", approval=approval)
    assert answer.status_code == 200, answer.text
    status, decisions, action = state_of(approval)
    assert status == "approved" and decisions == [(live.alice.pk, "approve")] and action == "succeeded"
    update = slack_api.calls[-1]
    assert update["method"] == "chat.update" and update["args"]["ts"] == SlackMessage.objects.get().ts
    blocks = json.dumps(update["args"]["blocks"])
    assert "Approved by alice." in blocks and "unwind_approve" not in blocks  # the buttons are gone
    assert AuditEvent.objects.filter(kind="approval.approve", actor="user:alice").exists()


def test_reject_from_slack(live, slack_api):
    approval = posted_request(live, slack_api)
    map_user(live, "ben", "U0BEN")
    answer = click(live.url, user="U0BEN", approval=approval, decision="reject")
    assert answer.status_code == 200, answer.text
    approval.refresh_from_db()
    assert approval.status == "rejected" and "rejected in Slack by ben" in approval.outcome_reason
    assert Action.objects.get(pk=approval.action_id).status == "rejected"
    assert "Rejected by ben" in json.dumps(slack_api.calls[-1]["args"]["blocks"])


@pytest.mark.parametrize("forge", ["wrong_secret", "stale", "unsigned", "body_changed"])
def test_a_bad_or_stale_signature_is_refused_and_changes_nothing(live, slack_api, forge):
    approval = posted_request(live, slack_api)
    map_user(live, "alice", "U0ALICE")
    before, calls = state_of(approval), len(slack_api.calls)
    if forge == "wrong_secret":
        answer = click(live.url, user="U0ALICE", approval=approval, secret="not-the-secret")
    elif forge == "stale":
        answer = click(live.url, user="U0ALICE", approval=approval, timestamp=int(time.time()) - 600)
    elif forge == "unsigned":
        answer = requests.post(live.url, data={"payload": "{}"}, timeout=10)
    else:
        stamp = str(int(time.time()))
        signed = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body="payload=%7B%7D")
        value = json.dumps({"approval": approval.pk, "args_hash": approval.args_hash})
        body = urlencode({"payload": json.dumps({"user": {"id": "U0ALICE"},
                                                 "actions": [{"action_id": "unwind_approve", "value": value}]})})
        answer = requests.post(live.url, data=body, timeout=10, headers={
            "Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": signed})
    assert answer.status_code == 401 and answer.json()["code"] == "slack_signature_invalid"
    assert state_of(approval) == before and len(slack_api.calls) == calls


def test_an_unmapped_slack_user_is_refused(live, slack_api):
    approval = posted_request(live, slack_api)
    map_user(live, "mallory", "U0MALLORY", tenant="globex")  # mapped, but in another tenant
    before = state_of(approval)
    for user in ("U0NOBODY", "U0MALLORY"):
        answer = click(live.url, user=user, approval=approval)
        assert answer.status_code == 403 and answer.json()["code"] == "slack_user_unmapped"
    assert state_of(approval) == before


def test_separation_of_duties_holds_in_slack(live, slack_api):
    carol = live.users["alice"].__class__.objects.create_user("carol", "carol@example.com", "pw-carol")
    membership_set(tenant=live.acme, user=carol, role="approver")
    approval = posted_request(live, slack_api)  # on behalf of carol@example.com
    map_user(live, "carol", "U0CAROL")
    map_user(live, "victor", "U0VICTOR")  # a viewer
    before = state_of(approval)
    for user in ("U0CAROL", "U0VICTOR"):
        answer = click(live.url, user=user, approval=approval)
        assert answer.status_code == 403 and answer.json()["code"] == "permission_denied"
    assert state_of(approval) == before


def test_a_quorum_of_two_needs_two_different_people(live, slack_api):
    approval = posted_request(live, slack_api, approvals_required=2)
    map_user(live, "alice", "U0ALICE")
    map_user(live, "ben", "U0BEN")
    assert click(live.url, user="U0ALICE", approval=approval).status_code == 200
    assert "alice approved (1 of 2)" in json.dumps(slack_api.calls[-1]["args"]["blocks"])
    assert "unwind_approve" in json.dumps(slack_api.calls[-1]["args"]["blocks"])  # buttons stay for the next person
    again = click(live.url, user="U0ALICE", approval=approval)
    assert again.status_code == 409
    assert state_of(approval)[0] == "pending"
    assert click(live.url, user="U0BEN", approval=approval).status_code == 200
    status, decisions, action = state_of(approval)
    assert status == "approved" and len(decisions) == 2 and action == "succeeded"


def test_a_button_for_other_arguments_is_refused(live, slack_api):
    approval = posted_request(live, slack_api)
    map_user(live, "alice", "U0ALICE")
    before = state_of(approval)
    answer = click(live.url, user="U0ALICE", approval=approval, args_hash="f" * 64)
    assert answer.status_code == 409 and answer.json()["code"] == "state_conflict"
    assert state_of(approval) == before


def test_a_new_policy_version_voids_and_slack_cannot_approve(live, slack_api):
    approval = posted_request(live, slack_api)
    map_user(live, "alice", "U0ALICE")
    tool_upsert(tenant=live.acme, name="payments.charge", actor="user:ada",
                spec=dict(in_process_policy()["tools"]["payments.charge"], description="a new policy"))
    answer = click(live.url, user="U0ALICE", approval=approval)
    assert answer.status_code == 409 and answer.json()["code"] == "approval_voided"
    assert state_of(approval)[0] == "voided" and state_of(approval)[1] == []


def test_only_the_command_maps_slack_users(live):
    map_user(live, "alice", "U0ALICE")
    with pytest.raises(CommandError):
        map_user(live, "ben", "U0ALICE")  # one person per Slack user
    with pytest.raises(CommandError):
        map_user(live, "mallory", "U0M")  # not a member of acme
    assert list(SlackIdentity.objects.values_list("slack_user_id", "user__username")) == [("U0ALICE", "alice")]
    assert AuditEvent.objects.filter(kind="slack.identity_set", actor="command:slack_identity").count() == 1
    call_command("slack_identity", tenant="acme", slack_user="U0ALICE", remove=True)
    assert not SlackIdentity.objects.exists()


def test_a_signed_payload_that_is_not_a_button_click_is_a_clear_400(live, slack_api):
    stamp = str(int(time.time()))
    for body in ("payload=not-json", "payload=%7B%7D", "nothing=here"):
        signature = SignatureVerifier(SECRET).generate_signature(timestamp=stamp, body=body)
        answer = requests.post(live.url, data=body, timeout=10, headers={
            "Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": signature})
        assert answer.status_code == 400 and answer.json()["code"] == "validation_error"


def test_without_a_signing_secret_every_click_is_refused(live, slack_api, settings):
    approval = posted_request(live, slack_api)
    map_user(live, "alice", "U0ALICE")
    settings.UNWIND_SLACK_SIGNING_SECRET = ""
    for secret in (SECRET, ""):
        answer = click(live.url, user="U0ALICE", approval=approval, secret=secret or "x")
        assert answer.status_code == 401 and answer.json()["code"] == "slack_signature_invalid"
    assert requests.get(live.url, timeout=10).status_code == 405
    assert state_of(approval)[:2] == ("pending", [])


def test_the_message_shows_a_decision_made_elsewhere_and_a_void(live, slack_api):
    approval = posted_request(live, slack_api)
    approval_decide(request=approval, user=live.ben, approve=False, reason="not this customer")  # the page's path
    update = slack_api.calls[-1]
    assert update["method"] == "chat.update" and "Rejected by ben: not this customer" in json.dumps(update["args"])
    assert "unwind_approve" not in json.dumps(update["args"]["blocks"])

    waiting = posted_request(live, slack_api)
    tool_upsert(tenant=live.acme, name="payments.charge", actor="user:ada",
                spec=dict(in_process_policy()["tools"]["payments.charge"], description="a new policy"))
    update = slack_api.calls[-1]
    assert update["method"] == "chat.update" and update["args"]["ts"] == SlackMessage.objects.get(request=waiting).ts
    assert "Voided: the policy of payments.charge changed" in json.dumps(update["args"]["blocks"])
