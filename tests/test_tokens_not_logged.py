"""Issue 39, finding 5: no live token reaches a log line or a span.

Any 4xx on an approval link or a share link logged the whole link (`django.request`, `django.security.csrf`), and
an anonymous browser replaying a logged approval link approved the request. Here each token route gets a bad
method, a POST without CSRF, a bad form and a wrong path, from a browser signed in as nobody, against a server
process of its own: the README's production command (plain and JSON log lines) and the development server (DEBUG
on: its request lines and Django's console too). Its whole output and every span it exported (to an OTLP receiver
on loopback) must hold none of the tokens; the refusals must have changed nothing; and the path as logged, replayed,
opens nothing.
"""
from __future__ import annotations

import json
import re
import time

import pytest
import requests

from approvals.models import ApprovalDecision, ApprovalLink, ApprovalStatus
from approvals.services import notifications_send
from ledger.log_redaction import REDACTED, redact, token_route_prefixes
from recovery.models import CustomerRequest
from recovery.trail import trail_link_create
from tests.live_processes import Served
from tests.otlp_receiver import OtlpReceiver
from tests.test_approval_links import LINK, mailed_links, path_of
from tests.test_notifications import charge_waiting, smtp  # noqa: F401 - the SMTP fixture

SLACK_RESPONSE_URL = "https://hooks.slack.com/actions/T0UNWIND/1234567890/qwertyuiopASDFGHJKL12345"
SLACK_VERIFICATION = "verif1cationT0kenOfTheSlackApp"


def still_waiting(approval) -> dict:
    approval.refresh_from_db()
    return {"status": approval.status, "decisions": ApprovalDecision.objects.filter(request=approval).count(),
            "links used": ApprovalLink.objects.filter(request=approval, used_at__isnull=False).count(),
            "customer requests": CustomerRequest.objects.filter(run_id=approval.run_id).count()}


def csrf_of(browser: requests.Session, url: str) -> str:
    page = browser.get(url, timeout=10)
    assert page.status_code == 200, page.text[:300]
    return browser.cookies["csrftoken"]


def attacks(server: Served, links: dict, share: str, agent_key: str, approval) -> dict[str, int]:
    """Every token route with a bad method, a missing CSRF token, a bad form and a wrong path: name -> status."""
    approve, reject = path_of(links["approve"]), path_of(links["reject"])
    trail = f"/console/trail/{share}/"
    answered = {}
    anonymous, browser = requests.Session(), requests.Session()
    token = csrf_of(browser, server.url + reject)
    answered["approve: PUT"] = browser.put(server.url + approve, headers={"X-CSRFToken": token},
                                           timeout=10).status_code
    answered["approve: POST without CSRF"] = anonymous.post(server.url + approve, timeout=10).status_code
    answered["approve: wrong path"] = anonymous.get(f"{server.url}{approve}extra/", timeout=10).status_code
    answered["approve: under /api/"] = requests.get(
        f"{server.url}/api/v1{approve}", headers={"Authorization": f"Bearer {agent_key}"}, timeout=10).status_code
    answered["reject: no reason"] = browser.post(server.url + reject, data={"csrfmiddlewaretoken": token,
                                                                             "reason": " "}, timeout=10).status_code
    answered["reject: bad CSRF"] = browser.post(server.url + reject, data={"csrfmiddlewaretoken": "x" * 64,
                                                                            "reason": "no"}, timeout=10).status_code
    answered["share: POST without CSRF"] = anonymous.post(server.url + trail, timeout=10).status_code
    answered["share: stop without CSRF"] = anonymous.post(f"{server.url}{trail}stop/{approval.action_id}/",
                                                          timeout=10).status_code
    token = csrf_of(browser, server.url + trail)
    answered["share: bad form"] = browser.post(f"{server.url}{trail}ask/", data={
        "csrfmiddlewaretoken": token, "kind": "nonsense", "text": "x"}, timeout=10).status_code
    answered["share: wrong path"] = anonymous.get(f"{server.url}{trail}nope/", timeout=10).status_code
    payload = {"type": "block_actions", "token": SLACK_VERIFICATION, "response_url": SLACK_RESPONSE_URL,
               "user": {"id": "U1"}, "actions": [{"action_id": "unwind_approve", "value": json.dumps(
                   {"approval": approval.pk, "args_hash": approval.args_hash})}]}
    answered["slack: unsigned"] = anonymous.post(f"{server.url}/integrations/slack/interactions/",
                                                 data={"payload": json.dumps(payload)}, timeout=10).status_code
    return answered


