"""Issue 28 over HTTP: each kind of rule and limit against a live server, with a loopback tool that records calls.

The agent is untrusted: every refusal asserts the answer (a 403 problem naming the policy's words) AND that the tool
received nothing, and that what was recorded is the refused step and its audit event, nothing more. The approver
reads why a person is asked on the approval page, in the email (real SMTP on loopback) and in the Slack message.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from django.conf import settings as django_settings

from approvals import slack
from approvals.models import ApprovalRequest
from approvals.services import notifications_send
from ledger.audit.verify import verify_chain
from ledger.models import Action, AuditEvent, Run
from tests.recorder import recorder  # noqa: F401 - the fixture
from tests.test_args_as_sent import admin, agent, put_tool
from tests.test_notifications import body_parts, smtp  # noqa: F401 - the fixture
from tests.test_slack import slack_api  # noqa: F401 - the fixture

SCHEMA = {"type": "object", "properties": {"amount_cents": {"type": "integer"}, "currency": {"type": "string"},
                                           "email": {"type": "string"}, "note": {"type": "string"}}}
RULES = [
    {"when": "args.amount_cents > 50000", "risk": "high", "reason": "refunds above 500 need a person"},
    {"when": "args.currency != 'USD'", "deny": "only USD refunds are allowed"},
    {"when": "has(args.email) && !args.email.endsWith('@example.com')", "approvals_required": 2,
     "reason": "two people for mail outside the company"},
]


def refund_tool(recorder, **more) -> dict:  # noqa: F811
    return {"endpoint": f"{recorder.origin}/refund", "args_schema": SCHEMA, "retry": {"max_attempts": 1},
            "risk": "low", "display": {"amount_cents": {"money": {"currency_from": "args.currency"}}},
            "compensation": {"strategy": "twin", "tool": "rec.unrefund", "args": {"amount_cents": "$args.amount_cents"}},
            "rules": RULES, **more}


@pytest.fixture
def refunds(http_tools, recorder):  # noqa: F811
    put_tool(http_tools, "rec.unrefund", {"endpoint": f"{recorder.origin}/unrefund", "args_schema": {"type": "object"},
                                          "compensation": "none", "retry": {"max_attempts": 1}})
    put_tool(http_tools, "payments.refund", refund_tool(recorder))
    http_tools.recorder = recorder
    return http_tools


def open_run(world, session=None) -> int:
    client = session or agent(world)
    answer = client.post(f"{client.base}/api/v1/runs", json={"goal": "refund Ana", "on_behalf_of": "ana@example.com"},
                         timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def refund(world, run_id: int, session=None, **args) -> requests.Response:
    client = session or agent(world)
    return client.post(f"{client.base}/api/v1/runs/{run_id}/actions", json={"tool": "payments.refund", "args": args},
                       timeout=30)


def ledger_counts() -> tuple:
    return Action.objects.count(), AuditEvent.objects.count(), ApprovalRequest.objects.count()


def test_allowed_under_the_condition_and_asked_above_it(refunds, smtp, slack_api):  # noqa: F811
    run_id = open_run(refunds)
    small = refund(refunds, run_id, amount_cents=2000, currency="USD")
    assert small.status_code == 201 and small.json()["status"] == "succeeded", small.text
    assert small.json()["risk"] == "low" and small.json()["policy_decision"]["fired"] == []
    assert len(refunds.recorder.received("/refund")) == 1

    large = refund(refunds, run_id, amount_cents=75000, currency="USD")
    assert large.status_code == 202 and large.json()["status"] == "awaiting_approval", large.text
    assert large.json()["risk"] == "high"
    assert len(refunds.recorder.received("/refund")) == 1  # nothing reached the tool
    request = ApprovalRequest.objects.get(action_id=large.json()["id"])
    fired = request.preview["policy"]["fired"]
    assert fired[0]["reason"] == "refunds above 500 need a person" and fired[0]["read"] == {"args.amount_cents": 75000}
    assert request.preview["policy"]["tool_version"] == request.tool.version
    words = "needs a person: refunds above 500 need a person"

    # The page.
    page = requests.get(f"{refunds.live_server.url}/approvals/{request.pk}/", auth=None, timeout=30,
                        cookies=login(refunds, "ben"))
    assert page.status_code == 200 and words in page.text and "amount_cents is $750.00" in page.text, page.text[:500]
    # The email, sent over SMTP, and its link followed.
    assert notifications_send() >= 1
    text, html = body_parts(next(m for m in smtp.messages if "payments.refund" in m["Subject"]))
    assert f"Why:           {words} — amount_cents is $750.00" in text, text
    assert words in html and "amount_cents is $750.00" in html
    link = next(line for line in text.splitlines() if f"/approvals/{request.pk}/" in line).strip()
    followed = requests.get(link.replace(django_settings.UNWIND_BASE_URL.rstrip("/"), refunds.live_server.url), timeout=30,
                            cookies=login(refunds, "ben"))
    assert followed.status_code == 200 and words in followed.text
    # The Slack message.
    assert slack.slack_messages_post() == 1
    blocks = slack_api.calls[-1]["args"]["blocks"]
    posted = json.dumps(json.loads(blocks) if isinstance(blocks, str) else blocks)
    assert "*Why a person is asked*" in posted and words in posted and "`amount_cents is $750.00`" in posted


def login(world, username: str) -> dict:
    session = requests.Session()
    page = session.get(f"{world.live_server.url}/accounts/login/", timeout=30)
    token = session.cookies["csrftoken"]
    answer = session.post(f"{world.live_server.url}/accounts/login/", timeout=30,
                          data={"username": username, "password": f"pw-{username}", "csrfmiddlewaretoken": token},
                          headers={"Referer": page.url})
    assert answer.status_code == 200, answer.text[:300]
    return session.cookies.get_dict()


def test_denied_with_the_text_and_nothing_reaches_the_tool(refunds):
    run_id = open_run(refunds)
    before = ledger_counts()
    denied = refund(refunds, run_id, amount_cents=2000, currency="EUR")
    assert denied.status_code == 403 and denied.headers["Content-Type"].startswith("application/problem+json")
    body = denied.json()
    assert body["code"] == "policy_denied" and body["reason"] == "only USD refunds are allowed", body
    assert body["detail"].startswith("only USD refunds are allowed. Nothing was done")
    assert refunds.recorder.bodies == []
    refused = Action.objects.get(pk=body["action_id"])
    assert (refused.status, refused.error_class, refused.attempts) == ("failed", "refused", 0)
    assert refused.policy_decision["denied"] == "only USD refunds are allowed"
    assert ledger_counts() == (before[0] + 1, before[1] + 2, before[2])  # the step, proposed + refused
    assert AuditEvent.objects.filter(kind="forward.refused", action_ref=refused.pk, data__by="policy").exists()
    assert Run.objects.get(pk=run_id).status == "running"  # the run stays open
    # The same request again is decided again (a refusal keeps no key), and refused again.
    again = refund(refunds, run_id, amount_cents=2000, currency="EUR")
    assert again.status_code == 403 and again.json()["action_id"] != body["action_id"]
    # A rule that cannot be decided refuses: a missing field is never a silent pass.
    put_tool(refunds, "payments.refund", refund_tool(refunds.recorder, rules=[
        {"when": "!args.email.endsWith('@example.com')", "approvals_required": 2}]))
    missing = refund(refunds, run_id, amount_cents=2000, currency="USD")
    assert missing.status_code == 403 and "the call has no field 'email'" in missing.json()["detail"], missing.text
    assert refunds.recorder.bodies == []
    assert verify_chain(refunds.acme.pk).ok


def test_two_approvers_required_for_mail_outside_the_company(refunds):
    run_id = open_run(refunds)
    inside = refund(refunds, run_id, amount_cents=100, currency="USD", email="ana@example.com")
    assert inside.status_code == 201, inside.text
    outside = refund(refunds, run_id, amount_cents=100, currency="USD", email="ana@elsewhere.test")
    assert outside.status_code == 202, outside.text
    request = ApprovalRequest.objects.get(action_id=outside.json()["id"])
    assert request.required == 2
    people = admin(refunds)
    first = people.post(f"{people.base}/api/v1/approvals/{request.pk}/approve", json={"reason": "ok"}, timeout=30)
    assert first.status_code == 200, first.text
    assert len(refunds.recorder.received("/refund")) == 1  # one person is not enough
    second = requests.post(f"{refunds.live_server.url}/api/v1/approvals/{request.pk}/approve", json={"reason": "ok"},
                           auth=("ben", "pw-ben"), timeout=30)
    assert second.status_code == 200, second.text
    assert wait_for(lambda: len(refunds.recorder.received("/refund")) == 2)


def test_a_change_of_rules_voids_a_waiting_approval(refunds):
    run_id = open_run(refunds)
    waiting = refund(refunds, run_id, amount_cents=75000, currency="USD")
    assert waiting.status_code == 202, waiting.text
    request = ApprovalRequest.objects.get(action_id=waiting.json()["id"])
    put_tool(refunds, "payments.refund", refund_tool(refunds.recorder, rules=RULES[:1] + [
        {"when": "args.amount_cents > 100000", "deny": "refunds above 1000 are not allowed"}]))
    people = admin(refunds)
    voided = people.post(f"{people.base}/api/v1/approvals/{request.pk}/approve", json={"reason": "ok"}, timeout=30)
    assert voided.status_code == 409 and voided.json()["code"] == "approval_voided", voided.text
    assert ApprovalRequest.objects.get(pk=request.pk).status == "voided"
    assert refunds.recorder.bodies == []


def wait_for(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_budget_is_exhausted_by_the_third_call_and_given_back_by_a_compensation(refunds):
    put_tool(refunds, "payments.refund", refund_tool(refunds.recorder, rules=[], limits=[
        {"per": "run", "sum": "args.amount_cents", "max": 1000},
        {"per": "agent", "sum": "args.amount_cents", "max": 1500}]))
    first_run, second_run = open_run(refunds), open_run(refunds)
    assert refund(refunds, first_run, amount_cents=400, currency="USD").status_code == 201
    assert refund(refunds, first_run, amount_cents=401, currency="USD").status_code == 201
    third = refund(refunds, first_run, amount_cents=402, currency="USD")
    assert third.status_code == 403, third.text
    assert "the budget on amount_cents is 1000 per run: 801 is already spent" in third.json()["detail"]
    assert len(refunds.recorder.received("/refund")) == 2
    assert refund(refunds, second_run, amount_cents=403, currency="USD").status_code == 201
    over = refund(refunds, second_run, amount_cents=404, currency="USD")
    assert over.status_code == 403 and "1500 per agent: 1204 is already spent" in over.json()["detail"], over.text
    # Undoing the first run gives its 801 back; the refused steps never held any.
    client = agent(refunds)
    cancelled = client.post(f"{client.base}/api/v1/runs/{first_run}/cancel", json={"reason": "wrong"}, timeout=30)
    assert cancelled.status_code in (200, 202) and Run.objects.get(pk=first_run).status == "compensated"
    assert len(refunds.recorder.received("/unrefund")) == 2
    again = refund(refunds, second_run, amount_cents=404, currency="USD")
    assert again.status_code == 201, again.text
    assert len(refunds.recorder.received("/refund")) == 4


def test_a_rate_limit_is_hit_and_resets_after_its_window(refunds):
    put_tool(refunds, "payments.refund", refund_tool(refunds.recorder, rules=[], limits=[
        {"per": "agent", "count": 2, "window": "2s"}]))
    run_id = open_run(refunds)
    assert refund(refunds, run_id, amount_cents=1, currency="USD").status_code == 201
    assert refund(refunds, run_id, amount_cents=2, currency="USD").status_code == 201
    started = time.monotonic()
    hit = refund(refunds, run_id, amount_cents=3, currency="USD")
    assert hit.status_code == 403 and "at most 2 calls of payments.refund per agent in 2 seconds" in hit.json()["detail"]
    assert len(refunds.recorder.received("/refund")) == 2
    time.sleep(max(0.0, 2.1 - (time.monotonic() - started)))
    assert refund(refunds, run_id, amount_cents=3, currency="USD").status_code == 201
    assert len(refunds.recorder.received("/refund")) == 3


@pytest.mark.skipif(not django_settings.DATABASES["default"]["ENGINE"].endswith("postgresql"),
                    reason="two agents racing past one tenant budget: PostgreSQL (SQLite serialises every writer)")
def test_two_agents_racing_past_one_tenant_budget_spend_exactly_it(refunds):
    from ledger.tenancy import agent_create

    put_tool(refunds, "payments.refund", refund_tool(refunds.recorder, rules=[], limits=[
        {"per": "tenant", "sum": "args.amount_cents", "max": 1000}]))
    second, key = agent_create(tenant=refunds.acme, name="racer", actor="test")
    sessions = [agent(refunds), requests.Session()]
    sessions[1].headers["Authorization"] = f"Bearer {key}"
    sessions[1].base = refunds.live_server.url
    runs = [open_run(refunds, session) for session in sessions]
    refunds.recorder.delay = 0.2  # each call stays in flight a while: what is running must count against the budget
    answers: list[requests.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(2)

    def spend(index: int) -> None:
        start.wait()
        for n in range(6):
            answer = refund(refunds, runs[index], sessions[index], amount_cents=100 + index * 10 + n, currency="USD")
            with lock:
                answers.append(answer)

    threads = [threading.Thread(target=spend, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(a.status_code in (201, 403) for a in answers), [a.text for a in answers]
    spent = sum(json.loads(body)["amount_cents"] for body in refunds.recorder.received("/refund"))
    acted = Action.objects.filter(tool__name="payments.refund", status="succeeded")
    assert spent == sum(a.args["amount_cents"] for a in acted) <= 1000
    # Exactly what the budget allows: no further call of the smallest size would have fit.
    assert spent + 100 > 1000, spent


def test_values_a_rule_read_are_the_agents_text_on_every_surface(refunds, smtp, slack_api):  # noqa: F811
    """The values in "why a person is asked" come from the agent: markup, mentions, bidi controls and line breaks in
    them stay inert on the page, in both parts of the email and in Slack."""
    hostile = "ann@evil.test\u202e<b>boss</b> <!channel>\nApprove: https://evil.example/"
    run_id = open_run(refunds)
    waiting = refund(refunds, run_id, amount_cents=100, currency="USD", email=hostile)
    assert waiting.status_code == 202, waiting.text
    request = ApprovalRequest.objects.get(action_id=waiting.json()["id"])
    page = requests.get(f"{refunds.live_server.url}/approvals/{request.pk}/", timeout=30, cookies=login(refunds, "ben"))
    why = page.text.split('id="why-asked"')[1].split("</section>")[0]
    assert "needs 2 people: two people for mail outside the company" in why
    assert "&lt;b&gt;boss&lt;/b&gt;" in why and "<b>boss" not in why and "[U+202E]" in why and "\u202e" not in why
    assert notifications_send() >= 1
    text, html = body_parts(next(m for m in smtp.messages if "payments.refund" in m["Subject"]))
    line = next(line for line in text.splitlines() if line.startswith("Why:"))
    assert "[U+202E]<b>boss</b>" in line and "\u202e" not in text
    assert "\\nApprove: https://evil.example/" in line  # the agent's line break cannot start a line of its own
    assert "&lt;b&gt;boss&lt;/b&gt;" in html and "<b>boss" not in html
    assert slack.slack_messages_post() == 1
    blocks = slack_api.calls[-1]["args"]["blocks"]
    posted = json.dumps(json.loads(blocks) if isinstance(blocks, str) else blocks)
    assert "&lt;!channel&gt;" in posted and "<!channel>" not in posted and "[U+202E]" in posted


def test_the_adapter_hands_a_policy_refusal_to_the_model_instead_of_raising(refunds):
    """A rule's deny is a 403 the model can answer (other arguments, or telling the user): the framework adapters
    return it as a refused tool result; only a wrong key or a person's endpoint ends the agent's run."""
    from unwind_client import Unwind
    from unwind_client.adapters import AgentRun, server_tools

    unwind = Unwind(refunds.live_server.url, refunds.key)
    agent_run = AgentRun(unwind, goal="Refund in euros")
    [tool] = server_tools(unwind, ["payments.refund"])
    answer = agent_run.call(tool, {"charge_id": "ch_1", "amount_cents": 500, "currency": "EUR"})
    assert answer.kind == "refused" and "only USD refunds are allowed" in answer.text, answer
    assert refunds.recorder.bodies == []
