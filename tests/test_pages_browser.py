"""The pages people live in, in a real browser (Playwright driving Debian's Chromium against a live server).

Every staff page fits a 390 px phone without sideways scrolling, with real content on it (a long tool name,
long arguments); the saga strip shows a run's shape; a drifted target is compared side by side; money reads
as money; approvers land on their inbox. Content-Security-Policy violations fail every test here (the
`page` fixture of tests/test_browser.py). With UNWIND_DOCS_SCREENSHOTS=1 the `pages-*` screenshots are written
to docs/img/ for the README (on SQLite, so the ids in them stay small).
"""
import os
import re
from pathlib import Path

import pytest

from tests.test_browser import CHROMIUM, TIMEOUT_MS, Shots, browser, log_in, page, sync_api, watch_csp  # noqa: F401
from tests.test_browser import full_page

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")]

PHONE = {"width": 390, "height": 844}
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
LONG_TOOL = "crm.update_ticket_priority_and_escalation_notes_for_enterprise_customer_accounts_v2"
LONG_NOTE = ("Escalated because the customer's integration at "
             "https://integrations.example.com/webhooks/enterprise/accounts/0000-1111-2222-3333/callbacks/retry-queue "
             "keeps failing; " + "x" * 120)


@pytest.fixture
def phone(browser, request):  # noqa: F811 (the fixture imported above)
    """A 390 px wide page (an iPhone 12-14 in portrait) whose CSP violations fail the test."""
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    context.set_default_timeout(TIMEOUT_MS)
    phone_page = context.new_page()
    phone_page.shots = Shots(phone_page, request.node.name)
    phone_page.csp_violations = []
    watch_csp(phone_page)
    yield phone_page
    violations = list(phone_page.csp_violations)
    context.close()
    assert not violations, "Content-Security-Policy violations:\n" + "\n".join(violations)


OVERFLOWING = """limit => [...document.querySelectorAll('body *')].filter(e => {
    const box = e.getBoundingClientRect();
    if (box.width === 0 || box.right <= limit + 1) return false;
    for (let up = e.parentElement; up; up = up.parentElement) {  // inside a box that scrolls on its own: fine
        const own = up !== document.body && up !== document.documentElement;
        if (own && getComputedStyle(up).overflowX !== 'visible') return false;
    }
    return true;
}).slice(0, 5).map(e => e.tagName + '.' + e.className + ' → ' + Math.round(e.getBoundingClientRect().right) + ' px')"""


def fits(page_, what: str) -> None:
    """The document is no wider than the viewport, and nothing sticks out past its right edge."""
    width = page_.evaluate("document.documentElement.scrollWidth")
    viewport = page_.evaluate("window.innerWidth")
    sticking_out = page_.evaluate(OVERFLOWING, PHONE["width"])
    assert width <= PHONE["width"] and viewport == PHONE["width"] and not sticking_out, (
        f"{what}: {width} px wide in a {viewport} px window; sticking out: {sticking_out}")
    cut = page_.evaluate("[...document.querySelectorAll('header.top nav a')].filter(a => "
                         "a.getBoundingClientRect().right > window.innerWidth).map(a => a.textContent)")
    assert not cut, f"{what}: navigation links cut off at the edge: {cut}"


def shoot(page_, name: str) -> None:
    """A full-page screenshot: into docs/img/ when UNWIND_DOCS_SCREENSHOTS=1 (to refresh the README's pictures),
    otherwise among the test's artifacts, so that a test run leaves the work tree as it was."""
    folder = DOCS_IMG if os.environ.get("UNWIND_DOCS_SCREENSHOTS") == "1" else page_.shots.folder
    folder.mkdir(parents=True, exist_ok=True)
    full_page(page_, folder / f"pages-{name}.png")


# --- data, through the real services ------------------------------------------------------------------

def long_tool(world):
    """A copy of crm.update_ticket with a long name that waits for an approver: long words on every page."""
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy

    spec = dict(in_process_policy()["tools"]["crm.update_ticket"], approval="manual")
    tool_upsert(tenant=world.acme, name=LONG_TOOL, spec=spec, actor="test")


