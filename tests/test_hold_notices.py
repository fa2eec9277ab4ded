"""Issue 39, finding 6: a held step's notice is no mail relay.

An agent names whom its run acts for (`on_behalf_of`) and can name anyone; a step whose policy lets the customer stop
it used to mail that address the trail's link, with the agent's own words in it. Now the notice goes only to an
address the tenant's admins listed (recovery/customers.py), at most UNWIND_HOLD_NOTICES_PER_AGENT per agent within
UNWIND_HOLD_NOTICE_WINDOW (counted in the database), in the tenant's words only; and the agent is told when the
customer was not notified, and why. Each case is performed over HTTP against a live server (two server processes for
the bound), with a real SMTP server on loopback.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.core.management import call_command

from approvals.models import Notification
from approvals.services import notifications_send
from ledger.models import Action, AuditEvent, Run
from recovery.customers import known_customer_add
from recovery.models import HoldNotice, KnownCustomerAddress, TrailShareLink
from tests.test_holds import calls, hold
from tests.test_insider_audit import sql, verify_fails
from tests.test_notifications import smtp  # noqa: F401 (the fixture: a real SMTP server on loopback)
from tests.test_tracing import Processes, live

pytest_plugins = ["tests.api_fixtures"]

HELD = {"for": "30s", "customer_can_stop": True}
FLIGHT = {"passenger": "Carol", "flight": "TP101", "date": "2026-12-01"}
# What an agent would like a stranger to read in a mail sent in the tenant's name.
LURE = "Refund due: log in at evil.example"
CHARGE = {"customer": LURE, "amount_cents": 4200}


def agent_session(key: str) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    return session


def open_run(agent: requests.Session, base: str, on_behalf_of: str) -> int:
    opened = agent.post(f"{base}/api/v1/runs", json={"goal": "Trip to Lisbon", "on_behalf_of": on_behalf_of},
                        timeout=30)
    assert opened.status_code == 201, opened.text
    return opened.json()["id"]


def propose(agent: requests.Session, base: str, run_id: int, tool: str, args: dict) -> dict:
    answered = agent.post(f"{base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args}, timeout=30)
    assert answered.status_code in (200, 201, 202), answered.text
    return answered.json()


def events(agent: requests.Session, base: str, run_id: int) -> list[dict]:
    answered = agent.get(f"{base}/api/v1/runs/{run_id}/events", params={"limit": 100}, timeout=30)
    assert answered.status_code == 200, answered.text
    body = answered.json()
    return body["results"] if isinstance(body, dict) else body


@pytest.fixture
def held(api, live_server, settings):
    """acme's card charge held for 30 s, stoppable by the customer; the agent's key over HTTP to a live server."""
    settings.UNWIND_BASE_URL = live_server.url
    hold(api.world, "payments.charge", HELD, approval="auto")
    world = api.world
    world.base = live_server.url
    world.http = agent_session(world.key)
    return world


def test_an_agent_naming_30_outside_addresses_mails_none_of_them_and_the_runs_unwind(held, smtp):  # noqa: F811
    outsiders = [f"victim{n}@outside.example" for n in range(27)] + [
        "carol@ｅxample.com",  # a full-width e: another domain than the one the tenant knows
        "carol@example.com.outside.example", "carol+x@example.com"]  # the list holds carol@example.com, not these
    known_customer_add(tenant=held.acme, address="carol@example.com", user=held.ada)
    runs = []
    for address in outsiders:
        run_id = open_run(held.http, held.base, address)
        flight = propose(held.http, held.base, run_id, "travel.book_flight", FLIGHT)
        charge = propose(held.http, held.base, run_id, "payments.charge", CHARGE)
        assert flight["status"] == "succeeded" and charge["status"] == "held", charge
        cancelled = held.http.post(f"{held.base}/api/v1/runs/{run_id}/cancel", json={"reason": "at once"}, timeout=30)
        assert cancelled.status_code == 200, cancelled.text
        runs.append((run_id, address, charge["id"]))

    # Nothing reached the mailbox, nor the outbox; no share link was made for anyone.
    assert notifications_send() == 0 and smtp.messages == []
    assert not Notification.objects.filter(kind="hold_notice").exists()
    assert not TrailShareLink.objects.exists()
    # The runs went on by the law: each held pivot skipped, the flight before it undone, the card never charged.
    for run_id, address, charge_id in runs:
        assert Run.objects.get(pk=run_id).status == "compensated"
        assert Action.objects.get(pk=charge_id).status == "skipped"
    assert calls("payments.charge") == 0
    # The agent is told, in its run's events, that the customer was not notified and why.
    run_id, address, charge_id = runs[0]
    told = [e for e in events(held.http, held.base, run_id) if e["kind"] == "hold.customer_not_notified"]
    assert len(told) == 1 and told[0]["action"] == charge_id
    assert told[0]["data"]["why"] == (f"The customer was not notified: {address} is not among the tenant's known "
                                      "customer addresses (an admin adds an address or its domain in the admin, "
                                      "Known customer addresses; an operator can send the trail's link from the "
                                      "run's page).")
    lookalike = HoldNotice.objects.get(action_id=runs[27][2])
    assert not lookalike.sent and "is not a plain ASCII email address" in lookalike.why
    assert HoldNotice.objects.filter(sent=False).count() == 30 and not HoldNotice.objects.filter(sent=True).exists()
    call_command("verify_audit")


def test_a_known_customer_gets_the_notice_in_the_tenants_words_only(held, smtp):  # noqa: F811
    known_customer_add(tenant=held.acme, address="carol@example.com", note="Carol Ferreira", user=held.ada)
    run_id = open_run(held.http, held.base, "Carol@EXAMPLE.com")  # the list's spelling is the one mailed
    charge = propose(held.http, held.base, run_id, "payments.charge", {**CHARGE, "currency": "EUR"})
    assert charge["status"] == "held"
    assert notifications_send() == 1
    [mail] = smtp.messages
    assert mail["To"] == "carol@example.com" and mail["Subject"] == f"Acme is about to act on your request " \
                                                                     f"(reference {run_id})"
    text, html = mail.get_body(("plain",)).get_content(), mail.get_body(("html",)).get_content()
    for body in (text, html):
        assert "We are about to charge a customer" in body and "€42.00" in body
        assert "evil.example" not in body and "Refund" not in body  # nothing the agent wrote
    link = re.search(r"(http://\S+/console/trail/[A-Za-z0-9_-]{43}/)", text).group(1)
    assert "Stop it" in requests.get(link, timeout=30).text
    told = [e for e in events(held.http, held.base, run_id) if e["kind"] == "hold.customer_notified"]
    assert len(told) == 1 and told[0]["data"]["to"] == "carol@example.com"
    assert calls("payments.charge") == 0


def test_a_whole_domain_on_the_list_is_mailed_as_the_run_names_it(held, smtp):  # noqa: F811
    known_customer_add(tenant=held.acme, address="@Example.com", user=held.ada)
    assert KnownCustomerAddress.objects.get().address == "@example.com"
    run_id = open_run(held.http, held.base, "dana.s@example.com")
    propose(held.http, held.base, run_id, "payments.charge", CHARGE)
    sub = open_run(held.http, held.base, "dana@mail.example.com")  # a subdomain is not the domain
    propose(held.http, held.base, sub, "payments.charge", CHARGE)
    assert notifications_send() == 1 and [m["To"] for m in smtp.messages] == ["dana.s@example.com"]


def test_mcp_says_in_the_held_answer_whether_the_customer_was_notified(held, live_server):
    headers = {"Authorization": f"Bearer {held.key}", "Accept": "application/json, text/event-stream"}
    url = f"{live_server.url}/mcp"

    def rpc(request_id, method, params, session_id=None):
        more = {"Mcp-Session-Id": session_id, "Mcp-Protocol-Version": "2025-06-18"} if session_id else {}
        answered = requests.post(url, headers={**headers, **more}, timeout=30, json={
            "jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        assert answered.status_code == 200, answered.text
        return answered

    opened = rpc(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                   "clientInfo": {"name": "t", "version": "1"}})
    session_id = opened.headers["Mcp-Session-Id"]
    rpc(2, "tools/call", {"name": "unwind_begin", "arguments": {"goal": "Trip", "on_behalf_of": "x@outside.example"}},
        session_id)
    answer = rpc(3, "tools/call", {"name": "payments.charge", "arguments": CHARGE}, session_id).json()["result"]
    payload = answer["structuredContent"]
    assert payload["status"] == "held" and payload["customer_notice"]["notified"] is False
    assert "x@outside.example is not among the tenant's known customer addresses" in payload["customer_notice"]["why"]
    assert payload["customer_notice"]["why"] in payload["message"]
    assert json.loads(answer["content"][0]["text"]) == payload
    assert not Notification.objects.filter(kind="hold_notice").exists()


@live[0]
@live[1]
def test_the_bound_per_agent_holds_across_two_server_processes_on_one_database(api, smtp):  # noqa: F811
    """Two runserver processes on the test database, each with UNWIND_HOLD_NOTICES_PER_AGENT=4: two notices sent
    through the first, then ten proposals at once through both: exactly two more are sent, whatever process took
    them, because the count is read in the database under the tenant's chain lock."""
    world = api.world
    hold(world, "payments.charge", HELD, approval="auto")
    known_customer_add(tenant=world.acme, address="carol@example.com", user=world.ada)
    servers = [Processes({"UNWIND_HOLD_NOTICES_PER_AGENT": "4", "UNWIND_HOLD_NOTICE_WINDOW": "3600"}, worker=False)
               for _ in range(2)]
    try:
        agent = agent_session(world.key)
        first = [open_run(agent, servers[0].url, "carol@example.com") for _ in range(2)]
        for run_id in first:
            assert propose(agent, servers[0].url, run_id, "payments.charge", CHARGE)["status"] == "held"
        assert HoldNotice.objects.filter(sent=True).count() == 2
        burst = [(servers[n % 2].url, open_run(agent, servers[n % 2].url, "carol@example.com")) for n in range(10)]

        def one(target):
            base, run_id = target
            return propose(agent_session(world.key), base, run_id, "payments.charge", CHARGE)["status"]

        with ThreadPoolExecutor(max_workers=10) as pool:
            assert list(pool.map(one, burst)) == ["held"] * 10
    finally:
        stderr = [server.stop() for server in servers]
    assert HoldNotice.objects.filter(sent=True).count() == 4, stderr
    refused = HoldNotice.objects.filter(sent=False)
    assert refused.count() == 8 and all("the most UNWIND_HOLD_NOTICES_PER_AGENT allows" in n.why for n in refused)
    assert notifications_send() == 4 and [m["To"] for m in smtp.messages] == ["carol@example.com"] * 4
    assert Run.objects.filter(status="running").count() == 12  # every run goes on; only the mail is bounded


