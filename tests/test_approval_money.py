"""Issue 38, finding 5: an undo's approval reads its amount as money, and only the agent's words are labelled so.

The demo's refund (sandbox/demo.py's Madrid trip: a €610.00 charge, 61000 cents, approved; the run then cancelled
after its pivot and compensated by an operator) waits for a person on every approval surface: the page and the
inbox over a live server, the email through a real SMTP server on loopback, the Slack post through a loopback
stand-in for Slack's API. Each shows the charge it undoes as "€610.00", from one helper
(approvals/surfaces.py, `amounts`), and none labels Unwind's words (the undo's goal, its arguments worked out
from the charge) as the agent's.
"""
import json
import re

from approvals import slack
from approvals.models import ApprovalRequest
from approvals.services import approval_decide, notifications_send
from ledger.engine.runs import run_cancel, run_compensate, run_open
from ledger.models import Action, Tool
from tests.test_notifications import body_parts, smtp  # noqa: F401 - a real SMTP server on loopback
from tests.test_slack import slack_api  # noqa: F401 - the loopback stand-in for Slack's Web API
from tests.test_trail import console, live_tools  # noqa: F401 - the live server with the sandbox tools
from tests.helpers import act

MADRID = {"customer": "cus_carol", "amount_cents": 61000, "currency": "EUR"}
UNWIND_GOAL = "undo step 3 (payments.charge)"  # what the engine records as the refund's goal: its words


def madrid_refund(world) -> ApprovalRequest:
    """The demo's Madrid trip: flight, hotel, a €610.00 charge a person approves; cancelled after the charge, an
    operator compensates, and the refund of the charge waits for an approver."""
    run = run_open(tenant=world.acme, agent=world.agent, goal="Trip to Madrid", on_behalf_of="carol@company.com",
                   actor="agent:booker")
    act(run, "travel.book_flight", {"passenger": "Carol", "flight": "IB3117", "date": "2026-12-18"})
    act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Urban", "nights": 2})
    charge = act(run, "payments.charge", MADRID, intent={"goal": "pay for the Madrid trip",
                                                         "reasoning": "flight and hotel are booked",
                                                         "confidence": 0.93})
    approval_decide(request=ApprovalRequest.objects.get(action=charge), user=world.alice, approve=True, reason="")
    charge.refresh_from_db()
    assert charge.status == "succeeded", charge.error_message
    run_cancel(run=run, actor="agent:booker", reason="Carol changed her plans")
    run.refresh_from_db()
    assert run.status == "needs_attention"  # cancelled after the pivot: a person decides
    run_compensate(run=run, actor="user:oscar", reason="refund the trip")
    refund = Action.objects.get(run=run, kind="compensation", tool__name="payments.refund")
    assert refund.status == "awaiting_approval"
    return ApprovalRequest.objects.get(action=refund)


def squeezed(html: str) -> str:
    return re.sub(r"\s+", " ", html)


def test_the_refund_page_and_the_inbox_show_the_charge_as_money(live_tools):  # noqa: F811
    refund = madrid_refund(live_tools)
    ben = console(live_tools.live_server, "ben")
    base = live_tools.live_server.url

    page = ben.get(f"{base}/approvals/{refund.pk}/", timeout=10)
    assert page.status_code == 200
    body = squeezed(page.text)
    assert "This undoes step 3, payments.charge called with amount_cents = €610.00 (61000 as sent)" in body
    assert "amount_cents = 61000" not in body
    # The charge as it stands before the refund: its amount as money (the raw value only in the tooltip).
    before = re.search(r'<th scope="row"><code>amount_cents</code></th>\s*<td[^>]*>(.*?)</td>', page.text, re.S)
    assert before and re.search(r'title="61000">€610\.00<', before.group(1)), before and before.group(1)

    # Unwind asks, in its own words; the agent's words are only what it sent when it opened the run.
    assert "In the agent's own words: it wrote everything below" not in page.text
    why = re.search(r'<section class="panel" id="why-undo">(.*?)</section>', page.text, re.S).group(1)
    assert "Unwind asks, not the agent" in why and "€610.00" in why
    unwinds, agents = why.split("In the agent's own words")
    assert re.findall(r"<dt>(.*?)</dt>", agents) == ["Run goal", "On behalf of"]
    assert "Trip to Madrid" in agents and "carol@company.com" in agents
    assert UNWIND_GOAL not in agents and "Step goal" not in agents

    inbox = ben.get(f"{base}/approvals/", timeout=10)
    row = re.search(rf'<tr>((?:(?!</tr>).)*?/approvals/{refund.pk}/.*?)</tr>', inbox.text, re.S).group(1)
    assert '<td data-label="Amount" class="amount">€610.00</td>' in row, row