def pending_long_request(world):
    from approvals.models import ApprovalRequest
    from tests.helpers import act, open_run
    from tests.test_console_scenarios import new_ticket

    long_tool(world)
    run = open_run(world, goal="Escalate the enterprise account's failing webhook ticket " + "and more " * 20)
    action = act(run, LONG_TOOL, {"ticket_id": new_ticket(), "priority": "urgent", "note": LONG_NOTE})
    assert action.status == "awaiting_approval", action.error_message
    return ApprovalRequest.objects.get(action=action)


def pending_charge(world, amount_cents=92000, currency="EUR"):
    from approvals.models import ApprovalRequest
    from tests.helpers import act, open_run

    run = open_run(world, goal="Buy the enterprise plan")
    charge = act(run, "payments.charge", {"customer": "cus_enterprise", "amount_cents": amount_cents,
                                          "currency": currency})
    assert charge.status == "awaiting_approval"
    return ApprovalRequest.objects.get(action=charge)


def failed_after_pivot_run(world):
    """Hold a flight (compensatable), charge (the pivot), then the receipt email (retriable) is refused for good."""
    from ledger.policy.versions import tool_upsert
    from sandbox.faults import faults_clear
    from tests.conftest import in_process_policy
    from tests.helpers import acme, act, fault, open_run
    from tests.test_console_scenarios import auto_approve_charges

    auto_approve_charges(world)
    run = open_run(world, goal="Book Carol's Lisbon trip")
    flight = act(run, "travel.book_flight", {"passenger": "Carol", "flight": "TP1351", "date": "2026-12-01"})
    assert flight.status == "succeeded", flight.error_message
    charge = act(run, "payments.charge", {"customer": "cus_carol", "amount_cents": 48200, "currency": "EUR"})
    assert charge.status == "succeeded", charge.error_message
    tool_upsert(tenant=world.acme, name="payments.charge", spec=in_process_policy()["tools"]["payments.charge"],
                actor="test")  # charges wait for an approver again
    fault("email.send", "status", status=400, times=1)
    act(run, "email.send", {"to": "carol@example.com", "subject": "Your trip", "body": "Booked."})
    faults_clear(tenant=acme())
    run.refresh_from_db()
    assert run.status == "needs_attention" and run.attention_reason == "step_failed", run.attention_detail
    return run


def four_step_run(world):
    """Four forward steps, the last fails, three are undone: the run page the saga strip was made for."""
    from sandbox.faults import faults_clear
    from tests.helpers import acme, act, fault, open_run

    run = open_run(world, goal="Onboard Ashu and book his first trip")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    act(run, "travel.book_flight", {"passenger": "Ashu", "flight": "LH1234", "date": "2026-12-02"})
    fault("email.send", "status", status=504, times=0)
    act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    faults_clear(tenant=acme())
    run.refresh_from_db()
    assert run.status == "compensated", run.attention_detail
    return run


# --- phone width ----------------------------------------------------------------------------------------

