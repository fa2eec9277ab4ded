"""Approving from the inbox: each approver's email carries approve/reject links made for that person.

Mail goes through the outbox to a real SMTP server on loopback; the links are read out of the mail as it
arrived and opened over HTTP with a CSRF-enforcing client, signed in as nobody. Every refusal is checked
for what it must not have changed: the request, its decisions, the action, the link itself.
"""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from approvals import clicks, link_service
from approvals.models import ApprovalDecision, ApprovalLink, ApprovalRequest, Notification
from approvals.services import approval_decide, notifications_send
from ledger.models import Action, Membership
from ledger.tenancy import membership_set
from ledger.policy.versions import tool_upsert
from tests.conftest import in_process_policy
from tests.test_notifications import body_parts, charge_waiting, smtp  # noqa: F401 - the SMTP fixture

LINK = re.compile(r"(http\S+/approvals/link/([A-Za-z0-9_-]+)/)")


def mailed_links(server, to: str) -> dict:
    """The approve and reject URLs in the last mail `to` received, from its text and its HTML alike."""
    message = [m for m in server.messages if m["To"] == to][-1]
    text, html = body_parts(message)
    approve = re.search(r"Approve: (\S+)", text).group(1)
    reject = re.search(r"Reject:  (\S+)", text).group(1)
    assert f'href="{approve}"' in html and f'href="{reject}"' in html
    return {"approve": approve, "reject": reject}


def path_of(url: str) -> str:
    return url if url.startswith("/") else "/" + url.split("/", 3)[3]


def waiting_with_links(world, server, **kwargs):
    approval = charge_waiting(world, **kwargs)
    assert notifications_send() == 4
    return approval, mailed_links(server, "alice@example.com")


def state_of(approval: ApprovalRequest) -> dict:
    """What a refusal must leave as it was."""
    approval = ApprovalRequest.objects.get(pk=approval.pk)
    return {
        "request": (approval.status, approval.decided_at, approval.outcome_reason),
        "decisions": list(ApprovalDecision.objects.filter(request=approval).values_list("user_id", "decision")),
        "action": Action.objects.filter(pk=approval.action_id).values_list("status", flat=True).get(),
        "links": list(ApprovalLink.objects.filter(request=approval).order_by("pk").values_list("used_at", "used_for")),
    }


def confirm_form(browser: Client, url: str):
    page = browser.get(path_of(url))
    return page, {"csrfmiddlewaretoken": browser.cookies["csrftoken"].value}


def test_each_approver_gets_own_links_and_neither_database_nor_outbox_holds_one(tools, smtp):
    approval = charge_waiting(tools)
    notes = Notification.objects.filter(kind="approval_requested")
    assert sorted(n.recipients[0] for n in notes) == [
        "ada@example.com", "alice@example.com", "ben@example.com", "oscar@example.com"]
    assert all("[[approval-link:" in n.body_text and "/approvals/link/" not in n.body_text for n in notes)
    assert notifications_send() == 4
    alice, ben = mailed_links(smtp, "alice@example.com"), mailed_links(smtp, "ben@example.com")
    assert len({alice["approve"], alice["reject"], ben["approve"], ben["reject"]}) == 4
    tokens = [LINK.search(url).group(2) for url in (*alice.values(), *ben.values())]
    stored = str(list(ApprovalLink.objects.values())) + str(list(Notification.objects.values()))
    assert not any(token in stored for token in tokens)
    link = ApprovalLink.objects.get(request=approval, user=tools.alice)
    assert link.approve_hash == link_service.token_hash(tokens[0]) and link.expires_at <= approval.expires_at
    assert (link.args_hash, link.tool_id) == (approval.args_hash, approval.tool_id)


def test_a_placeholder_fills_only_in_the_email_its_link_belongs_to(tools, smtp):
    approval = charge_waiting(tools)
    alice_note = Notification.objects.get(recipients=["alice@example.com"])
    bens = ApprovalLink.objects.get(request=approval, user=tools.ben)
    smuggled = link_service.placeholder(bens, "approve")  # as an agent could put it into its arguments
    assert link_service.links_fill(alice_note, f"see {smuggled}") == f"see {smuggled}"  # never filled


