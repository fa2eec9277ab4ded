"""Issue 38, finding 5: nothing hides past an edge. In a real browser (Playwright driving Debian's Chromium) against a
live server, with the demo's refund (tests/test_approval_money.py):

- on a 390 px phone, the approval page's "The run so far" shows every step's Status, and the run page's share links
  show their Revoke button (which works), both whole inside the window and inside every box around them (a table
  that scrolled inside its own box used to hide them past its right edge);
- in a 1,280 px window, the policy page is no wider than the window (a long description made it 1,394 px);
- every page is no wider than its window, and every link it renders answers.
"""
import pytest

from tests.test_approval_money import madrid_refund
from tests.test_browser import CHROMIUM, TIMEOUT_MS, Shots, browser, log_in, page, sync_api, watch_csp  # noqa: F401
from tests.test_pages_browser import PHONE, phone  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")]

# Why an element is not whole on screen: outside the window, or cut by a box around it that clips or scrolls.
CUT = """e => {
    const box = e.getBoundingClientRect();
    if (!box.width || !box.height) return 'it has no box';
    if (box.left < 0 || box.right > window.innerWidth + 1) return `outside the window (${box.left}..${box.right} px)`;
    for (let up = e.parentElement; up; up = up.parentElement) {
        if (getComputedStyle(up).overflowX === 'visible') continue;
        const around = up.getBoundingClientRect();
        if (box.left < around.left - 1 || box.right > around.right + 1)
            return `cut by ${up.tagName.toLowerCase()}.${up.className} (${Math.round(box.right)} px past ${Math.round(around.right)})`;
    }
    return '';
}"""


def whole(locator) -> list[str]:
    """The reasons each element of `locator` is not whole on screen (empty when every one is)."""
    return [why for why in locator.evaluate_all(f"all => all.map({CUT})") if why]


def fits_window(page_, what: str) -> None:
    width = page_.evaluate("document.documentElement.scrollWidth")
    window = page_.evaluate("window.innerWidth")
    assert width <= window, f"{what}: {width} px wide in a {window} px window"


def links_answer(page_, what: str) -> int:
    """GET every same-origin link the page renders, with the page's own cookies: each answers 200."""
    hrefs = page_.locator("a[href]").evaluate_all(
        "all => [...new Set(all.map(a => a.href).filter(h => h.startsWith(location.origin)))]")
    broken = [(href, page_.request.get(href).status) for href in hrefs]
    broken = [(href, status) for href, status in broken if status != 200]
    assert not broken, f"{what}: links that do not answer 200: {broken}"
    return len(hrefs)


def test_on_a_phone_the_run_so_far_shows_every_status(tools, live_server, phone):  # noqa: F811
    refund = madrid_refund(tools)
    log_in(phone, live_server.url, "ben", f"/approvals/{refund.pk}/")
    fits_window(phone, "approval page")
    statuses = phone.locator("#run-steps tbody tr td:nth-child(4)")
    sync_api.expect(statuses).to_have_count(4)  # flight, hotel, charge, and the refund that waits
    sync_api.expect(statuses.nth(3)).to_contain_text("awaiting approval")
    for number, column in enumerate(("#", "Tool", "Target", "Status"), start=1):
        cells = phone.locator(f"#run-steps tbody tr td:nth-child({number})")
        assert whole(cells) == [], f"{column} column on a phone"
    assert links_answer(phone, "approval page") > 3
    phone.goto(f"{live_server.url}/approvals/")
    fits_window(phone, "approvals inbox")
    assert whole(phone.locator("td[data-label='Amount']")) == []
    links_answer(phone, "approvals inbox")


def test_on_a_phone_each_share_link_shows_its_revoke_button(tools, live_server, phone):  # noqa: F811
    from recovery.trail import trail_link_create
    from recovery.models import TrailShareLink

    refund = madrid_refund(tools)
    made = [trail_link_create(run=refund.run, user=tools.oscar)[0] for _ in range(2)]
    log_in(phone, live_server.url, "oscar", f"/console/runs/{refund.run_id}/")
    fits_window(phone, "run page")
    revoke = phone.locator("#share-links").get_by_role("button", name="Revoke")
    sync_api.expect(revoke).to_have_count(2)
    assert whole(revoke) == []
    assert whole(phone.locator("#share-links tbody tr td:nth-child(5)")) == []  # sent to
    links_answer(phone, "run page")
    phone.locator(f"#share-link-{made[0].pk}").get_by_role("button", name="Revoke").click()
    sync_api.expect(phone.locator(f"#share-link-{made[0].pk}")).to_have_count(0)
    assert TrailShareLink.objects.get(pk=made[0].pk).revoked_at is not None
    assert TrailShareLink.objects.get(pk=made[1].pk).revoked_at is None


def test_the_policy_page_fits_a_desktop_window_and_a_phone(tools, live_server, page, phone):  # noqa: F811
    log_in(page, live_server.url, "oscar", "/console/policy/")
    sync_api.expect(page.locator("article.policy-version").first).to_be_visible()
    fits_window(page, "policy page at 1280 px")
    assert whole(page.locator("article.policy-version pre")) == []
    links_answer(page, "policy page")
    log_in(phone, live_server.url, "oscar", "/console/policy/")
    phone.goto(f"{live_server.url}/console/policy/?tenant=acme&tool=payments.capture")
    fits_window(phone, "policy page on a phone")
    values = phone.locator("article.policy-version td[data-label] pre")
    assert values.count() > 10 and whole(values) == []
