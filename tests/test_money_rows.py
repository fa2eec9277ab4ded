"""Amounts read as money wherever a list shows a request: an approver knows what a row is without opening it."""
from django.test import Client

from ledger.policy.display import money_in, person_at, shown_args
from tests.helpers import act, open_run

DISPLAY = {"amount_cents": {"money": {"currency_from": "args.currency", "currency": "EUR", "minor_units": 2}}}


def test_one_formatter_for_amounts_and_people():
    args = {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"}
    assert money_in(args, DISPLAY) == ["€920.00"]
    assert money_in({**args, "currency": "CHF", "amount_cents": 125050}, DISPLAY) == ["1,250.50 CHF"]
    assert shown_args(args, DISPLAY) == {**args, "amount_cents": "€920.00"}
    assert money_in({"amount_cents": "92000"}, DISPLAY) == []  # not a whole number: shown as it is elsewhere
    assert person_at("approver", "Demo Company") == "a reviewer at Demo Company"
    assert person_at(None, "Demo Company") == "someone at Demo Company"


def test_the_inbox_row_shows_the_amount(tools):
    run = open_run(tools, goal="Buy the annual plan")
    act(run, "payments.charge", {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"})
    client = Client()
    client.force_login(tools.alice)
    row = client.get("/approvals/").content.decode()
    assert '<td data-label="Amount" class="amount">€920.00</td>' in row
    assert "92000" not in row


def test_a_tool_name_wraps_only_after_its_dots_and_underscores():
    from ledger.templatetags.unwind_pages import breakable

    assert breakable("travel.cancel_flight") == "travel.<wbr>cancel_<wbr>flight"
    assert breakable("<b>x.y</b>") == "&lt;b&gt;x.<wbr>y&lt;/b&gt;"  # escaped first: the name is text
