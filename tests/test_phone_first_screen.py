"""On a 390 px phone, a recovery item puts the decision and the facts it needs on the first screen.

A drift item was about 4,900 px tall, its choices below the run's shape, the attempts and every plan; the rest is
now folded below the decision. The queue, the runs and the inbox fit the width (no sideways scrolling), and the
navigation is one row that scrolls.
"""
import pytest

from tests.test_browser import CHROMIUM, TIMEOUT_MS, Shots, browser, log_in, page, sync_api, watch_csp  # noqa: F401
from tests.test_pages_browser import PHONE, failed_after_pivot_run, fits, pending_charge, phone  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")]


def first_screen_holds(page_, what: str, *selectors: str) -> None:
    """Each selector's element starts within the first screen (the viewport's height, nothing scrolled)."""
    page_.evaluate("window.scrollTo(0, 0)")
    for selector in selectors:
        box = page_.locator(selector).first.bounding_box()
        assert box is not None, f"{what}: no {selector}"
        assert box["y"] + min(box["height"], 40) <= PHONE["height"], \
            f"{what}: {selector} starts at {round(box['y'])} px, below the first screen ({PHONE['height']} px)"


def test_a_recovery_item_decides_on_the_first_screen(tools, live_server, phone):  # noqa: F811
    from tests.test_console_scenarios import compensation_failed_run, drift_run, open_item

    drift = open_item(drift_run(tools))
    failed = open_item(compensation_failed_run(tools))
    stuck = open_item(failed_after_pivot_run(tools))
    pending_charge(tools)
    log_in(phone, live_server.url, "oscar", f"/console/recovery/{drift.pk}/")
    for item, what in ((drift, "drift item"), (failed, "compensation-failed item"), (stuck, "step-failed item")):
        phone.goto(f"{live_server.url}/console/recovery/{item.pk}/")
        fits(phone, what)
        phone.shots.take(what.replace(" ", "-"))
        first_screen_holds(phone, what, "#drift, #failure", "#decide [data-op]")  # the facts, then the choice
        height = phone.evaluate("document.documentElement.scrollHeight")
        assert height < 3 * PHONE["height"], f"{what}: {height} px tall"
    for path, what in (("/console/recovery/", "queue"), ("/console/runs/", "runs"), ("/console/outbox/", "outbox")):
        phone.goto(live_server.url + path)
        fits(phone, what)
        phone.shots.take(what)
    phone.get_by_role("button", name="Log out").click()
    log_in(phone, live_server.url, "alice", "/approvals/")
    fits(phone, "inbox")
    sync_api.expect(phone.locator('td[data-label="Amount"]').first).to_have_text("€920.00")
    phone.shots.take("inbox")
