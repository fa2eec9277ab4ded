"""The recovery queue page: who sees what, filters, counts, htmx refresh, constant queries, bulk decisions."""
import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from ledger.models import Run
from recovery.models import RecoveryItem
from tests.test_console_scenarios import compensation_failed_run, drift_run, open_item

QUEUE = "/console/recovery/"


def client_for(user, *, csrf=False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def csrf_token(client: Client, url: str) -> str:
    page = client.get(url)
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    assert match, f"no CSRF token on {url}"
    return match.group(1)


def item_ids(response) -> list[int]:
    return [int(pk) for pk in re.findall(r'data-item="(\d+)"', response.content.decode())]


@pytest.fixture
def queue_world(tools):
    tools.drift = drift_run(tools)
    tools.failed = compensation_failed_run(tools)
    return tools


def test_it_requires_login(client):
    response = client.get(QUEUE)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_operator_sees_items_with_bulk_controls(queue_world):
    response = client_for(queue_world.oscar).get(QUEUE)
    assert response.status_code == 200
    assert sorted(item_ids(response)) == sorted([open_item(queue_world.drift).pk, open_item(queue_world.failed).pk])
    assert b"Compensate selected" in response.content
    assert b'name="items"' in response.content


def test_viewer_sees_items_but_no_controls(queue_world):
    response = client_for(queue_world.victor).get(QUEUE)
    assert response.status_code == 200
    assert len(item_ids(response)) == 2
    assert b"Compensate selected" not in response.content
    assert b'name="items"' not in response.content


def test_other_tenant_sees_nothing(queue_world):
    response = client_for(queue_world.mallory).get(QUEUE)
    assert response.status_code == 200
    assert item_ids(response) == []


def test_counts_by_reason(queue_world):
    response = client_for(queue_world.oscar).get(QUEUE)
    html = response.content.decode()
    assert re.search(r'data-reason="drift">[^<]*<strong>1</strong>', html)
    assert re.search(r'data-reason="compensation_failed">[^<]*<strong>1</strong>', html)
    assert "all reasons · 2" in html


def test_reason_filter_keeps_counts_of_all_reasons(queue_world):
    response = client_for(queue_world.oscar).get(QUEUE, {"reason": "drift"})
    assert item_ids(response) == [open_item(queue_world.drift).pk]
    assert 'data-reason="compensation_failed"' in response.content.decode()


@pytest.mark.parametrize("params, expected", [
    ({"tool": "crm.update_ticket"}, ["drift"]),
    ({"tool": "hr.create_user"}, ["failed"]),
    ({"risk": "medium"}, ["drift"]),
    ({"risk": "low"}, ["failed"]),
    ({"q": "Escalate"}, ["drift"]),
    ({"age": "1h"}, ["drift", "failed"]),
    ({"age": "older"}, []),
    ({"status": "resolved"}, []),
])
def test_filters(queue_world, params, expected):
    response = client_for(queue_world.oscar).get(QUEUE, params)
    want = sorted(open_item(getattr(queue_world, name)).pk for name in expected)
    assert sorted(item_ids(response)) == want


def test_tenant_filter(queue_world):
    oscar = client_for(queue_world.oscar)
    assert len(item_ids(oscar.get(QUEUE, {"tenant": queue_world.acme.pk}))) == 2
    assert item_ids(oscar.get(QUEUE, {"tenant": queue_world.globex.pk})) == []


def test_sorting_oldest_first(queue_world):
    ids = item_ids(client_for(queue_world.oscar).get(QUEUE, {"sort": "oldest"}))
    assert ids == sorted(ids)
    newest = item_ids(client_for(queue_world.oscar).get(QUEUE, {"sort": "newest"}))
    assert newest == sorted(newest, reverse=True)


def test_sorting_by_risk_puts_highest_first(queue_world):
    ids = item_ids(client_for(queue_world.oscar).get(QUEUE, {"sort": "risk"}))
    assert ids == [open_item(queue_world.drift).pk, open_item(queue_world.failed).pk]


def test_htmx_refresh_returns_the_partial(queue_world):
    response = client_for(queue_world.oscar).get(QUEUE, {"reason": "drift"}, HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200
    assert html.lstrip().startswith('<div id="queue"')
    assert "<html" not in html
    assert 'hx-trigger="every 30s' in html


def test_pagination(tools):
    for _ in range(27):
        compensation_failed_run(tools)
    oscar = client_for(tools.oscar)
    first, second = oscar.get(QUEUE), oscar.get(QUEUE, {"page": 2})
    assert len(item_ids(first)) == 25 and len(item_ids(second)) == 2
    assert not set(item_ids(first)) & set(item_ids(second))
    assert b"page 1 of 2" in first.content


def test_queue_queries_do_not_grow_with_items(tools, django_assert_num_queries):
    for n in range(5):
        (drift_run if n % 2 else compensation_failed_run)(tools)
    oscar = client_for(tools.oscar)
    oscar.get(QUEUE)
    with CaptureQueriesContext(connection) as five_items:
        assert len(item_ids(oscar.get(QUEUE))) == 5
    for n in range(35):
        (drift_run if n % 2 else compensation_failed_run)(tools)
    assert RecoveryItem.objects.filter(status="open").count() == 40
    with django_assert_num_queries(len(five_items)):
        response = oscar.get(QUEUE)
    assert len(item_ids(response)) == 25
    with django_assert_num_queries(len(five_items)):
        response = oscar.get(QUEUE, {"page": 2, "sort": "risk"})
    assert len(item_ids(response)) == 15


# --- bulk -------------------------------------------------------------------------------------------

def test_bulk_close_asks_for_confirmation_then_closes_each(tools):
    runs = [compensation_failed_run(tools) for _ in range(3)]
    items = [open_item(run).pk for run in runs]
    oscar = client_for(tools.oscar, csrf=True)
    token = csrf_token(oscar, QUEUE)
    confirm = oscar.post("/console/recovery/bulk/", {"items": items, "operation": "close", "csrfmiddlewaretoken": token})
    assert confirm.status_code == 200
    assert b"Confirm: close 3 items" in confirm.content
    assert RecoveryItem.objects.filter(pk__in=items, status="open").count() == 3

    missing_reason = oscar.post("/console/recovery/bulk/", {"items": items, "operation": "close", "confirmed": "on",
                                                             "csrfmiddlewaretoken": token})
    assert missing_reason.status_code == 400
    assert b"Say why" in missing_reason.content

    done = oscar.post("/console/recovery/bulk/", {"items": items, "operation": "close", "confirmed": "on",
                                                   "reason": "deleted the users by hand", "csrfmiddlewaretoken": token})
    assert done.status_code == 200
    assert b"3 of 3 done" in done.content
    for pk in items:
        item = RecoveryItem.objects.get(pk=pk)
        assert (item.status, item.resolution, item.resolved_by) == ("resolved", "closed", "user:oscar")
        assert item.resolution_note == "deleted the users by hand"
    assert set(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)) == {"closed"}


def test_bulk_compensate_reports_each_item_including_the_ones_already_handled(tools):
    runs = [compensation_failed_run(tools) for _ in range(3)]
    items = [open_item(run).pk for run in runs]
    # Someone closes the first one between the selection and the confirmation.
    client_for(tools.oscar).post(f"/console/recovery/{items[0]}/close/", {"reason": "handled on the phone"})
    oscar = client_for(tools.oscar, csrf=True)
    token = csrf_token(oscar, QUEUE)
    done = oscar.post("/console/recovery/bulk/", {"items": items, "operation": "compensate", "confirmed": "on",
                                                   "csrfmiddlewaretoken": token})
    assert done.status_code == 200
    html = done.content.decode()
    assert "2 of 3 done" in html
    assert "refused: this item was already closed by user:oscar" in html
    for run in runs[1:]:
        run.refresh_from_db()
        assert run.status == "compensated"


def test_bulk_refuses_items_of_different_reasons(queue_world):
    items = [open_item(queue_world.drift).pk, open_item(queue_world.failed).pk]
    response = client_for(queue_world.oscar).post("/console/recovery/bulk/", {
        "items": items, "operation": "close", "confirmed": "on", "reason": "all handled"})
    assert response.status_code == 400
    assert b"one reason at a time" in response.content
    assert RecoveryItem.objects.filter(pk__in=items, status="open").count() == 2


def test_bulk_without_items_says_what_is_missing(queue_world):
    response = client_for(queue_world.oscar).post("/console/recovery/bulk/", {"reason": "x", "operation": "close"})
    assert response.status_code == 400
    assert b"Items:" in response.content or b"items" in response.content.lower()


def test_bulk_by_viewer_is_forbidden(queue_world):
    items = [open_item(queue_world.failed).pk]
    response = client_for(queue_world.victor).post("/console/recovery/bulk/", {
        "items": items, "operation": "close", "confirmed": "on", "reason": "nope"})
    assert response.status_code == 403
    assert b"needs the operator role" in response.content
    assert RecoveryItem.objects.get(pk=items[0]).status == "open"


def test_bulk_with_another_tenants_item_is_not_found(queue_world):
    items = [open_item(queue_world.failed).pk]
    response = client_for(queue_world.mallory).post("/console/recovery/bulk/", {
        "items": items, "operation": "close", "confirmed": "on", "reason": "mine now"})
    assert response.status_code == 404
    assert RecoveryItem.objects.get(pk=items[0]).status == "open"


def test_bulk_without_csrf_token_is_refused(queue_world):
    items = [open_item(queue_world.failed).pk]
    response = client_for(queue_world.oscar, csrf=True).post("/console/recovery/bulk/", {
        "items": items, "operation": "close", "confirmed": "on", "reason": "no token"})
    assert response.status_code == 403
    assert RecoveryItem.objects.get(pk=items[0]).status == "open"
