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
# A full-page screenshot at twice a phone's pixels is an artifact, not a check: on a loaded CI machine one took past
# the 15 s above.
SCREENSHOT_TIMEOUT_MS = 90_000


def full_page(page_, path) -> None:
    """A screenshot of the whole page into `path`, given SCREENSHOT_TIMEOUT_MS."""
    page_.screenshot(path=str(path), full_page=True, timeout=SCREENSHOT_TIMEOUT_MS)

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
    """A page whose Content-Security-Policy violations fail the test: every page must work under the policy."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.shots = Shots(page, request.node.name)
    page.csp_violations = []
    watch_csp(page)
    yield page
    violations = list(page.csp_violations)
    context.close()
    assert not violations, "Content-Security-Policy violations:\n" + "\n".join(violations)


def watch_csp(page) -> None:
    """Chromium reports each blocked script, style or eval as a console error naming the policy."""
    def on_console(message):
        if message.type == "error" and "Content Security Policy" in message.text:
            page.csp_violations.append(f"{page.url}: {message.text}")

    page.on("console", on_console)


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
        full_page(self.page, path)
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

    page.get_by_role("link", name="Undo anyway, overwriting their change…").click()  # htmx swaps the confirmation panel in
    panel = page.locator("#confirm-compensate")
    sync_api.expect(panel).to_contain_text("overwrites their change")
    assert page.url.endswith(f"/console/recovery/{item.pk}/"), "the confirmation should come in place, not as a new page"
    panel.get_by_label("Reason").fill("Dana agreed to restore the old priority")
    page.shots.take("confirm")

    panel.get_by_role("button", name="Confirm: undo anyway, overwriting their change").click()
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
    sync_api.expect(page.locator("#trail")).to_contain_text("We restored ticket")
    page.get_by_role("button", name="Make a share link").click()
    share_url = page.locator("#share-url").input_value()
    page.shots.take("run")

    page.get_by_role("link", name="Metrics").click()
    page.wait_for_url("**/console/metrics/")
    sync_api.expect(page.locator("figure.chart")).to_have_count(7)  # six of issue 11, and holds and requests (issue 29)
    sync_api.expect(page.locator("#m-frequency")).to_have_text("100%")
    page.shots.take("metrics")

    anonymous = page.context.browser.new_context()
    try:
        outsider = anonymous.new_page()
        outsider.csp_violations = page.csp_violations
        watch_csp(outsider)
        outsider.goto(share_url)
        sync_api.expect(outsider.locator("h1")).to_have_text("What happened to your request")
        # the customer reads a role and the company, never the operator's login
        sync_api.expect(outsider.locator(".statements")).to_contain_text("An operator at Acme reviewed it")
        sync_api.expect(outsider.locator("main")).not_to_contain_text("oscar")
        full_page(outsider, page.shots.folder / "99-shared-trail.png")
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


def test_approver_sees_a_request_voided_by_a_policy_change_and_its_diff(tools, live_server, page):
    from approvals.models import ApprovalRequest
    from ledger.policy.versions import tool_upsert
    from tests.helpers import act, open_run

    run = open_run(tools, goal="Buy the annual plan")
    charge = act(run, "payments.charge", {"customer": "cus_78", "amount_cents": 9900, "currency": "EUR"})
    request = ApprovalRequest.objects.get(action=charge)
    log_in(page, live_server.url, "alice", f"/approvals/{request.pk}/")
    sync_api.expect(page.get_by_role("button", name="Approve")).to_be_visible()
    page.shots.take("request")

    # While the page is open, an admin points the charge somewhere else: a new policy version.
    spec = {"description": "Charge a card.", "executor": "http", "endpoint": "/sandbox/payments/charge-elsewhere",
            "saga_role": "pivot", "risk": "high", "action_class": "external_irreversible"}
    tool_upsert(tenant=tools.acme, name="payments.charge", spec=spec, actor="user:adam")

    page.get_by_role("button", name="Approve").click()
    decision = page.locator("#decision")
    sync_api.expect(decision).to_contain_text("This request was voided")
    sync_api.expect(decision).to_contain_text("the policy of payments.charge changed from version 1 to 2")
    sync_api.expect(decision.get_by_role("button", name="Approve")).to_have_count(0)
    page.shots.take("voided")
    charge.refresh_from_db()
    assert charge.status == "rejected"

    page.get_by_role("link", name="policy version 1").click()
    page.wait_for_url("**/console/policy/**")
    newest = page.locator('article[data-subject="payments.charge"][data-version="2"]')
    sync_api.expect(newest).to_contain_text("by user:adam")
    sync_api.expect(newest.locator("tr", has_text="endpoint")).to_contain_text("/sandbox/payments/charge-elsewhere")
    sync_api.expect(newest.locator("tr", has_text="endpoint")).to_contain_text("sandbox.payments.charge")
    page.shots.take("policy-history")
    sync_api.expect(page.get_by_role("navigation").get_by_role("link", name="Policy")).to_be_visible()


def test_the_api_docs_render_their_operations_under_the_content_security_policy(live_server, page):
    page.goto(f"{live_server.url}/api/docs/")
    operations = page.locator(".opblock")
    sync_api.expect(operations.first).to_be_visible()
    assert operations.count() >= 20, operations.count()
    sync_api.expect(page.locator(".opblock-summary-path").filter(has_text="/api/v1/runs").first).to_be_visible()
    operations.filter(has_text="/api/v1/runs").first.locator(".opblock-summary").click()  # expands (scripted)
    sync_api.expect(page.locator(".opblock.is-open")).to_have_count(1)
    page.shots.take("api-docs")


def test_a_page_that_breaks_the_policy_is_caught(live_server, page):
    """The watch itself: an inline script, which the policy blocks, shows up as a violation."""
    page.goto(f"{live_server.url}/accounts/login/")
    page.evaluate("""() => { const s = document.createElement('script'); s.textContent = 'window.ran = 1';
                             document.body.appendChild(s); }""")
    assert page.evaluate("() => window.ran") is None
    page.wait_for_timeout(200)
    assert any("Content Security Policy" in violation for violation in page.csp_violations)
    page.csp_violations.clear()


def test_the_queue_refreshes_itself_but_not_while_rows_are_ticked(tools, live_server, page):
    """The 30 s refresh pauses while rows are ticked for a bulk action (console.js, not an eval'd filter)."""
    from tests.test_console_scenarios import drift_run, open_item

    item = open_item(drift_run(tools))
    page.clock.install()
    log_in(page, live_server.url, "oscar", "/console/recovery/")
    polls = []
    page.on("request", lambda request: polls.append(request.url)
            if request.headers.get("hx-request") and "/console/recovery/" in request.url else None)

    with page.expect_request(lambda request: bool(request.headers.get("hx-request"))):
        page.clock.run_for("00:31")
    page.wait_for_load_state("networkidle")
    assert len(polls) == 1, polls

    page.locator(f'tr[data-item="{item.pk}"] input[name=items]').check()
    page.clock.run_for("01:05")
    page.wait_for_timeout(500)
    assert len(polls) == 1, polls  # ticked: no refresh that would clear the tick
    sync_api.expect(page.locator(f'tr[data-item="{item.pk}"] input[name=items]')).to_be_checked()


def test_the_admin_works_under_the_content_security_policy(world, live_server, page):
    """Django's admin (where lockouts are lifted) loads its scripts and styles under the policy."""
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("root", "root@example.com", "root-Passphrase-for-tests-7")
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("root-Passphrase-for-tests-7")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/admin/")
    page.goto(f"{live_server.url}/admin/axes/accessattempt/")
    sync_api.expect(page.locator("#content h1")).to_contain_text("access attempt")
    page.goto(f"{live_server.url}/admin/auth/user/{world.alice.pk}/change/")
    sync_api.expect(page.locator("#id_username")).to_have_value("alice")
    page.locator("#id_groups_add_all_link, .selector-chooseall").first.wait_for(state="attached")  # SelectFilter ran
    page.shots.take("admin")
