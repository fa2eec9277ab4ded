"""The pages people live in, without a browser: display hints (policy and formatting), relative times, tense,
where a person lands after logging in, the saga strip's rules and the drift comparison's data.

The browser half (390 px, colours, side by side) is tests/test_pages_browser.py.
"""
from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest
from ledger.audit.chain import tool_fingerprint
from ledger.policy.display import format_money, parse_display
from ledger.errors import ValidationFailed
from ledger.models import Tool
from ledger.policy.versions import tool_upsert
from ledger.templatetags.unwind_pages import relative as words
from recovery import selectors
from recovery.saga import saga_strip
from tests.api_support import assert_problem
from tests.conftest import in_process_policy
from tests.helpers import act, open_run
from tests.test_console_queue import client_for
from tests.test_console_scenarios import (
    compensation_failed_run, drift_run, onboarding_compensated, open_item, step_failed_run,
)

pytest_plugins = ["tests.api_fixtures"]  # the api_db fixture

EUR = {"amount_cents": {"money": {"currency": "EUR", "minor_units": 2}}}


# --- the display policy field ---------------------------------------------------------------------------

@pytest.mark.parametrize(("display", "field", "words"), [
    ([], "tools.t.display", "must be an object"),
    ({"amount cents": {"money": {"currency": "EUR"}}}, "tools.t.display.amount cents", "letters, digits and _"),
    ({"amount": {"percent": {}}}, "tools.t.display.amount", 'must be {"money": {...}}'),
    ({"amount": {"money": {}}}, "tools.t.display.amount.money", "needs a currency"),
    ({"amount": {"money": {"currency": "euro"}}}, "tools.t.display.amount.money.currency", "three-letter ISO 4217"),
    ({"amount": {"money": {"currency_from": "result.currency"}}}, "tools.t.display.amount.money.currency_from",
     "args.<name>"),
    ({"amount": {"money": {"currency": "EUR", "minor_units": 9}}}, "tools.t.display.amount.money.minor_units",
     "from 0 to 4"),
    ({"amount": {"money": {"currency": "EUR", "minor_units": True}}}, "tools.t.display.amount.money.minor_units",
     "whole number"),
    ({"amount": {"money": {"currency": "EUR", "symbol": "€"}}}, "tools.t.display.amount.money.symbol",
     "not a money setting"),
])
def test_a_bad_display_hint_names_its_field(display, field, words):
    with pytest.raises(ValidationFailed) as refused:
        parse_display(display, where="tools.t.display")
    assert refused.value.extra["field"] == field and words in refused.value.detail


def test_display_hints_are_normalised():
    assert parse_display({"a": {"money": {"currency": " eur "}}}, where="d") == {
        "a": {"money": {"currency": "EUR", "minor_units": 2}}}
    both = {"currency_from": "args.cur", "currency": "USD", "minor_units": 0}
    assert parse_display({"a": {"money": both}}, where="d") == {"a": {"money": both}}


@pytest.mark.parametrize(("amount", "money", "args", "shown"), [
    (92000, {"currency": "EUR", "minor_units": 2}, {}, "€920.00"),
    (125050, {"currency": "CHF", "minor_units": 2}, {}, "1,250.50 CHF"),
    (-500, {"currency": "USD", "minor_units": 2}, {}, "−$5.00"),
    (1500, {"currency": "JPY", "minor_units": 0}, {}, "¥1,500"),
    (4900, {"currency_from": "args.currency", "currency": "EUR", "minor_units": 2}, {"currency": "gbp"}, "£49.00"),
    (4900, {"currency_from": "args.currency", "currency": "EUR", "minor_units": 2}, {}, "€49.00"),
    # What does not fit the hint is shown as it is, never guessed at.
    (4900, {"currency_from": "args.currency", "minor_units": 2}, {}, None),
    (4900, {"currency_from": "args.currency", "currency": "EUR", "minor_units": 2}, {"currency": "<b>x</b>"}, None),
    ("4900", {"currency": "EUR", "minor_units": 2}, {}, None),
    (True, {"currency": "EUR", "minor_units": 2}, {}, None),
    (49.5, {"currency": "EUR", "minor_units": 2}, {}, None),
])
def test_money_is_formatted_from_minor_units(amount, money, args, shown):
    assert format_money(amount, money, args) == shown


def test_display_is_part_of_the_tools_immutable_version(tools):
    spec = in_process_policy()["tools"]["payments.charge"]
    first = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    run = open_run(tools)
    charge = act(run, "payments.charge", {"customer": "cus_1", "amount_cents": 92000, "currency": "EUR"})
    request = ApprovalRequest.objects.get(action=charge)
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec={**spec, "display": {"amount_cents": {"money": {"currency": "USD"}}}})
    second = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    assert second.version == first.version + 1 and second.display["amount_cents"]["money"]["currency"] == "USD"
    first.refresh_from_db()
    assert first.display["amount_cents"]["money"]["currency_from"] == "args.currency"
    # A policy change voids the waiting request; its page still shows the values as its own version declared them.
    request.refresh_from_db()
    assert request.status == "voided"
    html = client_for(tools.alice).get(f"/approvals/{request.pk}/").content.decode()
    assert "€920.00" in html and "$920.00" not in html
    # Only the display hint changed: that alone is a new version (same spec again is not).
    again, _ = tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                           spec={**spec, "display": {"amount_cents": {"money": {"currency": "USD"}}}})
    assert again.version == second.version