def test_every_staff_page_fits_a_phone(tools, live_server, phone):
    from recovery.models import RecoveryItem
    from tests.test_console_scenarios import drift_run, open_item

    stuck = open_item(failed_after_pivot_run(tools))
    request = pending_long_request(tools)
    charge_request = pending_charge(tools)
    drift = open_item(drift_run(tools))
    done = four_step_run(tools)
    assert RecoveryItem.objects.filter(status="open").count() == 2
    base = live_server.url

    phone.goto(f"{base}/accounts/login/")
    fits(phone, "login")
    phone.get_by_label("Username").fill("alice")
    phone.get_by_label("Password").fill("pw-alice")
    phone.get_by_role("button", name="Log in").click()
    phone.wait_for_url("**/approvals/")
    sync_api.expect(phone.get_by_role("link", name=LONG_TOOL)).to_be_visible()
    fits(phone, "approvals inbox")
    for approval, name in ((request, "long request"), (charge_request, "charge request")):
        phone.goto(f"{base}/approvals/{approval.pk}/")
        sync_api.expect(phone.get_by_role("button", name="Approve")).to_be_visible()
        fits(phone, f"approval detail ({name})")
    phone.goto(f"{base}/approvals/{charge_request.pk}/")
    # On a phone the decision follows what will happen and its diff instead of waiting below every other panel.
    approve_at = phone.get_by_role("button", name="Approve").bounding_box()["y"]
    assert approve_at < phone.get_by_role("heading", name="Why the agent asks").bounding_box()["y"]
    assert approve_at > phone.get_by_role("heading", name="Before → proposed").bounding_box()["y"]
    assert approve_at > phone.locator("#what-heading").bounding_box()["y"]
    shoot(phone, "approval-phone")
    phone.get_by_role("button", name="Log out").click()

    log_in(phone, base, "oscar", "/console/recovery/")
    sync_api.expect(phone.locator(f'tr[data-item="{drift.pk}"]')).to_be_visible()
    fits(phone, "recovery queue")
    pages = {
        "drift item": f"/console/recovery/{drift.pk}/",
        "step-failed item": f"/console/recovery/{stuck.pk}/",
        "compensate confirmation": f"/console/recovery/{drift.pk}/compensate/",
        "resume confirmation": f"/console/recovery/{stuck.pk}/resume/",
        "close confirmation": f"/console/recovery/{stuck.pk}/close/",
        "runs list": "/console/runs/",
        "four-step run": f"/console/runs/{done.pk}/",
        "stuck run": f"/console/runs/{stuck.run_id}/",
        "metrics": "/console/metrics/",
        "policy": f"/console/policy/?tenant=acme&tool={LONG_TOOL}",
        "policy, all tools": "/console/policy/",
    }
    for what, path in pages.items():
        response = phone.goto(base + path)
        assert response.status == 200, (what, response.status)
        fits(phone, what)
        phone.shots.take(re.sub(r"\W+", "-", what))
        phone.locator("details").evaluate_all("all => all.forEach(d => d.open = true)")  # opened, it still fits
        fits(phone, what + ", every toggle open")

    # The bulk page comes from the queue's form: tick an item, ask to close it.
    phone.goto(f"{base}/console/recovery/")
    phone.get_by_label(f"Select item {stuck.pk}").check()
    phone.get_by_role("button", name="Close selected…").click()
    sync_api.expect(phone.locator("h1")).to_contain_text("Close: 1 item")
    fits(phone, "bulk confirmation")


def test_navigation_shows_every_link_whole_on_a_phone(tools, live_server, phone):
    log_in(phone, live_server.url, "ada", "/console/runs/")
    nav = phone.locator("header.top nav")
    box = nav.bounding_box()
    assert box["width"] <= PHONE["width"]
    for link in nav.locator("a").all():  # none hidden past the edge (it used to scroll sideways, cut off)
        edge = link.bounding_box()
        assert edge["x"] >= 0 and edge["x"] + edge["width"] <= PHONE["width"], link.text_content()
    # The current page is marked for people and for screen readers.
    sync_api.expect(nav.locator('[aria-current="page"]')).to_have_text("Runs")
    header = phone.locator("header.top").bounding_box()
    assert header["height"] < 130, f"the header takes {header['height']} px"


# --- the saga strip -------------------------------------------------------------------------------------

def strip_boxes(page_):
    return page_.locator(".saga-step").evaluate_all("""steps => steps.map(step => ({
        seq: Number(step.dataset.seq),
        role: step.closest('.saga-group').dataset.role,
        forward: step.querySelector('.saga-box.fwd').className,
        comp: step.querySelector('.saga-box.comp') && step.querySelector('.saga-box.comp').className,
        words: step.querySelector('.saga-box.fwd .words').textContent.trim(),
        marker: step.querySelector('[data-marker]') && step.querySelector('[data-marker]').textContent.trim(),
    }))""")


