"""End to end in a real browser: Playwright driving Debian's Chromium against a live server.

An operator compensates a recovery item from the queue; an approver approves a pending charge from
the inbox. Screenshots of each step are kept in var/test-artifacts/ as test artifacts.

Needs the `playwright` Python package and /usr/bin/chromium (`apt-get install chromium`); no browser
is downloaded (`playwright install` is never run). Without either, these tests skip and say why.
"""
import os
import re
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "var" / "test-artifacts"
LAUNCH_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 15_000

NO_PLAYWRIGHT = "the playwright package is not installed (pip install -e '.[test]')"
NO_CHROMIUM = "Chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)"

sync_api = pytest.importorskip("playwright.sync_api", reason=NO_PLAYWRIGHT)
pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)]


@pytest.fixture(scope="module")
def browser():
    # Playwright's sync API runs an event loop in this thread; the ORM calls the tests make around it
    # are ordinary synchronous calls, which Django would otherwise refuse while a loop is running.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True)
            try:
                yield chromium
            finally:
                chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.shots = Shots(page, request.node.name)
    yield page
    context.close()


class Shots:
    """Numbered full-page screenshots per test: var/test-artifacts/<test>/<n>-<step>.png."""

    def __init__(self, page, test_name: str):
        self.page = page
        self.folder = ARTIFACTS / re.sub(r"[^\w.-]+", "_", test_name)
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("*.png"):
            old.unlink()
        self.count = 0

    def take(self, step: str) -> Path:
        self.count += 1
        path = self.folder / f"{self.count:02d}-{step}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def log_in(page, base_url: str, username: str, next_url: str) -> None:
    page.goto(f"{base_url}/accounts/login/?next={next_url}")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(f"pw-{username}")
    page.shots.take("login")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"**{next_url}")


def test_operator_compensates_an_item_from_the_queue(tools, live_server, page):
    from tests.test_console_scenarios import drift_run, open_item

    run = drift_run(tools)
    item = open_item(run)
    log_in(page, live_server.url, "oscar", "/console/recovery/")
    row = page.locator(f'tr[data-item="{item.pk}"]')
    sync_api.expect(row).to_contain_text("target changed since (drift)")
    page.shots.take("queue")

    row.get_by_role("link", name=f"#{item.pk}").click()
    page.wait_for_url(f"**/console/recovery/{item.pk}/")
    sync_api.expect(page.locator("h1")).to_contain_text(f"Recovery item #{item.pk}")
    page.shots.take("item")

    page.get_by_role("link", name="Compensate…").click()  # htmx swaps the confirmation panel in
    panel = page.locator("#confirm-compensate")
    sync_api.expect(panel).to_contain_text("overwrites their change")
    assert page.url.endswith(f"/console/recovery/{item.pk}/"), "the confirmation should come in place, not as a new page"
    panel.get_by_label("Reason").fill("Dana agreed to restore the old priority")
    page.shots.take("confirm")

    panel.get_by_role("button", name="Confirm: compensate").click()
    page.wait_for_url(f"**/console/recovery/{item.pk}/")
    sync_api.expect(page.locator(".messages")).to_contain_text("Compensated")
    sync_api.expect(page.locator("#run-status")).to_have_text("compensated")
    sync_api.expect(page.locator("#item-status")).to_contain_text("compensated by user:oscar")
    page.shots.take("compensated")

    run.refresh_from_db()
    item.refresh_from_db()
    assert run.status == "compensated"
    assert (item.resolution, item.resolution_note) == ("compensated", "Dana agreed to restore the old priority")

    page.get_by_role("link", name=f"run {run.pk}").first.click()
    page.wait_for_url(f"**/console/runs/{run.pk}/")
    sync_api.expect(page.locator("#trail")).to_contain_text("Restored ticket")
    page.get_by_role("button", name="Make a share link").click()
    share_url = page.locator("#share-url").input_value()
    page.shots.take("run")

    page.get_by_role("link", name="Metrics").click()
    page.wait_for_url("**/console/metrics/")
    sync_api.expect(page.locator("figure.chart")).to_have_count(6)
    sync_api.expect(page.locator("#m-frequency")).to_have_text("100%")
    page.shots.take("metrics")

    anonymous = page.context.browser.new_context()
    try:
        outsider = anonymous.new_page()
        outsider.goto(share_url)
        sync_api.expect(outsider.locator("h1")).to_have_text("What happened to your request")
        sync_api.expect(outsider.locator(".statements")).to_contain_text("oscar reviewed the run")
        outsider.screenshot(path=str(page.shots.folder / "99-shared-trail.png"), full_page=True)
    finally:
        anonymous.close()


def test_approver_approves_a_pending_charge_from_the_inbox(tools, live_server, page):
    from approvals.models import ApprovalRequest
    from tests.helpers import act, open_run

    run = open_run(tools, goal="Buy the annual plan")
    charge = act(run, "payments.charge", {"customer": "cus_77", "amount_cents": 9900, "currency": "EUR"})
    assert charge.status == "awaiting_approval"
    request = ApprovalRequest.objects.get(action=charge)

    log_in(page, live_server.url, "alice", "/approvals/")
    link = page.get_by_role("link", name="payments.charge")
    sync_api.expect(link).to_be_visible()
    page.shots.take("inbox")
    link.click()
    page.wait_for_url(f"**/approvals/{request.pk}/")
    page.shots.take("request")

    page.get_by_role("button", name="Approve").click()
    sync_api.expect(page.locator("#decision")).to_contain_text("Approved")
    page.shots.take("approved")

    request.refresh_from_db()
    charge.refresh_from_db()
    assert request.status == "approved"
    assert charge.status == "succeeded", (charge.status, charge.error_message)
    assert request.decisions.get().user == tools.alice