def test_a_version_without_display_keeps_its_recorded_fingerprint(tools):
    """Chains recorded before `display` existed still verify: an empty hint adds nothing to the fingerprint."""
    tool = Tool.objects.get(tenant=tools.acme, name="hr.create_user", is_current=True)
    assert tool.display == {}
    with_hint = Tool.objects.get(tenant=tools.acme, name="payments.charge", is_current=True)
    before = tool_fingerprint(with_hint)
    with_hint.display = {}
    assert tool_fingerprint(with_hint) != before  # a set hint is covered by the fingerprint


def test_the_api_round_trips_display_and_refuses_a_bad_one(api_db):
    spec = {"description": "Charge.", "executor": "client", "saga_role": "pivot",
            "display": {"amount_cents": {"money": {"currency": "EUR"}}}}
    created = api_db.person("ada").put("/api/v1/tools/pay.it", spec, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["policy"]["display"] == {"amount_cents": {"money": {"currency": "EUR", "minor_units": 2}}}
    refused = api_db.person("ada").put("/api/v1/tools/pay.it", {**spec, "display": {"amount_cents": {"money": {
        "currency": "€"}}}}, format="json")
    problem = assert_problem(refused, 400, "validation_error")
    assert problem["field"] == "tools.pay.it.display.amount_cents.money.currency"
    assert Tool.objects.filter(name="pay.it").count() == 1


def test_an_agent_key_cannot_change_how_values_are_shown(api_db):
    """An agent that could relabel amounts could make an approver read €9.20 for €920.00: it writes no policy."""
    spec = dict(in_process_policy()["tools"]["payments.charge"],
                display={"amount_cents": {"money": {"currency": "EUR", "minor_units": 4}}})
    before = list(Tool.objects.filter(name="payments.charge").values_list("pk", "version", "display"))
    refused = api_db.agent.put("/api/v1/tools/payments.charge", spec, format="json")
    assert_problem(refused, 403, "agents_cannot_govern")
    assert list(Tool.objects.filter(name="payments.charge").values_list("pk", "version", "display")) == before


# --- times and tense ------------------------------------------------------------------------------------

def test_relative_times_never_say_zero_minutes():
    now = timezone.now()

    def relative(when, now):  # Django keeps "1 minute" on one line with a no-break space
        return words(when, now).replace("\xa0", " ")

    assert relative(now - timedelta(seconds=3), now) == "just now"
    assert relative(now - timedelta(seconds=59), now) == "just now"
    assert relative(now - timedelta(seconds=61), now) == "1 minute ago"
    assert relative(now - timedelta(days=2, hours=5), now) == "2 days ago"
    assert relative(now + timedelta(minutes=59, seconds=30), now) == "in 59 minutes"


def test_the_heading_follows_the_steps_state(tools, django_capture_on_commit_callbacks):
    from approvals.services import approval_decide

    run = open_run(tools)
    charge = act(run, "payments.charge", {"customer": "cus_2", "amount_cents": 100, "currency": "EUR"})
    request = ApprovalRequest.objects.get(action=charge)
    alice = client_for(tools.alice)
    assert 'id="what-heading">What will happen<' in alice.get(f"/approvals/{request.pk}/").content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=request, user=tools.alice, approve=True, reason="")
    charge.refresh_from_db()
    assert charge.status == "succeeded"
    assert 'id="what-heading">What happened<' in alice.get(f"/approvals/{request.pk}/").content.decode()


# --- where people land ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("persona", "lands_on"), [
    ("alice", "/approvals/"), ("ben", "/approvals/"), ("oscar", "/console/recovery/"),
    ("ada", "/console/recovery/"), ("victor", "/console/recovery/"), ("mallory", "/console/recovery/"),
])
def test_home_sends_approvers_to_their_inbox(tools, persona, lands_on):
    response = client_for(getattr(tools, persona)).get("/")
    assert response.status_code == 302 and response["Location"] == lands_on


def test_login_without_next_lands_by_role(client, tools):
    response = client.post("/accounts/login/", {"username": "alice", "password": "pw-alice"}, follow=True)
    assert response.redirect_chain[-1][0] == "/approvals/"


def test_home_asks_strangers_to_log_in(client, tools):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


# --- the saga strip and the drift comparison -------------------------------------------------------------

def strip_of(run):
    return selectors.run_timeline(run)["strip"]