# --- the list: kept by the tenant's admins, in the Django admin, audited ----------------------------------------

def admin_login(base: str, username: str) -> requests.Session:
    browser = requests.Session()
    page = browser.get(f"{base}/admin/login/", timeout=30)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    logged = browser.post(f"{base}/admin/login/?next=/admin/", timeout=30, allow_redirects=False, data={
        "csrfmiddlewaretoken": token, "username": username, "password": f"pw-{username}", "next": "/admin/"},
        headers={"Referer": f"{base}/admin/login/"})
    assert logged.status_code == 302, logged.text[:2000]
    return browser


def admin_post(browser: requests.Session, url: str, data: dict) -> requests.Response:
    page = browser.get(url, timeout=30)
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    token = found.group(1) if found else browser.cookies.get("csrftoken", "")
    return browser.post(url, data={"csrfmiddlewaretoken": token, **data}, headers={"Referer": url}, timeout=30,
                        allow_redirects=False)


@pytest.fixture
def staff(api, live_server):
    """ada (acme's admin), alice (acme's approver) and mallory (globex's admin), each allowed into the admin."""
    world = api.world
    for user in (world.ada, world.alice, world.mallory):
        user.is_staff = True
        user.save(update_fields=["is_staff"])
    world.base = live_server.url
    return world