def test_saga_strip_on_a_run_failed_after_its_pivot(tools, live_server, page):
    run = failed_after_pivot_run(tools)
    log_in(page, live_server.url, "oscar", f"/console/runs/{run.pk}/")
    boxes = strip_boxes(page)
    assert [b["seq"] for b in boxes] == [1, 2, 3]
    assert [b["role"] for b in boxes] == ["compensatable", "pivot", "retriable"]
    assert ["s-succeeded" in b["forward"] for b in boxes] == [True, True, False]
    assert "s-failed" in boxes[2]["forward"] and boxes[2]["words"] == "failed"  # words, not colour alone
    assert boxes[2]["marker"] == "◆ stopped here" and not boxes[0]["marker"] and not boxes[1]["marker"]
    # The flight and the charge can still be undone (a dashed "ready" box); the retriable email never is.
    assert "ghost" in boxes[0]["comp"] and "ghost" in boxes[1]["comp"]
    assert boxes[2]["comp"] is None
    step3 = page.locator(".saga-step[data-seq='3']")
    sync_api.expect(step3.locator(".saga-box.comp")).to_have_count(0)
    # No compensation in the retriable step's card either.
    card = page.locator(f"#action-{run.actions.get(seq=3).pk}")
    sync_api.expect(card).to_have_attribute("open", "")  # the card of the step where the run stopped is open
    sync_api.expect(card.locator("dt", has_text="Compensation")).to_have_count(0)
    # The legend names every colour in words.
    legend = page.locator(".saga-legend")
    for words in ("succeeded", "failed", "compensated", "compensation failed", "where the run stopped or waits"):
        sync_api.expect(legend).to_contain_text(words)
    # The audit events wait behind a toggle.
    audit = page.locator("details#audit-events")
    sync_api.expect(audit).not_to_have_attribute("open", "")
    sync_api.expect(audit.locator("li").first).to_be_hidden()
    audit.locator("summary").click()
    sync_api.expect(audit.locator("li", has_text="run.opened")).to_be_visible()


def test_saga_strip_draws_compensations_beneath_and_the_page_stays_short(tools, live_server, page):
    run = four_step_run(tools)
    log_in(page, live_server.url, "oscar", f"/console/runs/{run.pk}/")
    boxes = strip_boxes(page)
    assert [b["seq"] for b in boxes] == [1, 2, 3, 4]
    assert [b["role"] for b in boxes] == ["compensatable"] * 3 + ["retriable"]
    for box in boxes[:3]:
        assert "s-compensated" in box["forward"] and "s-succeeded" in box["comp"], box
    assert "s-failed" in boxes[3]["forward"] and boxes[3]["comp"] is None
    assert boxes[3]["marker"] == "◆ stopped here"
    # The compensations ran newest first: their own sequence numbers fall from left to right.
    comp_seqs = page.locator(".saga-box.comp .seq").all_inner_texts()
    assert [int(n) for n in comp_seqs] == sorted((int(n) for n in comp_seqs), reverse=True)
    shoot(page, "run-saga-strip")
    height = page.evaluate("document.documentElement.scrollHeight")
    # Measured on main before the saga strip, this very run's page was 5,580 px tall at 1280 px wide (the demo's
    # four-step run: 4,080 px); it must now take at most half of that.
    print(f"\nfour-step run page: {height} px tall at 1280 px wide (5,580 px before the saga strip)")
    assert height <= 5580 // 2, f"the four-step run page is {height} px tall"
    shoot(page, "run-saga-strip")


# --- drift side by side ---------------------------------------------------------------------------------