def test_opening_the_link_changes_nothing_only_the_button_decides(tools, smtp):
    """A mail scanner or link preview fetches every URL in a mail: that must not approve anything."""
    approval, links = waiting_with_links(tools, smtp)
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    for _ in range(3):
        page = browser.get(path_of(links["approve"]))
        assert page.status_code == 200
        html = page.content.decode()
        assert "<code>payments.charge</code>" in html and "48200" in html and "the holds are in place" in html
        assert 'type="submit"' in html and page["Cache-Control"] == "no-store"
        assert page["Referrer-Policy"] == "same-origin"
    assert browser.head(path_of(links["approve"])).status_code == 405
    assert state_of(approval) == before
    assert browser.post(path_of(links["approve"])).status_code == 403  # no CSRF token: refused before anything


def test_the_button_approves_as_that_person_with_no_password_and_no_session(tools, smtp,
                                                                            django_capture_on_commit_callbacks):
    approval, links = waiting_with_links(tools, smtp)
    browser = Client(enforce_csrf_checks=True)
    _, form = confirm_form(browser, links["approve"])
    with django_capture_on_commit_callbacks(execute=True):
        done = browser.post(path_of(links["approve"]), form)
    assert done.status_code == 200 and "Approved by alice" in done.content.decode()
    approval.refresh_from_db()
    assert approval.status == "approved"
    assert list(approval.decisions.values_list("user__username", "decision")) == [("alice", "approve")]
    assert Action.objects.get(pk=approval.action_id).status == "succeeded"
    assert "sessionid" not in browser.cookies
    assert browser.get("/approvals/").status_code == 302  # still nobody signed in


def test_a_second_use_is_refused_and_changes_nothing(tools, smtp):
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec=dict(in_process_policy()["tools"]["payments.charge"], approvals_required=2))
    approval, links = waiting_with_links(tools, smtp)
    browser = Client(enforce_csrf_checks=True)
    _, form = confirm_form(browser, links["approve"])
    assert browser.post(path_of(links["approve"]), form).status_code == 200
    after_first = state_of(approval)
    assert after_first["request"][0] == "pending" and len(after_first["decisions"]) == 1
    for url in (links["approve"], links["reject"]):  # using one of the pair uses both
        again = browser.post(path_of(url), {**form, "reason": "changed my mind"})
        assert again.status_code == 410 and 'data-link-refused="approval_link_used"' in again.content.decode()
        assert browser.get(path_of(url)).status_code == 410
    assert state_of(approval) == after_first


def test_a_quorum_of_two_needs_two_different_peoples_links(tools, smtp, django_capture_on_commit_callbacks):
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec=dict(in_process_policy()["tools"]["payments.charge"], approvals_required=2))
    approval, alice = waiting_with_links(tools, smtp)
    ben = mailed_links(smtp, "ben@example.com")
    browser = Client(enforce_csrf_checks=True)
    _, form = confirm_form(browser, alice["approve"])
    assert "1 of 2" in browser.post(path_of(alice["approve"]), form).content.decode()
    assert Action.objects.get(pk=approval.action_id).status == "awaiting_approval"
    with django_capture_on_commit_callbacks(execute=True):
        assert browser.post(path_of(ben["approve"]), form).status_code == 200
    approval.refresh_from_db()
    assert approval.status == "approved" and approval.decisions.count() == 2
    assert Action.objects.get(pk=approval.action_id).status == "succeeded"


def test_a_link_refuses_a_browser_signed_in_as_someone_else(tools, smtp):
    approval, links = waiting_with_links(tools, smtp)
    before = state_of(approval)
    for intruder in ("ben", "mallory"):
        browser = Client(enforce_csrf_checks=True)
        browser.force_login(tools.users[intruder])
        page, form = confirm_form(browser, links["approve"])
        assert page.status_code == 403 and "approval_link_other_person" in page.content.decode()
        assert browser.post(path_of(links["approve"]), form).status_code == 403
    assert state_of(approval) == before
    alice = Client(enforce_csrf_checks=True)  # the person it was sent to may be signed in
    alice.force_login(tools.alice)
    assert alice.get(path_of(links["approve"])).status_code == 200


def test_changed_arguments_are_refused(tools, smtp):
    approval, links = waiting_with_links(tools, smtp)
    Action.objects.filter(pk=approval.action_id).update(args_hash="f" * 64)
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 409 and "Arguments changed" in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 409
    assert state_of(approval) == before


