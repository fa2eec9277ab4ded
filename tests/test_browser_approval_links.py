"""Approving from an email link in a real browser (Playwright, Debian's Chromium), with no password.

The link is read out of the mail a real SMTP server on loopback received. The confirmation page must work
on a phone in two taps (open the link, tap the button) without scrolling sideways at 390 px, and every
refusal (second use, another person signed in, changed arguments, expiry) is a page that says why while
nothing changes. Screenshots of the confirmation page (desktop and 390 px) go to var/test-artifacts/, or to
docs/img/approve-link-*.png with UNWIND_DOCS_SCREENSHOTS=1 (how the committed ones were made).
"""
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalLink, ApprovalRequest
from approvals.services import notifications_send
from ledger.models import Action
from ledger.policy.versions import tools_load
from tests.conftest import World, in_process_policy, seed_sandboxes
from tests.helpers import act, open_run
from tests.test_browser import ARTIFACTS, CHROMIUM, NO_CHROMIUM, NO_PLAYWRIGHT, TIMEOUT_MS, log_in, watch_csp
from tests.test_browser import full_page
from tests.test_browser import browser, page  # noqa: F401 - fixtures
from tests.test_notifications import body_parts, smtp  # noqa: F401 - the SMTP fixture

sync_api = pytest.importorskip("playwright.sync_api", reason=NO_PLAYWRIGHT)
pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)]
DOCS_IMG = (Path(__file__).resolve().parent.parent / "docs" / "img" if os.environ.get("UNWIND_DOCS_SCREENSHOTS")
            else ARTIFACTS / "approval-links")
PHONE = {"width": 390, "height": 844}


@pytest.fixture(autouse=True)
def _screenshot_folder():
    DOCS_IMG.mkdir(parents=True, exist_ok=True)


@pytest.fixture
def live(transactional_db, live_server, _engine_settings):
    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    world.url = live_server.url
    return world


@pytest.fixture
def phone(browser):  # noqa: F811 - the module-scoped browser fixture
    """A 390 px wide page, touch and all, whose CSP violations fail the test."""
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.csp_violations = []
    watch_csp(page)
    yield page
    violations = list(page.csp_violations)
    context.close()
    assert not violations, "Content-Security-Policy violations:\n" + "\n".join(violations)


def emailed_link(world, server, settings, *, to="alice@example.com", customer="cus_ana") -> tuple[ApprovalRequest, str]:
    """A charge waits for approval; the worker mails it; the approve link as `to` received it."""
    settings.UNWIND_BASE_URL = world.url
    action = act(open_run(world, goal=f"Book the Lisbon trip for {customer}"), "payments.charge",
                 {"customer": customer, "amount_cents": 48200, "currency": "EUR"},
                 intent={"goal": "pay", "reasoning": "the holds are in place", "confidence": 0.8})
    assert notifications_send() >= 4
    message = [m for m in server.messages if m["To"] == to][-1]
    url = re.search(r"Approve: (\S+)", body_parts(message)[0]).group(1)
    assert url.startswith(world.url + "/approvals/link/")
    return ApprovalRequest.objects.get(action=action), url


def unchanged(approval: ApprovalRequest) -> tuple:
    approval = ApprovalRequest.objects.get(pk=approval.pk)
    return (approval.status, ApprovalDecision.objects.filter(request=approval).count(),
            Action.objects.get(pk=approval.action_id).status,
            list(ApprovalLink.objects.filter(request=approval).values_list("used_at", flat=True)))


def fits(page, width: int = 390) -> None:
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"{page.url} scrolls sideways at {width}px: {scroll}px wide"


def test_approve_from_the_email_on_a_desktop_with_no_password(live, smtp, settings, page):  # noqa: F811
    approval, url = emailed_link(live, smtp, settings)
    page.goto(url)
    sync_api.expect(page.locator("h1")).to_contain_text("Approve payments.charge")
    sync_api.expect(page.locator("main")).to_contain_text("the holds are in place")
    sync_api.expect(page.locator("main")).to_contain_text("€482.00")  # the tool's display hint: money, not cents
    full_page(page, DOCS_IMG / "approve-link-desktop.png")
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"  # opening it decided nothing

    page.get_by_role("button", name="Approve").click()
    sync_api.expect(page.locator("h1")).to_have_text("Approved")
    sync_api.expect(page.locator("main")).to_contain_text("Approved by alice")
    approval.refresh_from_db()
    assert approval.status == "approved"
    assert list(approval.decisions.values_list("user__username", flat=True)) == ["alice"]
    assert Action.objects.get(pk=approval.action_id).status == "succeeded"
    assert not [c for c in page.context.cookies() if c["name"] == "sessionid"]  # nobody was logged in

    page.goto(url)  # the same link again
    sync_api.expect(page.locator("h1")).to_have_text("Link already used")
    sync_api.expect(page.get_by_role("button", name="Approve")).to_have_count(0)
    assert ApprovalDecision.objects.filter(request=approval).count() == 1


def test_approve_from_the_email_on_a_phone_in_two_taps(live, smtp, settings, phone):
    approval, url = emailed_link(live, smtp, settings)
    phone.goto(url)  # tap one: the link in the mail
    sync_api.expect(phone.locator("h1")).to_contain_text("Approve payments.charge")
    fits(phone)
    full_page(phone, DOCS_IMG / "approve-link-390.png")
    phone.get_by_role("button", name="Approve").tap()  # tap two
    sync_api.expect(phone.locator("main")).to_contain_text("Approved by alice")
    fits(phone)
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "approved"

    phone.go_back()
    phone.reload()
    sync_api.expect(phone.locator("h1")).to_have_text("Link already used")
    fits(phone)


def test_the_link_refuses_a_browser_signed_in_as_someone_else(live, smtp, settings, page):  # noqa: F811
    approval, url = emailed_link(live, smtp, settings)
    before = unchanged(approval)
    log_in(page, live.url, "ben", "/approvals/")
    page.goto(url)
    sync_api.expect(page.locator("h1")).to_have_text("Link for someone else")
    sync_api.expect(page.locator("main")).to_contain_text("sent to alice, but this browser is signed in as ben")
    sync_api.expect(page.get_by_role("button", name="Approve")).to_have_count(0)
    assert unchanged(approval) == before


def test_the_link_refuses_changed_arguments(live, smtp, settings, phone):
    approval, url = emailed_link(live, smtp, settings)
    Action.objects.filter(pk=approval.action_id).update(args_hash="f" * 64)
    before = unchanged(approval)
    phone.goto(url)
    sync_api.expect(phone.locator("h1")).to_have_text("Arguments changed")
    sync_api.expect(phone.get_by_role("button", name="Approve")).to_have_count(0)
    fits(phone)
    assert unchanged(approval) == before


def test_the_link_refuses_once_expired_even_with_the_page_open(live, smtp, settings, phone):
    approval, url = emailed_link(live, smtp, settings)
    phone.goto(url)
    sync_api.expect(phone.get_by_role("button", name="Approve")).to_be_visible()
    ApprovalLink.objects.filter(request=approval).update(expires_at=timezone.now() - timedelta(seconds=1))
    before = unchanged(approval)
    phone.get_by_role("button", name="Approve").tap()  # the page was open before it expired
    sync_api.expect(phone.locator("h1")).to_have_text("Link expired")
    fits(phone)
    assert unchanged(approval) == before
