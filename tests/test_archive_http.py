"""Archived runs over HTTP against a live server (docs/archive.md): the API, the console page and the trail link
still answer, to exactly those who could read the run when it was hot; an agent key can neither archive, nor set a
legal hold, nor read another agent's or tenant's archived run."""
import requests
from django.contrib.auth import get_user_model

from ledger.audit.verify import verify_chain
from ledger.models import ArchivedRun, AuditEvent, Run, Tenant
from ledger.tenancy import agent_create
from tests.helpers import live_api as api, live_session as session, open_run

pytest_plugins = ["tests.archive_fixtures"]  # the archived fixture: a live server, two archived runs


def test_the_agent_reads_its_archived_run_by_id(archived):
    answer = api(archived, f"/api/v1/runs/{archived.alpha.pk}", archived.key)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["id"] == archived.alpha.pk and body["status"] == "completed" and body["goal"] == "onboard alpha-secret"
    assert [a["tool"] for a in body["actions"]] == ["hr.create_user", "licenses.provision"]
    assert body["archived"]["segment"] == ArchivedRun.objects.get(pk=archived.alpha.pk).segment.sha256


def test_another_agent_or_tenant_gets_not_found_for_an_archived_run(archived):
    _, second_key = agent_create(tenant=archived.acme, name="second")
    for key in (second_key, archived.other_key):
        answer = api(archived, f"/api/v1/runs/{archived.alpha.pk}", key)
        assert answer.status_code == 404 and "secret" not in answer.text, answer.text
    missing = api(archived, "/api/v1/runs/987654", archived.key)
    assert missing.status_code == 404 and missing.json()["detail"] == api(
        archived, f"/api/v1/runs/{archived.alpha.pk}", second_key).json()["detail"].replace(
        str(archived.alpha.pk), "987654")


def test_the_console_page_of_an_archived_run_says_so(archived):
    page = session(archived, archived.oscar).get(f"{archived.url}/console/runs/{archived.alpha.pk}/", timeout=10)
    assert page.status_code == 200 and "Archived on" in page.text and "onboard alpha-secret" in page.text
    assert "beta-secret" not in page.text and "hr.create_user" in page.text
    outsider = session(archived, archived.mallory).get(f"{archived.url}/console/runs/{archived.alpha.pk}/", timeout=10)
    assert outsider.status_code == 404 and "secret" not in outsider.text


def test_a_trail_link_of_an_archived_run_shows_that_run_only(archived):
    page = requests.get(f"{archived.url}/console/trail/{archived.link_alpha}/", timeout=10)
    assert page.status_code == 200 and "Archived on" in page.text
    assert f"reference {archived.alpha.pk}" in page.text and "beta-secret" not in page.text
    other = requests.get(f"{archived.url}/console/trail/{archived.link_beta}/", timeout=10)
    assert f"reference {archived.beta.pk}" in other.text and "alpha-secret" not in other.text
    forged = requests.get(f"{archived.url}/console/trail/{archived.link_alpha[:-2]}xx/", timeout=10)
    assert forged.status_code == 404 and "secret" not in forged.text




def test_an_agent_key_cannot_archive_hold_or_reach_the_admin(archived):
    before = AuditEvent.objects.filter(tenant=archived.acme).count()
    young = open_run(archived, goal="young")
    for method, path, body in (
            ("post", "/admin/ledger/run/", {"action": "legal_hold_on", "_selected_action": [young.pk],
                                            "why": "x", "confirm": "1"}),
            ("post", "/admin/ledger/tenant/", {"action": "legal_hold_off", "_selected_action": [archived.acme.pk],
                                               "why": "x", "confirm": "1"}),
            ("patch", f"/api/v1/runs/{young.pk}", {"legal_hold": True}),
    ):
        answer = api(archived, path, archived.key, method, data=body, allow_redirects=False)
        assert answer.status_code in (302, 403, 405), (path, answer.status_code)
    opened = api(archived, "/api/v1/runs", archived.key, "post", json={"goal": "g", "legal_hold": True})
    assert opened.status_code == 400 and "legal_hold" in opened.text
    assert not Run.objects.filter(legal_hold=True).exists() and not Tenant.objects.filter(legal_hold=True).exists()
    assert not AuditEvent.objects.filter(kind="legal_hold.set").exists()
    assert AuditEvent.objects.filter(tenant=archived.acme).count() > before  # only the young run's own events


def test_a_superuser_sets_a_legal_hold_with_a_reason_in_the_admin(archived):
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw-root")
    browser = session(archived, root)
    young = open_run(archived, goal="young")
    page = browser.get(f"{archived.url}/admin/ledger/run/", timeout=10)
    token = browser.cookies.get("csrftoken") or page.cookies.get("csrftoken")
    headers = {"X-CSRFToken": token, "Referer": f"{archived.url}/admin/ledger/run/"}
    asked = browser.post(f"{archived.url}/admin/ledger/run/", data={
        "action": "legal_hold_on", "_selected_action": [young.pk], "csrfmiddlewaretoken": token}, headers=headers,
        timeout=10)
    assert asked.status_code == 200 and "Why (recorded in the tenant" in asked.text
    assert not Run.objects.get(pk=young.pk).legal_hold
    done = browser.post(f"{archived.url}/admin/ledger/run/", data={
        "action": "legal_hold_on", "_selected_action": [young.pk], "why": "subpoena 42", "confirm": "1",
        "csrfmiddlewaretoken": token}, headers=headers, timeout=10)
    assert done.status_code == 200 and "Legal hold set on 1 run(s)" in done.text
    assert Run.objects.get(pk=young.pk).legal_hold
    event = AuditEvent.objects.get(kind="legal_hold.set", run_ref=young.pk)
    assert event.actor == "user:root" and event.data["why"] == "subpoena 42"
    staff = get_user_model().objects.create_user("staffer", "s@example.com", "pw", is_staff=True, is_superuser=False)
    from django.contrib.auth.models import Permission

    staff.user_permissions.set(Permission.objects.filter(content_type__app_label="ledger"))
    refused = session(archived, staff).post(f"{archived.url}/admin/ledger/run/", data={
        "action": "legal_hold_off", "_selected_action": [young.pk], "why": "x", "confirm": "1"}, timeout=10)
    assert refused.status_code in (403, 200) and Run.objects.get(pk=young.pk).legal_hold
    assert verify_chain(archived.acme.pk).ok