ADD = "/admin/recovery/knowncustomeraddress/add/"


def test_a_tenant_admin_adds_an_address_and_it_is_audited(staff):
    ada = admin_login(staff.base, "ada")
    added = admin_post(ada, staff.base + ADD, {"tenant": staff.acme.pk, "address": " Carol@Example.com ",
                                               "note": "Carol Ferreira"})
    assert added.status_code == 302, added.text[:3000]
    entry = KnownCustomerAddress.objects.get()
    assert (entry.tenant, entry.address, entry.created_by) == (staff.acme, "carol@example.com", "user:ada")
    event = AuditEvent.objects.get(kind="customer_address.added")
    assert event.actor == "user:ada" and event.data["address"] == "carol@example.com"
    bad = admin_post(ada, staff.base + ADD, {"tenant": staff.acme.pk, "address": "carol@ｅxample.com"})
    assert bad.status_code == 200 and "is not an email address" in bad.text
    again = admin_post(ada, staff.base + ADD, {"tenant": staff.acme.pk, "address": "CAROL@example.com"})
    assert again.status_code == 200 and "already exists" in again.text
    removed = admin_post(ada, f"{staff.base}/admin/recovery/knowncustomeraddress/{entry.pk}/delete/", {"post": "yes"})
    assert removed.status_code == 302 and not KnownCustomerAddress.objects.exists()
    assert AuditEvent.objects.filter(kind="customer_address.removed", actor="user:ada").count() == 1
    call_command("verify_audit")