def test_the_refund_email_shows_the_amount_and_labels_only_the_agents_words(live_tools, smtp):  # noqa: F811
    refund = madrid_refund(live_tools)
    notifications_send()
    asked = [m for m in smtp.messages if "payments.refund" in m["Subject"]]
    subjects = {str(m["Subject"]).strip() for m in asked}
    assert asked and subjects == {"[Unwind] Approval needed: payments.refund, €610.00 (high risk)"}
    for message in asked:
        text, html = body_parts(message)
        assert "Amount:        €610.00 (of step 3, which this undoes)" in text
        assert "Unwind asks for your approval to undo step 3 (payments.charge)" in text
        assert "What the agent wrote (its words" not in text and "Step goal" not in text
        unwinds, agents = text.split("What the agent wrote when it opened the run (its words, not Unwind's):")
        assert "charge_id:" in unwinds and "Arguments:" not in agents
        assert re.findall(r"^(On behalf of|Run goal):", agents, re.M) == ["On behalf of", "Run goal"]
        assert UNWIND_GOAL not in agents
        assert "<strong>€610.00</strong> (of step 3, which this undoes)" in html
        assert "What the agent wrote</strong> (its words" not in html and "Step goal" not in html
    assert refund.status == "pending"


def test_the_refund_slack_post_shows_the_amount_and_labels_only_the_agents_words(live_tools, slack_api):  # noqa: F811
    refund = madrid_refund(live_tools)
    slack.slack_messages_post()
    posts = [json.dumps(call["args"]["blocks"], ensure_ascii=False) for call in slack_api.calls if call["method"] == "chat.postMessage"]
    [post] = [p for p in posts if "payments.refund" in p]
    blocks = json.loads(post)
    if isinstance(blocks, str):
        blocks = json.loads(blocks)
    texts = [b["text"]["text"] for b in blocks if b.get("text")]
    assert texts[0] == f"*Undo with `payments.refund`*, €610.00 (high risk), request {refund.pk}"
    said = "\n".join(texts)
    assert "as the agent sent them" not in said and "The agent's reasoning" not in said
    assert "Step goal (as the agent wrote it)" not in said and UNWIND_GOAL not in said
    assert "*Arguments Unwind will send* (worked out from step 3" in said
    assert "Unwind is undoing step 3 (`payments.charge`, €610.00)" in said
    assert "*Run goal (as the agent wrote it)*\n>Trip to Madrid" in said


def test_a_refund_shows_its_own_amount_when_its_arguments_name_one(tools):
    """The undone step's amount stands in only when the undo's own arguments name none (`amounts`)."""
    from approvals import surfaces
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    spec = dict(in_process_policy()["tools"]["payments.refund"],
                display={"charge_id": {"money": {"currency": "USD", "minor_units": 0}}})
    tool_upsert(tenant=tools.acme, name="payments.refund", spec=spec, actor="test")
    refund = Action(kind="compensation", args={"charge_id": 7},
                    tool=Tool.objects.get(tenant=tools.acme, name="payments.refund", is_current=True))
    assert surfaces.amounts(refund) == ["$7"]
