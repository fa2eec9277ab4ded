"""Runs list, one run's timeline, and the metrics page."""
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.models import Run
from tests.helpers import act, open_run
from tests.test_console_queue import client_for
from tests.test_console_scenarios import (
    compensation_failed_run, drift_run, email_correction_run, onboarding_compensated, open_item,
)

RUNS = "/console/runs/"


def run_ids(response) -> list[int]:
    return [int(pk) for pk in re.findall(r'data-run="(\d+)"', response.content.decode())]


def test_runs_list_per_persona(tools):
    done = onboarding_compensated(tools)
    stuck = drift_run(tools)
    for persona in ("oscar", "victor", "alice"):
        response = client_for(getattr(tools, persona)).get(RUNS)
        assert response.status_code == 200
        assert sorted(run_ids(response)) == sorted([done.pk, stuck.pk])
    assert run_ids(client_for(tools.mallory).get(RUNS)) == []


def test_runs_filter_by_status(tools):
    done = onboarding_compensated(tools)
    stuck = drift_run(tools)
    oscar = client_for(tools.oscar)
    assert run_ids(oscar.get(RUNS, {"status": "compensated"})) == [done.pk]
    response = oscar.get(RUNS, {"status": "needs_attention"})
    assert run_ids(response) == [stuck.pk]
    assert f"item #{open_item(stuck).pk}".encode() in response.content
    assert run_ids(oscar.get(RUNS, {"q": "Onboard Ashu"})) == [done.pk]


def test_runs_htmx_partial(tools):
    onboarding_compensated(tools)
    response = client_for(tools.oscar).get(RUNS, HTTP_HX_REQUEST="true")
    assert response.content.decode().lstrip().startswith('<div id="runs"')


def test_runs_list_queries_do_not_grow_with_runs(tools, django_assert_num_queries):
    for _ in range(5):
        compensation_failed_run(tools)
    oscar = client_for(tools.oscar)
    oscar.get(RUNS)
    with CaptureQueriesContext(connection) as five_runs:
        assert len(run_ids(oscar.get(RUNS))) == 5
    for _ in range(35):
        compensation_failed_run(tools)
    with django_assert_num_queries(len(five_runs)):
        response = oscar.get(RUNS)
    assert len(run_ids(response)) == 30
    with django_assert_num_queries(len(five_runs)):
        response = oscar.get(RUNS, {"page": 2, "status": "needs_attention"})
    assert len(run_ids(response)) == 10


def test_run_timeline_shows_everything_in_order(tools):
    run = onboarding_compensated(tools)
    response = client_for(tools.victor).get(f"/console/runs/{run.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    forward = run.actions.get(seq=1)
    assert forward.idempotency_key in html
    assert "goal: Onboard Ashu" in html and "confidence: 0.9" in html  # intent
    assert "undone by step" in html and "undoes step 1" in html  # compensations paired with what they undo
    assert "failed_transient" in html and "http_504" in html  # attempts with their errors
    assert "ms</td>" in html  # latency
    assert "Checkpoint <code>unwind_started</code>" in html and "Checkpoint <code>compensated</code>" in html
    # The audit events sit behind a toggle after the timeline, in their chain's order.
    audit = html[html.index('<details class="audit"'):]
    assert "run.opened" in audit and "run.compensated" in audit
    assert audit.index("run.opened") < audit.index("run.compensated")
    assert "run.opened" not in html[:html.index('<details class="audit"')]
    # The timeline is sorted by time: the run's first step first, the final checkpoint last.
    timeline = html[html.index('<ol class="timeline">'):html.index('<details class="audit"')]
    assert timeline.index("step 1") < timeline.index("Checkpoint <code>unwind_started</code>") \
        < timeline.index("Checkpoint <code>compensated</code>")
    # The correction trail is on the page; a viewer sees which links share it, and cannot make one.
    assert "Correction trail" in html and "Share links that open this trail" in html
    assert "Make a share link" not in html and "/console/trail/" not in html


def test_run_timeline_shows_snapshot_diff(tools):
    run = drift_run(tools)
    html = client_for(tools.oscar).get(f"/console/runs/{run.pk}/").content.decode()
    assert '<td class="diff-old">normal</td><td class="diff-new">high</td>' in html


def test_run_timeline_shows_approvals_and_decisions(tools, django_capture_on_commit_callbacks):
    run = open_run(tools, goal="Buy a plan")
    charge = act(run, "payments.charge", {"customer": "cus_9", "amount_cents": 1200, "currency": "EUR"})
    assert charge.status == "awaiting_approval"
    request = ApprovalRequest.objects.get(action=charge)
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=request, user=tools.alice, approve=True, reason="known customer")
    html = client_for(tools.oscar).get(f"/console/runs/{run.pk}/").content.decode()
    assert f"Approval {request.pk}" in html
    assert "alice approved" in html and "known customer" in html


