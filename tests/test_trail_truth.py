"""The trail's truth table: for every way a step can end, the exact sentence the customer reads.

Each case builds a run through the real services and pins its headline and statements, then holds the trail (and
the email that sends it) to what every customer surface owes its reader: a step that had no effect is never told
in the words of a done one, no amount in minor units, no internal id, no staff login, no tool name, and a headline
that agrees with the steps.
"""
import datetime
import re

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest, Notification
from approvals.services import approval_decide, approvals_expire
from ledger.policy import describe
from ledger.errors import OrderingViolation
from ledger.executors.call import ToolError
from ledger.models import Action, ActionKind, Tool
from ledger.engine import execution, outcomes
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_cancel, run_complete
from recovery.services import recovery_close
from recovery.trail import HAD_EFFECT, correction_trail, trail_send
from tests.helpers import act, open_run
from tests.test_console_scenarios import (
    auto_approve_charges, compensation_failed_run, drift_run, email_correction_run, onboarding_compensated, open_item,
)

WHEN = r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC"
CHARGE = {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"}


def charge_waiting(world, *, before_it=True):
    """Run 8 of the demo: (a user created, then) a €920.00 charge that waits for a reviewer."""
    run = open_run(world, goal="Buy the annual plan")
    if before_it:
        act(run, "hr.create_user", {"email": "carol@company.com", "name": "Carol Diaz"})
    charge = act(run, "payments.charge", CHARGE)
    assert charge.status == "awaiting_approval"
    return run, charge


def succeeded(world):
    auto_approve_charges(world)
    run = open_run(world, goal="Buy the annual plan")
    act(run, "payments.charge", CHARGE)
    return run_complete(run=run, actor="agent:booker")


def declined(world, captured):
    run, charge = charge_waiting(world)
    with captured(execute=True):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=world.alice, approve=False,
                        reason="the customer asked us to wait")
    execution.unwind(run.pk)
    run.refresh_from_db()
    return run


def declined_first(world, captured):
    run, charge = charge_waiting(world, before_it=False)
    with captured(execute=True):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=world.alice, approve=False,
                        reason="the customer asked us to wait")
    run.refresh_from_db()
    return run


def expired(world, captured):
    run, charge = charge_waiting(world, before_it=False)
    ApprovalRequest.objects.filter(action=charge).update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    with captured(execute=True):
        assert approvals_expire() == 1
    run.refresh_from_db()
    return run


def refused_by_the_ordering_law(world):
    """A compensatable step after the pivot is refused at proposal: nothing is recorded, nothing happened."""
    auto_approve_charges(world)
    run = open_run(world, goal="Buy the annual plan")
    act(run, "payments.charge", CHARGE)
    with pytest.raises(OrderingViolation):
        act(run, "hr.create_user", {"email": "carol@company.com", "name": "Carol Diaz"})
    return run_complete(run=run, actor="agent:booker")


def outcome_unknown(world):
    run = open_run(world, goal="Onboard Carol")
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "carol@company.com", "name": "C"},
                              actor="agent:booker")
    outcomes.record_unknown(proposal.action, ToolError("no answer", transient=True), why="it cannot be read back",
                             latency_ms=None, actor="system:engine")
    run.refresh_from_db()
    return run


def cancelled_before_it_ran(world, captured):
    run, _ = charge_waiting(world, before_it=False)
    with captured(execute=True):
        run_cancel(run=run, actor="agent:booker", reason="changed my mind")
    run.refresh_from_db()
    return run


def closed_by_an_operator(world):
    run = drift_run(world)
    recovery_close(item=open_item(run), user=world.oscar, reason="the customer asked for urgent")
    run.refresh_from_db()
    return run


UNDONE_USER = "We removed the HR account we had created for Carol Diaz."
DECLINED = (rf"A reviewer at Acme declined this step {WHEN} \(the customer asked us to wait\), so it was not taken: "
            r"charge a customer's card \(€920\.00\)\.")
NO_REVIEW = "No person needed to review this: it was handled automatically, by the rules set for it."