def test_a_new_policy_version_voids_and_the_link_refuses(tools, smtp):
    approval, links = waiting_with_links(tools, smtp)
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="user:ada",
                spec=dict(in_process_policy()["tools"]["payments.charge"], description="a new policy"))
    approval.refresh_from_db()
    assert approval.status == "voided"
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 409 and 'data-link-refused="approval_voided"' in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 409
    assert state_of(approval) == before


def test_a_policy_change_that_has_not_voided_yet_is_still_refused(tools, smtp):
    """The link is bound to its tool version, whatever the request's state says."""
    approval, links = waiting_with_links(tools, smtp)
    ApprovalLink.objects.filter(request=approval).update(tool=None)
    browser = Client(enforce_csrf_checks=True)
    page, _ = confirm_form(browser, links["approve"])
    assert page.status_code == 409 and "Policy changed" in page.content.decode()


def test_an_expired_link_is_refused(tools, smtp):
    approval, links = waiting_with_links(tools, smtp)
    ApprovalLink.objects.filter(request=approval).update(expires_at=timezone.now() - timedelta(seconds=1))
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 410 and 'data-link-refused="approval_link_expired"' in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 410
    assert state_of(approval) == before


def test_a_link_dies_with_its_request_and_a_setting_can_make_it_shorter(tools, smtp, settings):
    settings.UNWIND_APPROVAL_LINK_MAX_AGE = 600
    approval = charge_waiting(tools)
    link = ApprovalLink.objects.get(request=approval, user=tools.alice)
    assert link.expires_at <= timezone.now() + timedelta(seconds=600) < approval.expires_at
    settings.UNWIND_APPROVAL_LINK_MAX_AGE = 10 * 24 * 3600
    later = charge_waiting(tools, customer="cus_later")
    assert ApprovalLink.objects.get(request=later, user=tools.alice).expires_at == later.expires_at


def test_an_already_decided_request_is_refused(tools, smtp, django_capture_on_commit_callbacks):
    approval, links = waiting_with_links(tools, smtp)
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=approval, user=tools.ben, approve=False, reason="not this customer")
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 409 and 'data-link-refused="approval_link_decided"' in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 409
    assert state_of(approval) == before


@pytest.mark.parametrize("tamper", [
    lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"), lambda t: t[:-2], lambda t: "x" * 43, lambda t: t + "A" * 80])
def test_a_tampered_token_is_refused(tools, smtp, tamper):
    approval, links = waiting_with_links(tools, smtp)
    before = state_of(approval)
    token = LINK.search(links["approve"]).group(2)
    url = f"/approvals/link/{tamper(token)}/"
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, url)
    assert page.status_code == 404 and "Link not valid" in page.content.decode()
    assert browser.post(url, form).status_code == 404
    assert state_of(approval) == before


def test_a_rejection_needs_its_reason_and_then_counts_as_that_persons(tools, smtp, django_capture_on_commit_callbacks):
    approval, links = waiting_with_links(tools, smtp)
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["reject"])
    assert page.status_code == 200 and 'name="reason"' in page.content.decode()
    blank = browser.post(path_of(links["reject"]), {**form, "reason": "  "})
    assert blank.status_code == 400 and "needs a reason" in blank.content.decode()
    assert state_of(approval) == before  # the link is not used up by a refused decision
    with django_capture_on_commit_callbacks(execute=True):
        done = browser.post(path_of(links["reject"]), {**form, "reason": "wrong customer"})
    assert done.status_code == 200 and "wrong customer" in done.content.decode()
    approval.refresh_from_db()
    assert (approval.status, approval.outcome_reason) == ("rejected", "wrong customer")
    assert list(approval.decisions.values_list("user__username", "decision")) == [("alice", "reject")]
    assert Action.objects.get(pk=approval.action_id).status == "rejected"


def test_separation_of_duties_holds_for_links(tools, smtp):
    """The person the run acts for gets the email without links; a link made for them anyway cannot decide."""
    carol = tools.users["alice"].__class__.objects.create_user("carol", "carol@example.com", "pw-carol")
    membership_set(tenant=tools.acme, user=carol, role="approver")
    approval = charge_waiting(tools)  # on behalf of carol@example.com
    assert notifications_send() == 5
    carols = [m for m in smtp.messages if m["To"] == "carol@example.com"][0]
    assert "/approvals/link/" not in body_parts(carols)[0]
    assert not ApprovalLink.objects.filter(user=carol).exists()
    ApprovalLink.objects.filter(request=approval, user=tools.alice).update(user=carol)  # as a database edit would
    links = mailed_links(smtp, "alice@example.com")
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 403 and "separation of duties" in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 403
    assert state_of(approval) == before


