"""The approver pages: inbox and detail, driven like a browser would, with CSRF enforced.

Personas (tests/conftest.py): alice and ben approve in acme, victor only views, oscar operates;
mallory is an admin of globex and stands for everyone outside acme.
"""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest
from approvals.services import approvals_expire
from ledger.models import Action
from ledger.engine.runs import run_cancel, run_compensate, run_open
from ledger.policy.versions import tool_upsert
from sandbox.selectors import world_state
from tests.conftest import in_process_policy
from tests.helpers import acme, act, open_run

CHARGE = {"customer": "cus_ana", "amount_cents": 48200, "currency": "EUR"}
INTENT = {"goal": "Pay for the Lisbon trip",
          "reasoning": "Flight and hotel are held; the card charge completes the booking.",
          "confidence": 0.82, "model": "gpt-test"}


# --- helpers ------------------------------------------------------------------------------------------

def login(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def csrf_token(client: Client) -> str:
    """What a browser has after loading any page: the csrftoken cookie."""
    assert client.get(reverse("approvals:inbox")).status_code == 200
    return client.cookies["csrftoken"].value


def decide(client: Client, approval: ApprovalRequest, *, htmx: bool = True, **data):
    """Post a decision as the page does: htmx with the X-CSRFToken header, or a plain form post."""
    token = csrf_token(client)
    url = reverse("approvals:decide", args=[approval.pk])
    if htmx:
        return client.post(url, data, headers={"X-CSRFToken": token, "HX-Request": "true"})
    return client.post(url, {**data, "csrfmiddlewaretoken": token})


def detail(client: Client, approval: ApprovalRequest):
    return client.get(reverse("approvals:detail", args=[approval.pk]))


def text(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def trip(world, *, on_behalf_of="carol@example.com"):
    """A booking run: flight and hotel held, then the card charge waits for approval."""
    run = run_open(tenant=world.acme, agent=world.agent, goal="Book Carol's Lisbon trip", on_behalf_of=on_behalf_of,
                   actor="agent:booker")
    act(run, "travel.book_flight", {"passenger": "Carol", "flight": "TP1351", "date": "2026-12-01"})
    act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Bairro Alto", "nights": 3})
    charge = act(run, "payments.charge", CHARGE, intent=INTENT)
    assert charge.status == "awaiting_approval"
    return run, charge, ApprovalRequest.objects.get(action=charge)


def has_buttons(response) -> bool:
    return 'name="decision" value="approve"' in response.content.decode()


# --- the inbox ------------------------------------------------------------------------------------------

def test_inbox_needs_login(tools):
    response = Client().get(reverse("approvals:inbox"))
    assert response.status_code == 302 and response["Location"] == "/accounts/login/?next=/approvals/"


def test_inbox_lists_pending_requests_of_my_tenants_only(tools):
    _, charge, approval = trip(tools)
    response = login(tools.alice).get(reverse("approvals:inbox"))
    body = text(response)
    assert response.status_code == 200
    assert f'href="/approvals/{approval.pk}/"' in body
    assert "payments.charge" in body and 'class="badge high"' in body and "booker" in body
    assert 'hx-trigger="every 5s"' in body  # new requests appear without a reload
    outsider = text(login(tools.mallory).get(reverse("approvals:inbox")))
    assert f"/approvals/{approval.pk}/" not in outsider and "Nothing waits for a decision" in outsider


def test_inbox_filters_by_risk_tool_tenant_and_status(tools):
    _, _, approval = trip(tools)
    client = login(tools.alice)
    link = f'href="/approvals/{approval.pk}/"'
    assert link in text(client.get("/approvals/?risk=high&tool=payments.charge&tenant=acme"))
    assert link not in text(client.get("/approvals/?risk=low"))
    assert link not in text(client.get("/approvals/?tool=hr.create_user"))
    assert link not in text(client.get("/approvals/?status=approved"))
    assert link in text(client.get("/approvals/?status=all"))
    # a tenant that is not hers is not a choice: the filter is refused, nothing of globex leaks in
    response = client.get("/approvals/?tenant=globex")
    assert response.status_code == 200 and "Some filters did not apply" in text(response)


def test_inbox_htmx_partial_returns_only_the_fragment(tools):
    _, _, approval = trip(tools)
    response = login(tools.alice).get("/approvals/?risk=high", headers={"HX-Request": "true"})
    body = text(response)
    assert response.status_code == 200
    assert body.lstrip().startswith("<table") and f"/approvals/{approval.pk}/" in body
    assert "<html" not in body and "<nav" not in body and "hx-trigger" not in body


@pytest.mark.parametrize("count", [5, 30])
def test_inbox_costs_the_same_queries_whatever_the_number_of_requests(tools, count, django_assert_num_queries,
                                                                     settings):
    settings.UNWIND_MAX_OPEN_APPROVALS_PER_AGENT = count  # one agent asks for every request here
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec=in_process_policy()["tools"]["payments.charge"])
    for number in range(count):
        run = open_run(tools, goal=f"order {number}")
        act(run, "payments.charge", {"customer": f"cus_{number}", "amount_cents": 100 + number})
    client = login(tools.alice)
    # session, user, memberships, tool names, count, the page's rows (with tenant, run, agent, action, tool), and
    # the navigation's memberships (it offers only the pages the person may open)
    with django_assert_num_queries(7):
        response = client.get("/approvals/")
    assert response.status_code == 200
    assert text(response).count('class="badge high"') == min(count, 20)
    with django_assert_num_queries(6):
        client.get("/approvals/?page=2", headers={"HX-Request": "true"})


# --- the detail page ------------------------------------------------------------------------------------

def test_detail_shows_the_exact_preview(tools):
    _, charge, approval = trip(tools)
    response = detail(login(tools.alice), approval)
    body = text(response)
    assert response.status_code == 200
    assert "<code>payments.charge</code>" in body and "Charge a customer&#x27;s card" in body
    # Values read as facts: money by the tool's display hint (the raw value in the tooltip), strings as text.
    shown = (("amount_cents", '<span class="value hinted" title="48200">€482.00</span>'),
             ("currency", '<span class="value">EUR</span>'), ("customer", '<span class="value">cus_ana</span>'))
    for name, value in shown:
        assert f'<dt><code>{name}</code></dt><dd data-arg="{name}">{value}</dd>' in body, name
    assert 'id="what-heading">What will happen</h2>' in body
    assert "a new charge: its id (charge_id) is known once the call returns" in body
    assert ("If this is undone later, Unwind will call payments.refund with charge_id = the charge_id this call "
            "returns. That call is high risk and will itself wait for 1 approval(s).") in body
    assert "Flight and hotel are held" in body and "82%" in body and "gpt-test" in body
    assert "Book Carol&#x27;s Lisbon trip" in body and "carol@example.com" in body
    # the run so far: both holds succeeded, the charge is the step that waits
    assert re.search(r"travel.book_flight</code>.*?Succeeded|travel.book_flight</code>.*?succeeded", body)
    assert "← this request" in body and "awaiting approval" in body
    assert has_buttons(response) and "Reason for rejecting" in body


def test_detail_diffs_the_before_state_against_the_proposed_change(tools):
    spec = in_process_policy()["tools"]["crm.update_ticket"]
    tool_upsert(tenant=tools.acme, name="crm.update_ticket", spec={**spec, "approval": "manual"}, actor="test")
    run = open_run(tools, goal="Escalate the login bug")
    action = act(run, "crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    assert action.status == "awaiting_approval"
    body = text(detail(login(tools.alice), ApprovalRequest.objects.get(action=action)))
    assert "ticket T-182" in body
    assert ('<code>priority</code></th> <td class="diff-old"><span class="value">normal</span></td> '
            '<td class="diff-new"><span class="value">high</span>') in body
    assert ('<code>status</code></th> <td><span class="value">open</span></td> '
            '<td><span class="muted">not part of this call</span>') in body
    assert ("Unwind will restore the state from before it by calling crm.update_ticket with note = &quot;Restored by "
            "Unwind: the earlier change was undone.&quot;, priority = &quot;normal&quot;, status = &quot;open&quot;, "
            "ticket_id = &quot;T-182&quot;") in body


def test_approver_approves_and_the_run_proceeds(tools, django_capture_on_commit_callbacks):
    run, charge, approval = trip(tools)
    client = login(tools.alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = decide(client, approval, decision="approve")
    body = text(response)
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="decision"') and "<html" not in body  # the panel, swapped in place
    assert "Approved. Unwind runs the action now" in body and not has_buttons(response)
    assert 'id="run-steps" hx-swap-oob="true"' in body
    charge.refresh_from_db()
    run.refresh_from_db()
    assert charge.status == "succeeded" and run.status == "running"
    charges = world_state(tenant=acme())["charges"]
    assert [(c["customer"], c["amount_cents"], c["status"]) for c in charges] == [("cus_ana", 48200, "captured")]
    approval.refresh_from_db()
    assert approval.status == "approved"
    assert list(approval.decisions.values_list("user__username", "decision")) == [("alice", "approve")]
    page = detail(client, approval)
    assert "Approved" in text(page) and not has_buttons(page)


def test_approve_works_without_javascript(tools, django_capture_on_commit_callbacks):
    _, charge, approval = trip(tools)
    client = login(tools.ben)
    with django_capture_on_commit_callbacks(execute=True):
        response = decide(client, approval, htmx=False, decision="approve")
    assert response.status_code == 302 and response["Location"] == f"/approvals/{approval.pk}/"
    page = text(client.get(response["Location"]))
    assert "Approved. Unwind runs the action now" in page  # the flash message on the page
    charge.refresh_from_db()
    assert charge.status == "succeeded"


def test_a_post_without_the_csrf_token_is_refused(tools):
    _, _, approval = trip(tools)
    client = login(tools.alice)
    response = client.post(reverse("approvals:decide", args=[approval.pk]), {"decision": "approve"},
                           headers={"HX-Request": "true"})
    assert response.status_code == 403
    assert not ApprovalDecision.objects.exists()


def test_rejection_without_a_reason_is_refused(tools):
    run, charge, approval = trip(tools)
    client = login(tools.alice)
    response = decide(client, approval, decision="reject", reason="   ")
    assert response.status_code == 400
    assert "Say why you reject it" in text(response) and has_buttons(response)
    plain = decide(client, approval, htmx=False, decision="reject", reason="")
    assert plain.status_code == 400 and "Say why you reject it" in text(plain) and "<html" in text(plain)
    approval.refresh_from_db()
    charge.refresh_from_db()
    assert approval.status == "pending" and charge.status == "awaiting_approval"
    assert not ApprovalDecision.objects.exists()


def test_rejection_with_a_reason_unwinds_the_run(tools, django_capture_on_commit_callbacks):
    run, charge, approval = trip(tools)
    reason = "Carol asked to wait for the cheaper fare on Friday."
    with django_capture_on_commit_callbacks(execute=True):
        response = decide(login(tools.alice), approval, decision="reject", reason=reason)
    body = text(response)
    assert response.status_code == 200
    assert "Rejected. The agent is told your reason" in body and f"“{reason}”" in body
    run.refresh_from_db()
    charge.refresh_from_db()
    assert run.status == "compensated"
    assert charge.status == "rejected" and charge.decision_reason == reason  # the reason goes back to the agent
    world = world_state(tenant=acme())
    assert [f["status"] for f in world["flights"]] == ["cancelled"]
    assert [h["status"] for h in world["hotels"]] == ["cancelled"]
    assert world["charges"] == []


def test_viewer_sees_the_page_but_cannot_decide(tools):
    _, charge, approval = trip(tools)
    client = login(tools.victor)
    page = detail(client, approval)
    assert page.status_code == 200 and not has_buttons(page)
    assert "deciding needs the approver role in Acme; you are a viewer" in text(page)
    response = decide(client, approval, decision="approve")
    assert response.status_code == 403
    assert "This needs the approver role in the tenant; you are viewer" in text(response)
    plain = decide(client, approval, htmx=False, decision="reject", reason="no")
    assert plain.status_code == 403 and "you are viewer" in text(plain)
    approval.refresh_from_db()
    assert approval.status == "pending" and not ApprovalDecision.objects.exists()


def test_someone_of_another_tenant_gets_404(tools):
    _, _, approval = trip(tools)
    client = login(tools.mallory)
    assert detail(client, approval).status_code == 404
    assert decide(client, approval, decision="approve").status_code == 404
    assert decide(client, approval, htmx=False, decision="reject", reason="mine now").status_code == 404
    approval.refresh_from_db()
    assert approval.status == "pending" and not ApprovalDecision.objects.exists()


def test_the_requester_cannot_approve_their_own_request(tools):
    _, charge, approval = trip(tools, on_behalf_of=tools.alice.email)
    client = login(tools.alice)
    page = detail(client, approval)
    assert not has_buttons(page) and "someone else must decide (separation of duties)" in text(page)
    response = decide(client, approval, decision="approve")
    assert response.status_code == 403
    assert "You asked for this action (or it acts on your behalf); someone else must decide" in text(response)
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert has_buttons(detail(login(tools.ben), approval))  # another approver can


def test_an_expired_request_says_so_instead_of_offering_buttons(tools, django_capture_on_commit_callbacks):
    run, charge, approval = trip(tools)
    with django_capture_on_commit_callbacks(execute=True):
        assert approvals_expire(now=timezone.now() + timedelta(seconds=tools.acme.approval_ttl_seconds + 1)) == 1
    client = login(tools.alice)
    page = detail(client, approval)
    assert "Expired" in text(page) and "counts as a rejection" in text(page) and not has_buttons(page)
    response = decide(client, approval, decision="approve")
    assert response.status_code == 409 and "This request is already expired; nothing to decide" in text(response)
    run.refresh_from_db()
    charge.refresh_from_db()
    assert charge.status == "expired" and run.status == "compensated"
    assert "expired" in text(client.get("/approvals/?status=expired"))


def test_an_overdue_request_counts_as_expired_before_the_sweeper_gets_to_it(tools, monkeypatch):
    _, charge, approval = trip(tools)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(seconds=tools.acme.approval_ttl_seconds + 60))
    client = login(tools.alice)
    page = detail(client, approval)
    assert "Expired" in text(page) and not has_buttons(page)
    assert "expired" in text(client.get("/approvals/"))  # the inbox row says so too
    response = decide(client, approval, decision="approve")
    assert response.status_code == 409 and "This request has expired" in text(response)
    charge.refresh_from_db()
    assert charge.status == "awaiting_approval"  # the sweeper settles it, by policy


def test_a_withdrawn_request_says_so(tools, django_capture_on_commit_callbacks):
    run, _, approval = trip(tools)
    with django_capture_on_commit_callbacks(execute=True):
        run_cancel(run=run, actor="agent:booker", reason="Carol found a cheaper package")
    approval.refresh_from_db()
    assert approval.status == "withdrawn"
    page = detail(login(tools.alice), approval)
    assert "Withdrawn" in text(page) and "Carol found a cheaper package" in text(page) and not has_buttons(page)


def test_quorum_of_two_needs_alice_and_ben(tools, django_capture_on_commit_callbacks):
    spec = in_process_policy()["tools"]["payments.charge"]
    tool_upsert(tenant=tools.acme, name="payments.charge", spec={**spec, "approvals_required": 2}, actor="test")
    _, charge, approval = trip(tools)
    alice = login(tools.alice)
    with django_capture_on_commit_callbacks(execute=True):
        first = decide(alice, approval, decision="approve")
    assert first.status_code == 200 and "Your approval is recorded (1 of 2)" in text(first)
    charge.refresh_from_db()
    assert charge.status == "awaiting_approval" and world_state(tenant=acme())["charges"] == []
    page = detail(alice, approval)
    assert not has_buttons(page) and "You approved this. It needs 1 more approval(s)" in text(page)
    again = decide(alice, approval, decision="approve")  # a second vote by one person does not count
    assert again.status_code == 409 and "You have already decided on this request" in text(again)
    with django_capture_on_commit_callbacks(execute=True):
        second = decide(login(tools.ben), approval, decision="approve")
    assert second.status_code == 200 and "Approved. Unwind runs the action now" in text(second)
    charge.refresh_from_db()
    assert charge.status == "succeeded" and len(world_state(tenant=acme())["charges"]) == 1
    assert sorted(approval.decisions.values_list("user__username", flat=True)) == ["alice", "ben"]


def refund_waiting_for_approval(world, on_commit):
    """A charged trip cancelled after its pivot; the operator compensates; the refund waits for a person."""
    run, charge, approval = trip(world)
    with on_commit(execute=True):
        decide(login(world.alice), approval, decision="approve")
    with on_commit(execute=True):
        run_cancel(run=run, actor="agent:booker", reason="Carol changed her mind")
        run.refresh_from_db()
        assert run.status == "needs_attention"  # cancelled after the pivot: a person decides
        run_compensate(run=run, actor="user:oscar", reason="refund and release the holds")
    refund = Action.objects.get(run=run, kind="compensation", tool__name="payments.refund")
    assert refund.status == "awaiting_approval"
    charge.refresh_from_db()
    return run, charge, ApprovalRequest.objects.get(action=refund)


def test_a_compensation_request_shows_what_it_undoes(tools, django_capture_on_commit_callbacks):
    run, charge, undo = refund_waiting_for_approval(tools, django_capture_on_commit_callbacks)
    page = detail(login(tools.ben), undo)
    body = text(page)
    assert "Undo with <code>payments.refund</code>" in body and f"charge {charge.target_id}" in body
    # The undone charge's amount reads as money, as on every other page (tests/test_approval_money.py).
    assert f"This undoes step {charge.seq}, payments.charge called with amount_cents = €482.00 (48200 as sent)" in body
    assert "If this is undone later" not in body  # a compensation has no compensation of its own
    assert has_buttons(page)


def test_rejecting_a_compensation_keeps_the_step_and_unwinds_the_rest(tools, django_capture_on_commit_callbacks):
    run, charge, undo = refund_waiting_for_approval(tools, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        response = decide(login(tools.ben), undo, decision="reject", reason="Keep the charge: Carol pays a fee.")
    assert response.status_code == 200 and "That step stays as it is" in text(response)
    world = world_state(tenant=acme())
    assert [c["status"] for c in world["charges"]] == ["captured"]
    assert [f["status"] for f in world["flights"]] == ["cancelled"]
    assert [h["status"] for h in world["hotels"]] == ["cancelled"]
    run.refresh_from_db()
    assert run.status == "needs_attention"
    assert "payments.charge (step 3) could not be compensated" in run.attention_detail


def test_approving_a_compensation_runs_it(tools, django_capture_on_commit_callbacks):
    run, charge, undo = refund_waiting_for_approval(tools, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        response = decide(login(tools.ben), undo, decision="approve")
    assert response.status_code == 200
    assert [c["status"] for c in world_state(tenant=acme())["charges"]] == ["refunded"]
    run.refresh_from_db()
    assert run.status == "compensated"


# --- the admin -------------------------------------------------------------------------------------------

def test_admin_shows_requests_decisions_and_outbox_read_only(tools, django_capture_on_commit_callbacks):
    from django.contrib.auth import get_user_model

    _, _, approval = trip(tools)
    with django_capture_on_commit_callbacks(execute=True):
        decide(login(tools.alice), approval, decision="approve")
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "pw-root"))
    for model in ("approvalrequest", "approvaldecision", "notification"):
        listing = admin.get(f"/admin/approvals/{model}/?status__exact=approved" if model == "approvalrequest"
                            else f"/admin/approvals/{model}/")
        assert listing.status_code == 200, model
        assert f"/admin/approvals/{model}/add/" not in text(listing)
    page = admin.get(f"/admin/approvals/approvalrequest/{approval.pk}/change/")
    body = text(page)
    assert page.status_code == 200 and "payments.charge" in body and "alice" in body  # decisions inline
    assert 'name="_save"' not in body  # state changes only through the services
    assert admin.post(f"/admin/approvals/approvalrequest/{approval.pk}/delete/").status_code == 403