def test_drift_is_compared_side_by_side_with_the_choices(tools, live_server, page):
    from tests.test_console_scenarios import drift_run, open_item

    run = drift_run(tools)
    item = open_item(run)
    compensation = run.actions.get(kind="compensation")
    log_in(page, live_server.url, "oscar", f"/console/recovery/{item.pk}/")
    table = page.locator("#drift table.drift-compare")
    priority = table.locator("tr[data-field='priority']")
    sync_api.expect(priority.locator("td")).to_have_text([re.compile("^normal"), re.compile("^high"),
                                                          re.compile("^urgent")])
    sync_api.expect(priority).to_have_class(re.compile("drifted"))
    sync_api.expect(priority.locator("td.changed-since")).to_contain_text("changed since")
    status = table.locator("tr[data-field='status']")
    sync_api.expect(status).not_to_have_class(re.compile("drifted"))
    # The choices sit beside the table: compensate or close; resuming a run its agent cancelled would be refused,
    # so it is not offered, and the panel says why.
    choices = page.locator("#drift .drift-choices")
    for op in ("compensate", "close"):
        sync_api.expect(choices.locator(f"[data-op='{op}']")).to_be_visible()
    sync_api.expect(choices.locator("[data-op='resume']")).to_have_count(0)
    sync_api.expect(choices.locator("#no-resume")).to_contain_text("was cancelled; compensate or close it instead")
    assert choices.bounding_box()["x"] > table.bounding_box()["x"] + 200, "the choices should be beside the table"
    # What failed is the compensation's attempt, not the forward step's (which succeeded).
    failure = page.locator("#failure")
    sync_api.expect(failure).to_contain_text("the compensation of step 1")
    sync_api.expect(page.locator("#failing-attempts")).to_have_attribute("data-action", str(compensation.pk))
    sync_api.expect(page.locator("#failing-attempts tbody tr").first).to_contain_text("drift")
    shoot(page, "recovery-item-drift")

    # Choosing "compensate" from beside the table forces the restore, as the item page always did.
    choices.locator("[data-op='compensate']").click()
    panel = page.locator("#confirm-compensate")
    sync_api.expect(panel).to_contain_text("overwrites their change")
    panel.get_by_label("Reason").fill("Dana agreed")
    panel.get_by_role("button", name="Confirm: undo anyway, overwriting their change").click()
    sync_api.expect(page.locator("#run-status")).to_have_text("compensated")


# --- values as facts ------------------------------------------------------------------------------------

def test_money_reads_as_money_and_times_never_say_zero_minutes(tools, live_server, page):
    request = pending_charge(tools, amount_cents=92000, currency="EUR")
    in_chf = pending_charge(tools, amount_cents=125050, currency="CHF")
    log_in(page, live_server.url, "alice", f"/approvals/{request.pk}/")
    amount = page.locator("dd[data-arg='amount_cents'] .value")
    sync_api.expect(amount).to_have_text("€920.00")
    sync_api.expect(amount).to_have_attribute("title", "92000")
    assert amount.evaluate("e => e.tagName") == "SPAN"  # text, not an input-like box
    sync_api.expect(page.locator("#what-heading")).to_have_text("What will happen")
    asked = page.locator(".muted time").first
    sync_api.expect(asked).to_have_text("just now")
    sync_api.expect(asked).to_have_attribute("title", re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$"))

    page.get_by_role("button", name="Approve").click()
    sync_api.expect(page.locator("#decision")).to_contain_text("Approved just now")
    assert "0 minutes" not in page.locator("body").inner_text()
    page.reload()
    sync_api.expect(page.locator("#what-heading")).to_have_text("What happened")

    page.goto(f"{live_server.url}/approvals/{in_chf.pk}/")
    sync_api.expect(page.locator("dd[data-arg='amount_cents'] .value")).to_have_text("1,250.50 CHF")


# --- where people land ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("username", "lands_on"), [
    ("alice", "/approvals/"), ("oscar", "/console/recovery/"), ("ada", "/console/recovery/"),
    ("victor", "/console/recovery/"),
])
def test_people_land_where_their_work_is(tools, live_server, page, username, lands_on):
    page.goto(f"{live_server.url}/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(f"pw-{username}")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"**{lands_on}")
    assert page.url == live_server.url + lands_on