def test_a_person_who_lost_the_approver_role_cannot_use_their_link(tools, smtp):
    approval, links = waiting_with_links(tools, smtp)
    Membership.objects.filter(user=tools.alice, tenant=tools.acme).update(role="viewer")
    before = state_of(approval)
    browser = Client(enforce_csrf_checks=True)
    page, form = confirm_form(browser, links["approve"])
    assert page.status_code == 403 and "Not an approver" in page.content.decode()
    assert browser.post(path_of(links["approve"]), form).status_code == 403
    assert state_of(approval) == before


def test_a_retried_send_mails_the_same_working_link(tools, smtp):
    smtp.stop()
    approval = charge_waiting(tools)
    assert notifications_send() == 0
    smtp.start()
    assert notifications_send(now=timezone.now() + timedelta(seconds=10)) == 4
    links = mailed_links(smtp, "alice@example.com")
    assert Client().get(path_of(links["approve"])).status_code == 200
    assert approval.links.count() == 4



def test_the_admin_shows_links_without_their_secrets_and_edits_nothing(tools, smtp):
    from django.contrib.auth import get_user_model

    approval = charge_waiting(tools)
    link = ApprovalLink.objects.get(request=approval, user=tools.alice)
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root")
    admin = Client()
    admin.force_login(root)
    listing = admin.get("/admin/approvals/approvallink/")
    page = admin.get(f"/admin/approvals/approvallink/{link.pk}/change/")
    assert listing.status_code == page.status_code == 200
    for secret in (link.nonce, link.approve_hash, link.reject_hash):
        assert secret not in listing.content.decode() and secret not in page.content.decode()
    assert admin.post(f"/admin/approvals/approvallink/{link.pk}/delete/", {"post": "yes"}).status_code == 403
    assert admin.get("/admin/approvals/slackidentity/add/").status_code == 403
    assert admin.get("/admin/approvals/slackmessage/").status_code == 200


def test_two_uses_racing_past_the_checks_decide_once(tools, smtp, monkeypatch):
    """Both requests passed the checks before either claimed the link: the conditional claim lets one through."""
    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec=dict(in_process_policy()["tools"]["payments.charge"], approvals_required=2))
    approval, links = waiting_with_links(tools, smtp)
    token = LINK.search(links["approve"]).group(2)
    first, decision = link_service.link_find(token)
    second, _ = link_service.link_find(token)  # loaded by the second request before the first used it
    clicks.link_use(link=first, decision=decision, browser_user=None)
    after_first = state_of(approval)
    monkeypatch.setattr(clicks, "link_check", lambda link, browser_user: None)  # it saw the link unused
    with pytest.raises(link_service.LinkRefused) as refused:
        clicks.link_use(link=second, decision=decision, browser_user=None)
    assert refused.value.code == "approval_link_used"
    assert state_of(approval) == after_first


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_of_one_link_decide_once(tools, smtp):
    import threading

    from django.db import connection

    tool_upsert(tenant=tools.acme, name="payments.charge", actor="test",
                spec=dict(in_process_policy()["tools"]["payments.charge"], approvals_required=2))
    approval, links = waiting_with_links(tools, smtp)
    start, outcomes = threading.Barrier(4), []

    def use(url):
        try:
            link, decision = link_service.link_find(LINK.search(url).group(2))
            start.wait()
            clicks.link_use(link=link, decision=decision, browser_user=None, reason="no")
            outcomes.append("decided")
        except Exception as error:  # noqa: BLE001 - each refusal is counted below
            outcomes.append(getattr(error, "code", repr(error)))
        finally:
            connection.close()

    threads = [threading.Thread(target=use, args=(links[kind],)) for kind in ("approve", "approve", "reject", "reject")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes.count("decided") == 1, outcomes
    assert len(outcomes) == 4 and ApprovalDecision.objects.filter(request=approval).count() == 1
    assert ApprovalLink.objects.get(request=approval, user=tools.alice).used_at is not None
