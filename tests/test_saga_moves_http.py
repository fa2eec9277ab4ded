"""Issue 38, findings 1 to 3, over real HTTP against a live server: every button obeys the saga law (one model of
legal moves, ledger/engine/moves.py) and every sentence matches what happened (the trail's typed facts).

1. A run whose undo failed half-way is never resumed: the API answers 409 with the model's sentence and nothing
   changes (no email for the deleted account, no license left standing); the page offers "Retry the failed undos"
   and close instead.
2. The customer's Stop says, before the click, what else it undoes; afterwards her trail says she decided, never
   "No person needed to review this"; the same for an operator's stop.
3. An idle timeout says nothing failed; a forced undo over someone else's change says what it overwrote and who
   decided; a describe cannot claim "your card"; "Undo this" is not offered on a run already undone.
"""
from datetime import timedelta

import pytest
import requests
from django.utils import timezone

from ledger.engine.runs import run_expire_idle
from ledger.models import Action, AuditEvent, Run
from ledger.policy import describe
from recovery.models import CustomerRequest, RecoveryItem
from recovery.trail import correction_trail, trail_link_create
from sandbox.faults import faults_clear
from sandbox.selectors import call_list
from tests.helpers import acme, act, fault, open_run
from tests.test_console_scenarios import new_ticket
from tests.test_holds import hold
from tests.test_holds_pages import form_post, login
from tests.test_notifications import smtp  # noqa: F401

pytest_plugins = ["tests.api_fixtures"]
NO_REVIEW = "No person needed to review this"


@pytest.fixture
def live(tools, live_server, settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    tools.live_server = live_server
    tools.base = live_server.url
    return tools


def agent_session(world) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    return session


def fingerprint(run_id: int) -> tuple:
    """Everything a refused move must leave as it was: the run, its steps, its item, its audit events, the world."""
    run = Run.objects.get(pk=run_id)
    steps = tuple(Action.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "status", "attempts"))
    items = tuple(RecoveryItem.objects.filter(run_id=run_id).values_list("pk", "status", "resolution"))
    events = AuditEvent.objects.filter(run_ref=run_id).count()
    return run.status, run.updated_at, steps, items, events, call_list(tenant=acme())["count"]


def half_undone_onboarding(world) -> tuple[int, RecoveryItem]:
    """docs/demo.md §3 with the extra rule: the email fails, the license's revoke fails, the HR account is deleted."""
    agent, base = agent_session(world), world.base
    fault("licenses.revoke", "status", status=503, times=0)
    fault("email.send", "status", status=400, times=0)
    run = agent.post(f"{base}/api/v1/runs", json={"goal": "Onboard Bea", "on_behalf_of": "bea@company.com"}).json()
    actions = f"{base}/api/v1/runs/{run['id']}/actions"
    user = agent.post(actions, json={"tool": "hr.create_user", "args": {"email": "bea@company.com",
                                                                       "name": "Bea Rossi"}}).json()
    agent.post(actions, json={"tool": "licenses.provision", "args": {"user_id": user["result"]["id"]}})
    agent.post(actions, json={"tool": "email.send", "args": {"to": "bea@home.example", "subject": "Welcome",
                                                             "body": "Hi"}})
    state = agent.get(f"{base}/api/v1/runs/{run['id']}").json()
    assert state["status"] == "needs_attention", state
    assert [a["status"] for a in state["actions"] if a["kind"] == "forward"] == [
        "compensated", "compensation_failed", "failed"]
    return run["id"], RecoveryItem.objects.get(run_id=run["id"], status="open")


