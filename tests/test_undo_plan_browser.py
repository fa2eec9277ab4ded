"""The undo a person completes for a step found done (issue 32), in a real browser: the item page shows what the
lookup found and the form prefilled with what could be resolved; a JSON error is shown on the page, and the completed
undo, submitted, sends the correction with the person's subject and settles the run."""
import json

import pytest

from ledger.models import Run
from sandbox.selectors import world_state
from tests.helpers import acme
from tests.test_browser import CHROMIUM, browser, log_in, page, sync_api  # noqa: F401
from tests.test_undo_plan_http import SUBJECT, completed_args, incomplete  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")]


def test_the_item_page_shows_the_record_and_the_completed_undo_settles_the_run(incomplete, page):  # noqa: F811
    item_path = f"/console/recovery/{incomplete.item.pk}/"
    log_in(page, incomplete.base, "oscar", item_path)
    message = world_state(tenant=acme())["messages"][0]
    sync_api.expect(page.locator("#read-back-evidence")).to_contain_text(message["message_id"])
    sync_api.expect(page.locator("#undo-missing")).to_contain_text("$result.thread")
    box = page.get_by_label("The undo's arguments (JSON)")
    assert json.loads(box.input_value()) == {**completed_args(incomplete), "subject": None}
    page.shots.take("undo-plan")

    box.fill('{"to": ')  # a slip of the keyboard: refused on the page, nothing sent
    page.get_by_role("button", name="Record this undo").click()
    sync_api.expect(page.locator("#undo-args-error")).to_contain_text("not valid JSON")
    assert len(world_state(tenant=acme())["messages"]) == 1

    page.get_by_label("The undo's arguments (JSON)").fill(json.dumps(completed_args(incomplete)))
    page.get_by_label("Undo the step now with these arguments (compensate the run)").check()
    page.get_by_label("Why (optional)").fill("the outbox shows the thread")
    page.get_by_role("button", name="Record this undo").click()
    page.wait_for_url(f"**{item_path}")
    sync_api.expect(page.get_by_text("Undo completed and recorded as yours")).to_be_visible()
    sync_api.expect(page.locator("#run-status")).to_contain_text("compensated")
    page.shots.take("undo-plan-done")
    assert Run.objects.get(pk=incomplete.run.pk).status == "compensated"
    assert [m["subject"] for m in world_state(tenant=acme())["messages"]] == ["Your account", SUBJECT]
