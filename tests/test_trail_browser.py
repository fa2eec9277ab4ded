"""The customer's correction trail and the console's outbox in a real browser, on a desktop and on a 390 px phone.

The share page is opened without an account from a link an operator made for a run that failed (an injected
fault) and was unwound: it must read in plain words, with no internals and no link into the staff site, and
fit a phone without sideways scrolling. The screenshots in docs/img/ (trail-*, outbox-*) are taken here:
UNWIND_DOCS_SCREENSHOTS=1 writes them there, otherwise they go to var/test-artifacts/docs-img/.
"""
import os
from pathlib import Path

import pytest

from tests.test_browser import ARTIFACTS, CHROMIUM, TIMEOUT_MS, Shots, browser, log_in, page, sync_api, watch_csp  # noqa: F401
from tests.test_browser import full_page

DOCS_IMG = (Path(__file__).resolve().parent.parent / "docs" / "img" if os.environ.get("UNWIND_DOCS_SCREENSHOTS")
            else ARTIFACTS / "docs-img")
DOCS_IMG.mkdir(parents=True, exist_ok=True)
PHONE = {"width": 390, "height": 844}
pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed")]


def phone_page(browser, request, page):  # noqa: F811
    """A 390 px wide page sharing the desktop page's CSP watch."""
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    context.set_default_timeout(TIMEOUT_MS)
    phone = context.new_page()
    phone.csp_violations = page.csp_violations
    watch_csp(phone)
    request.addfinalizer(context.close)
    return phone


def fits(page) -> None:  # noqa: F811
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 390, f"{page.url} is {width} px wide on a 390 px phone"


def test_the_customer_reads_the_trail_of_an_unwound_run_on_a_desktop_and_a_phone(tools, live_server, page, browser,
                                                                               request):  # noqa: F811
    from recovery.trail import trail_link_create
    from tests.test_console_scenarios import onboarding_compensated
    from tests.test_trail_customer import customer_leaks

    run = onboarding_compensated(tools)  # the welcome email hits an injected 504 fault; all is undone
    _, token = trail_link_create(run=run, user=tools.oscar)
    url = f"{live_server.url}/console/trail/{token}/"
    page.goto(url)
    sync_api.expect(page.locator("h1")).to_have_text("What happened to your request")
    sync_api.expect(page.locator(".statements")).to_contain_text("We removed the HR account we had created for Ashu")
    text = page.locator("body").inner_text()
    assert customer_leaks(text, run) == []
    assert page.locator("a").count() == 0 and page.locator("form").count() == 0  # no way into the staff site
    full_page(page, DOCS_IMG / "trail-desktop.png")

    phone = phone_page(browser, request, page)
    phone.goto(url)
    sync_api.expect(phone.locator(".statements li").first).to_be_visible()
    fits(phone)
    full_page(phone, DOCS_IMG / "trail-phone.png")


def test_an_operator_reads_the_demo_email_in_the_outbox_on_a_desktop_and_a_phone(tools, live_server, page, browser,
                                                                                request):  # noqa: F811
    from recovery.trail import trail_send
    from tests.helpers import act, open_run
    from tests.test_console_scenarios import onboarding_compensated

    trail_send(run=onboarding_compensated(tools), user=tools.oscar)
    act(open_run(tools, goal="Buy the annual plan"), "payments.charge",
        {"customer": "cus_77", "amount_cents": 9900, "currency": "EUR"})  # an approval request, emailed
    log_in(page, live_server.url, "oscar", "/console/outbox/")
    rows = page.locator(".outbox-row")
    # The trail, and the approval request: one email per person who may approve in acme (alice, ben, oscar, ada).
    sync_api.expect(rows).to_have_count(5)
    sync_api.expect(rows.filter(has_text="Approval needed")).to_have_count(4)
    sync_api.expect(rows.first).to_contain_text("Approval needed")
    full_page(page, DOCS_IMG / "outbox-desktop.png")
    page.get_by_role("link", name="What happened to your request").click()
    sync_api.expect(page.locator("#message-body")).to_contain_text("Everything the agent changed has been undone.")
    message_url = page.url

    phone = phone_page(browser, request, page)
    phone.shots = Shots(phone, request.node.name + "-phone")
    log_in(phone, live_server.url, "oscar", "/console/outbox/")
    fits(phone)
    phone.goto(message_url)
    sync_api.expect(phone.locator("#message-body")).to_contain_text("Read it online")
    fits(phone)
    full_page(phone, DOCS_IMG / "outbox-message-phone.png")