def test_resume_after_a_half_done_unwind_is_refused_everywhere_and_changes_nothing(live):
    run_id, item = half_undone_onboarding(live)
    assert item.reason == "compensation_failed"
    faults_clear(tenant=acme())  # the email would go now, were the run resumed
    before = fingerprint(run_id)
    emails = call_list(tenant=acme(), tool="email.send")["count"]

    answer = requests.post(f"{live.base}/api/v1/recovery-items/{item.pk}/resume", json={"reason": "try again"},
                           auth=("oscar", "pw-oscar"))
    assert answer.status_code == 409 and answer.headers["Content-Type"].startswith("application/problem+json")
    assert "forward path is closed" in answer.json()["detail"]
    offered = requests.get(f"{live.base}/api/v1/recovery-items/{item.pk}", auth=("oscar", "pw-oscar")).json()["moves"]
    by_name = {move["name"]: move for move in offered}
    assert not by_name["resume"]["allowed"] and by_name["resume"]["refusal"] == answer.json()["detail"]
    assert by_name["compensate"]["allowed"] and by_name["compensate"]["label"] == "Retry the failed undos"
    assert "undo step 2 (licenses.provision)" in by_name["compensate"]["does"]
    assert fingerprint(run_id) == before and call_list(tenant=acme(), tool="email.send")["count"] == emails

    oscar = login(live, "oscar")
    page = oscar.get(f"{live.base}/console/recovery/{item.pk}/").text
    assert 'data-op="resume"' not in page and "Retry the failed undos" in page and 'data-op="close"' in page
    assert "Resume is not offered: run" in page and "forward path is closed" in page
    assert oscar.get(f"{live.base}/console/recovery/{item.pk}/resume/").status_code == 409
    posted = form_post(oscar, f"{live.base}/console/recovery/{item.pk}/",
                       f"{live.base}/console/recovery/{item.pk}/resume/", reason="try again")
    assert posted.status_code == 409 and "forward path is closed" in posted.text
    assert fingerprint(run_id) == before

    # What the model offers is accepted: retrying the undos revokes the license, and the email was never sent.
    compensated = requests.post(f"{live.base}/api/v1/recovery-items/{item.pk}/compensate",
                                json={"reason": "revoke works again"}, auth=("oscar", "pw-oscar"))
    assert compensated.status_code == 200, compensated.text
    run = Run.objects.get(pk=run_id)
    assert run.status == "compensated"
    assert call_list(tenant=acme(), tool="email.send")["count"] == emails
    assert not RecoveryItem.objects.filter(run_id=run_id, status="open").exists()


def test_close_is_refused_while_a_step_is_in_flight_and_changes_nothing(live):
    """The lifecycle model's finding (test_a_run_is_not_closed_while_a_step_is_in_flight), over HTTP: the customer asks
    to undo step 1 while step 2's call is still out (claimed, its lease running). The operator's close is refused by
    the API, the console's page and its form with the model's sentence, and nothing changes; once the step has landed,
    close is offered and accepted."""
    from ledger.engine import execution
    from ledger.engine.proposal import action_propose
    from ledger.policy.versions import tenant_defaults_set
    from recovery.requests import customer_request_open

    tenant_defaults_set(tenant=live.acme, values={"customer_requests_seconds": 86400}, actor="test")
    run = open_run(live, goal="Onboard Dana")
    user = act(run, "hr.create_user", {"email": "dana@company.com", "name": "Dana Ito"})
    proposal = action_propose(run=run, tool_name="licenses.provision", args={"user_id": user.result["id"]},
                              actor="agent:booker")
    assert proposal.claimed and proposal.action.status == "running"  # its call is out; its lease has not ended
    _, token = trail_link_create(run=run, user=live.oscar, sent_to="carol@example.com")
    customer_request_open(token=token, action_id=user.pk, kind="undo", text="Please undo this.")
    item = RecoveryItem.objects.get(run_id=run.pk, status="open")
    before = fingerprint(run.pk)

    items = f"{live.base}/api/v1/recovery-items/{item.pk}"
    answer = requests.post(f"{items}/close", json={"reason": "handled by hand"}, auth=("oscar", "pw-oscar"))
    assert answer.status_code == 409 and answer.headers["Content-Type"].startswith("application/problem+json")
    assert "still in flight (step 2, licenses.provision)" in answer.json()["detail"]
    by_name = {move["name"]: move for move in requests.get(items, auth=("oscar", "pw-oscar")).json()["moves"]}
    assert not by_name["close"]["allowed"] and by_name["close"]["refusal"] == answer.json()["detail"]
    oscar = login(live, "oscar")
    page = f"{live.base}/console/recovery/{item.pk}/"
    assert 'data-op="close"' not in oscar.get(page).text
    posted = form_post(oscar, page, f"{page}close/", reason="handled by hand")
    assert posted.status_code == 409 and "still in flight" in posted.text
    assert fingerprint(run.pk) == before

    execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)
    closed = requests.post(f"{items}/close", json={"reason": "handled by hand"}, auth=("oscar", "pw-oscar"))
    assert closed.status_code == 200, closed.text
    assert Run.objects.get(pk=run.pk).status == "closed"