# case -> (status, headline, [(kind, exact text or regex)])
TABLE = {
    "succeeded": (succeeded, "completed", "The agent finished the task; nothing needed to be corrected.", [
        ("changed", "We took a card payment of €920.00."),
        ("reviewed", NO_REVIEW)]),
    "compensated": (onboarding_compensated, "compensated", "Everything the agent changed has been undone.", [
        ("changed", "We created an HR account for Ashu Kumar (ashu@company.com)."),
        ("changed", "We provisioned a paid workspace license."),
        ("not_done", "We could not send the email “Welcome” to ashu@home.example."),
        ("corrected", "Why it was corrected: a later step could not be completed, so we began undoing the changes "
                      "made before it."),
        ("restored", "We revoked the workspace license we had provisioned."),
        ("restored", "We removed the HR account we had created for Ashu Kumar."),
        ("reviewed", NO_REVIEW)]),
    "compensation failed": (compensation_failed_run, "needs_attention",
                            "Some of the agent's changes could not be undone automatically; a person is deciding "
                            "what to do.", [
        ("changed", "We created an HR account for Temp Worker (temp@company.com)."),
        ("corrected", "Why it was corrected: the agent stopped before it finished."),
        ("not_undone", "This could not be undone: we created an HR account for Temp Worker (temp@company.com). The "
                       "reason: undoing it did not succeed, and a person has been told."),
        ("reviewed", "No person has reviewed this yet."),
        ("pending", "What is left has been put in front of a person, who will decide how to finish it.")]),
    "declined": (declined, "compensated", "Everything the agent changed has been undone.", [
        ("changed", "We created an HR account for Carol Diaz (carol@company.com)."),
        ("not_done", DECLINED),
        ("corrected", "Why it was corrected: a reviewer at Acme declined a later step, so we began undoing the changes made "
                      "before it."),
        ("restored", UNDONE_USER)]),
    "declined as the first step": (declined_first, "compensated",
                                   "The agent's task was stopped before it changed anything.", [
        ("not_done", DECLINED)]),
    "expired": (expired, "compensated", "The agent's task was stopped before it changed anything.", [
        ("not_done", "Nobody approved this step in time, so it was not taken: charge a customer's card (€920.00)."),
        ("reviewed", NO_REVIEW)]),
    "refused by the ordering law": (refused_by_the_ordering_law, "completed",
                                    "The agent finished the task; nothing needed to be corrected.", [
        ("changed", "We took a card payment of €920.00."),
        ("reviewed", NO_REVIEW)]),
    "failed before any effect": (email_correction_run, "compensated",
                                 "The agent's changes were undone, except 1 that could not be taken back and was "
                                 "corrected instead.", [
        ("changed", "We sent an email to customer@example.com with the subject “Your refund”."),
        ("not_done", "We could not send the email “Refund issued” to finance@example.com."),
        ("corrected", "Why it was corrected: a later step could not be completed, so we began undoing the changes "
                      "made before it."),
        ("not_undone", "This cannot be taken back: we sent an email to customer@example.com with the subject “Your "
                       "refund”."),
        ("corrected", "Instead, a correction was made: we sent an email to customer@example.com with the subject "
                      "“Correction: Your refund”."),
        ("reviewed", NO_REVIEW)]),
    "outcome unknown": (outcome_unknown, "needs_attention",
                        "We do not know yet whether one of the agent's steps was taken; a person is checking.", [
        ("pending", "We do not know yet whether this step was taken, and a person has been asked to check: create a "
                    "user in the HR directory (email: carol@company.com, name: C)."),
        ("reviewed", "No person has reviewed this yet."),
        ("pending", "What is left has been put in front of a person, who will decide how to finish it.")]),
    "drift": (drift_run, "needs_attention",
              "Some of the agent's changes could not be undone automatically; a person is deciding what to do.", [
        ("changed", r"We set the priority of ticket T-\d+ to high\."),
        ("corrected", "Why it was corrected: the agent stopped before it finished."),
        ("not_undone", r"This could not be undone: we set the priority of ticket T-\d+ to high\. The reason: someone "
                       r"else changed it after the agent did \(priority is now urgent\), and their change was kept "
                       r"rather than overwritten\."),
        ("reviewed", "No person has reviewed this yet."),
        ("pending", "What is left has been put in front of a person, who will decide how to finish it.")]),
    "cancelled before it ran": (cancelled_before_it_ran, "compensated",
                                "The agent's task was stopped before it changed anything.", [
        ("not_done", "This step was called off before it was taken: charge a customer's card (€920.00)."),
        ("reviewed", NO_REVIEW)]),
    "closed by an operator": (closed_by_an_operator, "closed",
                              "A person at Acme reviewed this and closed it; the statements below say what stands.", [
        ("changed", r"We set the priority of ticket T-\d+ to high\."),
        ("corrected", "Why it was corrected: the agent stopped before it finished."),
        ("not_undone", r"This could not be undone: .*"),
        ("reviewed", rf"An operator at Acme reviewed it and closed it as handled {WHEN} \(the customer asked for "
                     r"urgent\)\.")]),
}
# The reviewer of a declined step is named in its own statement, and also in "Who decided".
REVIEWED_BY = {"declined": ["a reviewer at Acme"], "declined as the first step": ["a reviewer at Acme"],
               "closed by an operator": ["an operator at Acme"]}

NEEDS_COMMITS = {declined, declined_first, expired, cancelled_before_it_ran}
MINOR_UNITS = re.compile(r"\b\d+ ?cents\b|\b92000\b|\b4900\b", re.I)
INTERNAL_ID = re.compile(r"\b[a-z]+_[A-Za-z0-9]+\b")