def test_who_is_not_the_tenants_admin_cannot_touch_its_list(staff):
    entry = known_customer_add(tenant=staff.acme, address="carol@example.com", user=staff.ada)
    alice = admin_login(staff.base, "alice")  # acme's approver: staff, but not its admin
    assert alice.get(staff.base + ADD, timeout=30).status_code == 403
    assert admin_post(alice, staff.base + ADD, {"tenant": staff.acme.pk, "address": "x@outside.example"}
                      ).status_code == 403
    mallory = admin_login(staff.base, "mallory")  # globex's admin
    refused = admin_post(mallory, staff.base + ADD, {"tenant": staff.acme.pk, "address": "x@outside.example"})
    assert refused.status_code == 200 and "Select a valid choice" in refused.text
    listing = mallory.get(f"{staff.base}/admin/recovery/knowncustomeraddress/", timeout=30)
    assert listing.status_code == 200 and "carol@example.com" not in listing.text
    gone = admin_post(mallory, f"{staff.base}/admin/recovery/knowncustomeraddress/{entry.pk}/delete/", {"post": "yes"})
    assert gone.status_code in (302, 403, 404) and KnownCustomerAddress.objects.filter(pk=entry.pk).exists()
    assert list(KnownCustomerAddress.objects.values_list("address", flat=True)) == ["carol@example.com"]
    assert not AuditEvent.objects.filter(kind__startswith="customer_address.", actor__in=[
        "user:alice", "user:mallory"]).exists()


def test_an_address_added_in_the_database_fails_verify_audit(staff):
    known_customer_add(tenant=staff.acme, address="carol@example.com", user=staff.ada)
    call_command("verify_audit")
    sql("INSERT INTO recovery_knowncustomeraddress (tenant_id, address, note, created_by, created_at)"
        " VALUES (%s, %s, '', 'user:ada', CURRENT_TIMESTAMP)", [staff.acme.pk, "@outside.example"])
    assert "recovery.knowncustomeraddress" in verify_fails("fingerprint")