def flight_then_held_email(world) -> tuple[Run, Action, Action]:
    hold(world, "email.send", {"for": "60s", "customer_can_stop": True})
    run = open_run(world, goal="Book Carol's flight")
    flight = act(run, "travel.book_flight", {"passenger": "Carol", "flight": "AF7781", "date": "2026-12-01"})
    email = act(run, "email.send", {"to": "carol@example.com", "subject": "Your flight", "body": "Booked"})
    assert email.status == "held" and not run.pivot_committed
    return run, flight, email


def test_the_customers_stop_says_it_also_cancels_the_flight_and_her_trail_says_she_decided(live):
    run, flight, email = flight_then_held_email(live)
    _, token = trail_link_create(run=run, user=live.oscar, sent_to="carol@example.com")
    url = f"{live.base}/console/trail/{token}/"
    page = requests.get(url).text
    said = "Stopping it also undoes what was done before it: we booked flight AF7781 on 2026-12-01 for Carol."
    assert said in page
    # What the page said is the plan the engine then runs.
    from ledger.engine import moves

    plan = moves.run_moves(run).get(moves.CUSTOMER, "stop", email.pk)
    assert [a.pk for a in plan.undoes] == [flight.pk]

    assert form_post(requests.Session(), url, f"{url}stop/{email.pk}/").status_code == 302
    run.refresh_from_db()
    flight.refresh_from_db()
    assert run.status == "compensated" and flight.status == "compensated"
    assert call_list(tenant=acme(), tool="travel.cancel_flight")["count"] == 1
    trail = requests.get(url).text
    assert "you stopped a later step before it was taken, so we began undoing the changes made before it." in trail
    assert "a step could not be completed" not in trail and NO_REVIEW not in trail
    assert "Who decided: you." in trail


def test_the_hold_notice_email_says_what_else_stopping_undoes(live, smtp, settings):
    from approvals.services import notifications_send
    from recovery.customers import known_customer_add

    settings.UNWIND_BASE_URL = live.base
    known_customer_add(tenant=live.acme, address="carol@example.com", user=live.ada)
    run, flight, email = flight_then_held_email(live)
    notifications_send()
    [mail] = [m for m in smtp.messages if "carol@example.com" in m["To"]]
    text = mail.get_body(("plain",)).get_content()
    assert "Stopping it also undoes an earlier step of this request: book a flight" in text


def test_an_operators_stop_says_what_it_undoes_and_the_trail_names_the_operator(live):
    run, flight, email = flight_then_held_email(live)
    oscar = login(live, "oscar")
    run_url = f"{live.base}/console/runs/{run.pk}/"
    page = oscar.get(run_url).text
    assert f"This will stop step {email.seq} (email.send) and undo step {flight.seq} (travel.book_flight)." in page
    queue = oscar.get(f"{live.base}/console/recovery/").text
    assert f"This will stop step {email.seq} (email.send) and undo step {flight.seq} (travel.book_flight)." in queue
    assert form_post(oscar, run_url, f"{live.base}/console/steps/{email.pk}/stop/").status_code == 302
    trail = correction_trail(Run.objects.get(pk=run.pk))
    texts = [s["text"] for s in trail["statements"]]
    assert "Why it was corrected: an operator at Acme stopped a later step before it was taken, so we began " \
           "undoing the changes made before it." in texts
    assert not any(NO_REVIEW in text for text in texts) and trail["reviewed_by"] == ["an operator at Acme"]