def build(name, world, captured):
    builder = TABLE[name][0]
    return builder(world, captured) if builder in NEEDS_COMMITS else builder(world)


def matches(expected: str, text: str) -> bool:
    return text == expected or re.fullmatch(expected, text) is not None


def assert_true_for_a_customer(text: str, run, world) -> None:
    assert not MINOR_UNITS.search(text), f"an amount in minor units: {text!r}"
    assert not INTERNAL_ID.search(text), f"an internal id: {INTERNAL_ID.search(text).group(0)!r} in {text!r}"
    for login in world.users:
        assert not re.search(rf"\b{login}\b", text), f"a staff login {login!r} in {text!r}"
    for tool in Tool.objects.filter(tenant_id=run.tenant_id).values_list("name", flat=True).distinct():
        assert tool not in text, f"a tool id {tool!r}"
    for action in Action.objects.filter(run=run, kind=ActionKind.FORWARD).select_related("tool"):
        if action.status in HAD_EFFECT:
            continue
        done = (action.tool.describe or {}).get("done")
        if not done:
            continue
        from ledger.policy.display import shown_args

        for args in (action.args, shown_args(action.args, action.tool.display or {})):
            sentence = describe.render(done, args=args, result=action.result, target=action.target_id or "")
            assert sentence is None or sentence.lower() not in text.lower(), \
                f"step {action.seq} ({action.status}) is told as done: {sentence!r}"


def headline_agrees(trail) -> None:
    kinds = [s["kind"] for s in trail["statements"]]
    headline = trail["headline"]
    if "changed" not in kinds:
        assert "undone" not in headline and "changes were" not in headline, headline
    if "not_undone" in kinds and trail["status"] == "compensated":
        assert "except" in headline
    if headline == "Everything the agent changed has been undone.":
        assert kinds.count("restored") == kinds.count("changed") and "not_undone" not in kinds


@pytest.mark.parametrize("name", list(TABLE))
def test_what_the_customer_reads(name, tools, django_capture_on_commit_callbacks):
    run = build(name, tools, django_capture_on_commit_callbacks)
    _, status, headline, expected = TABLE[name]
    trail = correction_trail(run)
    assert trail["status"] == status
    assert trail["headline"] == headline
    got = [(s["kind"], s["text"]) for s in trail["statements"]]
    assert len(got) == len(expected), "\n".join(f"{k}: {t}" for k, t in got)
    for (kind, text), (want_kind, want) in zip(got, expected):
        assert kind == want_kind and matches(want, text), f"{kind}: {text!r}\n  wanted {want_kind}: {want!r}"
    assert trail["reviewed_by"] == REVIEWED_BY.get(name, [])
    headline_agrees(trail)
    assert_true_for_a_customer(" ".join([trail["headline"], *(t for _, t in got), *trail["reviewed_by"]]), run, tools)


@pytest.mark.parametrize("name", ["declined", "expired", "cancelled before it ran", "failed before any effect",
                                  "succeeded"])
def test_the_email_of_the_trail_says_the_same(name, tools, django_capture_on_commit_callbacks):
    run = build(name, tools, django_capture_on_commit_callbacks)
    trail = correction_trail(run)
    trail_send(run=run, user=tools.oscar)
    sent = Notification.objects.get(kind="correction_trail", tenant=run.tenant)
    body = " ".join(sent.body_text.split())
    for statement in trail["statements"]:
        assert " ".join(statement["text"].split()) in body
    assert trail["headline"] in body
    visible = re.sub(r"https?://\S+", "", body)  # the link itself carries a random token, not an id
    assert_true_for_a_customer(visible, run, tools)
    assert_true_for_a_customer(sent.subject, run, tools)


def test_the_guard_catches_a_declined_step_told_as_done(tools, django_capture_on_commit_callbacks):
    """The check above is not empty: the demo's old sentence for a declined charge fails it on each count."""
    run = declined_first(tools, django_capture_on_commit_callbacks)
    old = ("approver reviewed and declined this step on 2026-11-25 12:00 UTC (the customer asked us to wait): we "
           "charged 92000 cents to the card of cus_carol.")
    with pytest.raises(AssertionError, match="minor units"):
        assert_true_for_a_customer(old, run, tools)
    with pytest.raises(AssertionError, match="internal id"):
        assert_true_for_a_customer(old.replace("92000 cents", "€920.00"), run, tools)
    with pytest.raises(AssertionError, match="told as done"):
        assert_true_for_a_customer("We took a card payment of €920.00.", run, tools)
    with pytest.raises(AssertionError, match="staff login"):
        assert_true_for_a_customer("alice declined this step.", run, tools)