def test_run_page_of_another_tenant_is_not_found(tools):
    run = onboarding_compensated(tools)
    assert client_for(tools.mallory).get(f"/console/runs/{run.pk}/").status_code == 404


def test_run_page_requires_login(client, tools):
    run = onboarding_compensated(tools)
    assert client.get(f"/console/runs/{run.pk}/").status_code == 302


# --- metrics ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", ["1h", "24h", "7d", "30d"])
def test_metrics_page_renders_with_data(tools, window):
    onboarding_compensated(tools)
    email_correction_run(tools)
    drift_run(tools)
    compensation_failed_run(tools)
    response = client_for(tools.victor).get("/console/metrics/", {"window": window})
    html = response.content.decode()
    assert response.status_code == 200
    assert html.count('<figure class="chart">') == 7
    # No approvals and no holds yet: those two charts say so instead.
    assert html.count("<svg") == 5 and "<rect" in html
    # Nothing loaded from a CDN (a form's random CSRF token may spell "cdn": only addresses are looked at).
    assert not re.search(r'(?:src|href)="[^"]*cdn', html, re.IGNORECASE)
    # 4 runs, all of which compensated something.
    assert re.search(r'id="m-frequency">100%', html)
    assert "4 of 4 runs unwound" in html
    # Compensations: 2 + 1 succeeded; the drift and the refused delete failed.
    assert "3 succeeded, 2 failed or refused" in html
    assert re.search(r'id="m-success">60%', html)
    assert "4 unwinds, 2 ended needing a person" in html
    assert "hr.create_user" in html and "email.send" in html


def test_metrics_numbers(tools):
    from recovery.metrics import console_metrics, percentile

    onboarding_compensated(tools)
    drift_run(tools)
    data = console_metrics(tenant_ids=[tools.acme.pk], window="1h")
    assert (data["runs"], data["unwound_runs"]) == (2, 2)
    assert data["compensations"] == {"succeeded": 2, "failed": 1, "pending": 0}
    assert data["unwind_latency"]["n"] == 2 and data["unwind_latency"]["stuck"] == 1
    assert data["unwind_latency"]["p95"] >= data["unwind_latency"]["p50"] > 0
    assert [b["n"] for b in data["open_items_by_age"]] == [1, 0, 0, 0]
    assert data["actions_per_tool"]["hr.create_user"] == {"compensated": 1}
    assert percentile([5, 1, 3, 2, 4], 50) == 3 and percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 95) == 10
    assert percentile([], 50) is None
    assert console_metrics(tenant_ids=[tools.globex.pk], window="1h")["runs"] == 0


def test_metrics_approval_latency(tools, django_capture_on_commit_callbacks):
    from recovery.metrics import console_metrics

    run = open_run(tools, goal="Buy")
    charge = act(run, "payments.charge", {"customer": "cus_1", "amount_cents": 500, "currency": "EUR"})
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=tools.alice, approve=True)
    data = console_metrics(tenant_ids=[tools.acme.pk], window="24h")
    assert data["approval_latency"]["n"] == 1 and data["approval_latency"]["p50"] >= 0


def test_metrics_of_another_tenant_show_nothing(tools):
    onboarding_compensated(tools)
    response = client_for(tools.oscar).get("/console/metrics/", {"tenant": tools.globex.pk})
    assert "0 of 0 runs unwound" in response.content.decode()
    assert Run.objects.count() == 1