def test_the_approvers_reject_says_what_else_it_undoes(live):
    from tests.test_holds import hold as set_policy

    set_policy(live, "payments.charge", None, approval="manual")
    run = open_run(live, goal="Trip")
    flight = act(run, "travel.book_flight", {"passenger": "Carol", "flight": "TP101", "date": "2026-12-01"})
    charge = act(run, "payments.charge", {"customer": "carol", "amount_cents": 4200})
    assert charge.status == "awaiting_approval"
    alice = login(live, "alice")
    request_id = charge.approval_requests.get().pk
    page = alice.get(f"{live.base}/approvals/{request_id}/").text
    assert f"This will decline step {charge.seq} (payments.charge) and undo step {flight.seq} (travel.book_flight)." \
        in page


def test_an_idle_timeout_says_nothing_failed(live):
    run = open_run(live, goal="Book a hotel")
    act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Avenida", "nights": 2})
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=2))
    Action.objects.filter(run=run).update(updated_at=timezone.now() - timedelta(days=2))
    assert run_expire_idle(run_id=run.pk)
    trail = agent_session(live).get(f"{live.base}/api/v1/runs/{run.pk}/trail").json()
    texts = [s["text"] for s in trail["statements"]]
    assert "Why it was corrected: the assistant stopped working on it before it finished, so we began undoing the " \
           "changes it had made; nothing had failed." in texts
    assert not any("could not be completed" in text for text in texts)


def test_a_forced_undo_over_someone_elses_change_says_what_it_overwrote(live):
    from sandbox import services as world_services
    from ledger.engine.runs import run_cancel

    ticket = new_ticket()
    run = open_run(live, goal=f"Escalate {ticket}")
    act(run, "crm.update_ticket", {"ticket_id": ticket, "priority": "high"})
    world_services.crm_update_ticket(tenant=acme(), ticket_id=ticket, priority="urgent", status="pending", note=None,
                                     updated_by="dana")
    run_cancel(run=run, actor="agent:booker", reason="wrong ticket")
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "drift"
    answer = requests.post(f"{live.base}/api/v1/recovery-items/{item.pk}/compensate",
                           json={"reason": "Dana agreed"}, auth=("oscar", "pw-oscar"))
    assert answer.status_code == 200, answer.text
    trail = agent_session(live).get(f"{live.base}/api/v1/runs/{run.pk}/trail").json()
    [restored] = [s["text"] for s in trail["statements"] if s["kind"] == "restored"]
    assert "This replaced a later change someone else had made (priority: urgent, status: pending): an operator " \
           "at Acme decided to overwrite it." in restored


def test_a_describe_cannot_claim_your_card():
    with pytest.raises(describe.TemplateError, match="must not say “you” or “your”"):
        describe.check({"done": "We charged {args.amount_cents} to your card"}, where="tools.p.describe")
    describe.check({"done": "We took a card payment of {args.amount_cents}"}, where="tools.p.describe")


def test_a_policy_with_your_card_is_refused_over_http(live):
    document = {"tools": {"pay.it": {"executor": "client", "describe": {"done": "We charged your card"}}}}
    answer = requests.post(f"{live.base}/api/v1/policy?tenant=acme", json=document, auth=("ada", "pw-ada"))
    assert answer.status_code in (400, 422), answer.text
    assert "must not say" in answer.text


def test_undo_this_is_not_offered_on_a_run_already_undone(live):
    from ledger.policy.versions import tools_load
    from ledger.engine.runs import run_cancel

    tools_load(tenant=live.acme, document={"defaults": {"customer_requests": "7d"}, "tools": {}}, actor="test")
    run = open_run(live, goal="Book a hotel")
    hotel = act(run, "travel.reserve_hotel", {"guest": "Carol", "hotel": "Avenida", "nights": 2})
    run_cancel(run=run, actor="agent:booker")
    run.refresh_from_db()
    assert run.status == "compensated"
    _, token = trail_link_create(run=run, user=live.oscar, sent_to="carol@example.com")
    url = f"{live.base}/console/trail/{token}/"
    page = requests.get(url).text
    assert 'value="undo"' not in page and 'value="other"' in page
    forged = form_post(requests.Session(), url, f"{url}ask/", kind="undo", action=str(hotel.pk), text="undo it")
    assert forged.status_code == 409 and "nothing left to undo" in forged.text
    assert not CustomerRequest.objects.filter(run=run).exists()
    assert not RecoveryItem.objects.filter(run=run).exists()