def test_strip_groups_by_role_and_draws_no_compensation_after_the_pivot(tools):
    run = step_failed_run(tools)
    strip = strip_of(run)
    groups = [(g.role, [s.forward.action.seq for s in g.steps]) for g in strip.groups]
    assert groups == [("pivot", [1]), ("retriable", [2])]
    charge, email = strip.steps
    assert charge.undoable and charge.ready and charge.compensation is None  # could be undone, was not
    assert not email.undoable and not email.ready and email.compensation is None  # retriable after the pivot
    assert email.marker == "stopped here" and not charge.marker
    assert (email.forward.icon, email.forward.words) == ("✕", "failed")


def test_strip_pairs_each_compensation_with_its_step(tools):
    run = onboarding_compensated(tools)
    strip = strip_of(run)
    create, provision, email = strip.steps
    assert create.compensation.action.compensates_id == create.forward.action.pk
    assert provision.compensation.action.compensates_id == provision.forward.action.pk
    assert create.compensation.action.seq > provision.compensation.action.seq  # undone newest first
    # No pivot in this run, so the retriable email could be corrected, but it failed: nothing to undo.
    assert email.compensation is None and not email.ready and email.marker == "stopped here"
    assert strip.compensations == 2


def test_strip_shows_a_retriable_steps_compensation_when_the_run_had_no_pivot(tools):
    from tests.test_console_scenarios import email_correction_run

    strip = strip_of(email_correction_run(tools))
    sent, refused = strip.steps
    assert sent.forward.action.saga_role == "retriable" and sent.undoable
    assert sent.compensation is not None and sent.compensation.status == "succeeded"  # the correction email
    assert refused.compensation is None and not refused.ready


def test_what_failed_is_the_compensation_when_undoing_failed(tools):
    run = compensation_failed_run(tools)
    item = open_item(run)
    failure = selectors.item_failure(item)
    assert failure["is_compensation"] and failure["action"].kind == "compensation"
    assert failure["action"].compensates_id == item.action_id
    assert {a.action_id for a in failure["attempts"]} == {failure["action"].pk}
    html = client_for(tools.oscar).get(f"/console/recovery/{item.pk}/").content.decode()
    assert f'id="failing-attempts" data-action="{failure["action"].pk}"' in html
    assert "the compensation of step 1" in html
    assert selectors.drift_comparison(failure) is None  # refused, not drifted: no comparison


def test_drift_comparison_reads_before_after_and_now(tools):
    run = drift_run(tools)
    item = open_item(run)
    drift = selectors.drift_comparison(selectors.item_failure(item))
    rows = {row["field"]: row for row in drift["rows"]}
    priority = rows["priority"]
    assert (priority["before"], priority["after"], priority["now"]) == ("normal", "high", "urgent")
    assert rows["priority"]["drifted"] and rows["priority"]["agent_changed"]
    assert not rows["status"]["drifted"] and not rows["status"]["agent_changed"]
    assert drift["drifted_fields"] == ["priority"]
    html = client_for(tools.victor).get(f"/console/recovery/{item.pk}/").content.decode()
    assert 'class="panel drift"' in html and 'data-field="priority"' in html
    # A viewer reads the comparison but is offered no action.
    assert 'data-op="compensate"' not in html and "needs the operator role" in html


def test_run_page_queries_do_not_grow_with_the_strip(tools):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    oscar = client_for(tools.oscar)
    counts = []
    for run in (step_failed_run(tools), onboarding_compensated(tools)):  # 2 steps, then 3 steps and 2 undos
        oscar.get(f"/console/runs/{run.pk}/")
        with CaptureQueriesContext(connection) as queries:
            assert oscar.get(f"/console/runs/{run.pk}/").status_code == 200
        counts.append(len(queries))
    assert counts[0] == counts[1], counts


def test_saga_strip_without_undone_by_lists_finds_compensations(tools):
    run = onboarding_compensated(tools)
    actions = list(run.actions.select_related("tool").order_by("seq"))
    strip = saga_strip(run, actions)
    assert [s.compensation is not None for s in strip.steps] == [True, True, False]


def test_agent_text_in_values_is_shown_as_text_never_markup(tools):
    """Arguments are the agent's words: the page shows them as text (escaped), also inside the money tooltip."""
    spec = dict(in_process_policy()["tools"]["crm.update_ticket"], approval="manual")
    tool_upsert(tenant=tools.acme, name="crm.update_ticket", spec=spec, actor="test")
    from tests.test_console_scenarios import new_ticket

    run = open_run(tools)
    action = act(run, "crm.update_ticket", {"ticket_id": new_ticket(), "priority": "high",
                                            "note": '<img src=x onerror="alert(1)">'})
    request = ApprovalRequest.objects.get(action=action)
    html = client_for(tools.alice).get(f"/approvals/{request.pk}/").content.decode()
    assert '<img src=x' not in html
    assert '&lt;img src=x onerror=&quot;alert(1)&quot;&gt;' in html