@pytest.mark.slow
@pytest.mark.parametrize("kind,log_format", [("gunicorn", "plain"), ("gunicorn", "json"), ("runserver", "plain")])
def test_no_token_reaches_a_log_line_or_a_span(transactional_db, tools, smtp, tmp_path, kind, log_format):  # noqa: F811
    approval = charge_waiting(tools)
    assert notifications_send() == 4
    links = mailed_links(smtp, "alice@example.com")
    _, share = trail_link_create(run=approval.run, user=tools.oscar)
    secrets = {"approve": LINK.search(links["approve"]).group(2), "reject": LINK.search(links["reject"]).group(2),
               "share": share, "slack response_url": SLACK_RESPONSE_URL.rsplit("/", 1)[1],
               "slack verification token": SLACK_VERIFICATION}
    before = still_waiting(approval)
    receiver = OtlpReceiver()
    server = Served(kind, tmp_path / "server.log", workers=2, UNWIND_LOG_FORMAT=log_format,
                    OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="100").start()
    try:
        answered = attacks(server, links, share, tools.key, approval)
        # An anonymous browser replays the first link the log shows (alice's approve link): it opens it, takes a
        # CSRF cookie from the login page, and sends the POST that decides.
        logged = re.search(r"/approvals/link/[^/\s\"]+/", server.log.read_text()).group(0)
        replay = requests.Session()
        opened = replay.get(server.url + logged, timeout=10).status_code
        token = csrf_of(replay, f"{server.url}/accounts/login/")
        replayed = (opened, replay.post(server.url + logged, data={"csrfmiddlewaretoken": token, "reason": "ok"},
                                        timeout=10).status_code)
        deadline = time.monotonic() + 20
        while not any(span["name"].startswith("GET /api/v1/approvals/link/") for span in receiver.spans):
            assert time.monotonic() < deadline, [span["name"] for span in receiver.spans]
            time.sleep(0.1)
    finally:
        server.stop()
        receiver.close()
    assert answered == {"approve: PUT": 405, "approve: POST without CSRF": 403, "approve: wrong path": 404,
                        "approve: under /api/": 404, "reject: no reason": 400, "reject: bad CSRF": 403,
                        "share: POST without CSRF": 403, "share: stop without CSRF": 403, "share: bad form": 403,
                        "share: wrong path": 404, "slack: unsigned": 401}, answered
    assert logged == f"/approvals/link/{REDACTED}/" and replayed == (404, 404)
    assert still_waiting(approval) == before == {"status": ApprovalStatus.PENDING, "decisions": 0, "links used": 0,
                                                 "customer requests": 0}

    log = server.log.read_text()
    spans = b"".join(receiver.raw)
    for name, secret in secrets.items():
        assert secret not in log, (name, [line for line in log.splitlines() if secret in line])
        assert secret.encode() not in spans, name
    # The refusals were logged, redacted: the log still says which route and why.
    logged = [line for line in log.splitlines() if f"/approvals/link/{REDACTED}/" in line]
    assert any("Method Not Allowed (PUT)" in line for line in logged), log[-3000:]
    assert any("Forbidden (CSRF cookie not set.)" in line for line in logged), log[-3000:]
    assert any(f"/console/trail/{REDACTED}/stop/{approval.action_id}/" in line for line in log.splitlines())
    assert any(span["name"] == f"GET /api/v1/approvals/link/{REDACTED}/" for span in receiver.spans)


def test_the_token_routes_are_found_in_the_urlconf(db):
    """A new `<str:token>` route is redacted without a change here; this list says which routes that is today."""
    assert token_route_prefixes() == ["approvals/link/", "console/trail/"]


@pytest.mark.parametrize("line,expected", [
    ("Forbidden (CSRF cookie not set.): /approvals/link/AbC_-123456789012345678901234567890123456789/",
     f"Forbidden (CSRF cookie not set.): /approvals/link/{REDACTED}/"),
    ('"GET /console/trail/AbC_-1234567890123456789012345678901234567/stop/4/ HTTP/1.1" 403 12',
     f'"GET /console/trail/{REDACTED}/stop/4/ HTTP/1.1" 403 12'),
    ("GET /accounts/login/?next=%2Fapprovals%2Flink%2FAbC123%2F",
     f"GET /accounts/login/?next=%2Fapprovals%2Flink%2F{REDACTED}%2F"),
    ("https://unwind.example.com/approvals/link/AbC123", f"https://unwind.example.com/approvals/link/{REDACTED}"),
    ("GET /x?token=abc&page=2&api_key=k&code=9", f"GET /x?token={REDACTED}&page=2&api_key={REDACTED}&code={REDACTED}"),
    ("Bearer uw_0123456789ab_SeCrEt-_value", f"Bearer uw_0123456789ab_{REDACTED}"),
    ("deploy key uwd_0123456789ab_SeCrEt", f"deploy key uwd_0123456789ab_{REDACTED}"),
    ("posting with xoxb-1-2-abc to https://hooks.slack.com/actions/T/1/x", f"posting with xox-{REDACTED} to "
                                                                           f"https://hooks.slack.com/{REDACTED}"),
    ("Not Found: /approvals/42/", "Not Found: /approvals/42/"),
    ("Not Found: /console/runs/7/trail/email/", "Not Found: /console/runs/7/trail/email/"),
])
def test_what_is_redacted(db, line, expected):
    assert redact(line) == expected
