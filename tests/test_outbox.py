"""The console's outbox: the email Unwind sends, readable in the browser by the tenant's operators and admins only.

Attacked over real HTTP: an approver, a viewer, another tenant's admin and an anonymous visitor each try the
list and a message of acme's; each is refused or sees nothing of it, and looking changes nothing.
"""
import requests
from django.db import transaction

from approvals.models import Notification
from approvals.services import notify
from recovery.trail import trail_send
from tests.test_console_scenarios import onboarding_compensated
from tests.test_trail import console, live_tools  # noqa: F401 - the live server with the sandbox tools


def messages(world):
    """One message of each tenant, written through the services: acme's carries a share link to a trail."""
    run = onboarding_compensated(world)
    trail_send(run=run, user=world.oscar)
    with transaction.atomic():
        notify(tenant_id=world.globex.pk, kind="alert", recipients=["ops@globex.example"],
               subject="Globex only: a compensation failed", template="recovery/email/correction_trail",
               context={"run": run, "trail": {"headline": "globex", "statements": []}, "url": "/x/", "days": 1})
    return Notification.objects.get(tenant=world.acme), Notification.objects.get(tenant=world.globex)


def snapshot():
    return list(Notification.objects.order_by("pk").values())


def test_an_operator_reads_the_tenants_outbox_and_a_message_body(live_tools):  # noqa: F811
    acme_note, globex_note = messages(live_tools)
    base = live_tools.live_server.url
    for person in ("oscar", "ada"):
        session = console(live_tools.live_server, person)
        listing = session.get(f"{base}/console/outbox/", timeout=10)
        assert listing.status_code == 200
        assert acme_note.subject in listing.text and "carol@example.com" in listing.text
        assert globex_note.subject not in listing.text and "ops@globex.example" not in listing.text
        detail = session.get(f"{base}/console/outbox/{acme_note.pk}/", timeout=10)
        assert detail.status_code == 200
        assert "Everything the agent changed has been undone." in detail.text
        assert "/console/trail/" in detail.text  # the body as written, share link included


def test_approvers_viewers_outsiders_and_strangers_read_nothing_of_it(live_tools):  # noqa: F811
    acme_note, globex_note = messages(live_tools)
    base = live_tools.live_server.url
    before = snapshot()
    for person in ("alice", "victor"):
        session = console(live_tools.live_server, person)
        for url in (f"{base}/console/outbox/", f"{base}/console/outbox/{acme_note.pk}/"):
            response = session.get(url, timeout=10)
            assert response.status_code == 403, (person, url)
            assert "to its operators and admins" in response.text
            assert acme_note.subject not in response.text and "/console/trail/" not in response.text
    mallory = console(live_tools.live_server, "mallory")  # globex's admin
    listing = mallory.get(f"{base}/console/outbox/", timeout=10)
    assert listing.status_code == 200 and globex_note.subject in listing.text
    assert acme_note.subject not in listing.text and "carol@example.com" not in listing.text
    stolen = mallory.get(f"{base}/console/outbox/{acme_note.pk}/", timeout=10)
    assert stolen.status_code == 404 and "/console/trail/" not in stolen.text
    anonymous = requests.get(f"{base}/console/outbox/{acme_note.pk}/", timeout=10, allow_redirects=False)
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous.headers["Location"]
    oscar = console(live_tools.live_server, "oscar")
    posted = oscar.post(f"{base}/console/outbox/{acme_note.pk}/", timeout=10,
                        data={"csrfmiddlewaretoken": oscar.cookies["csrftoken"]}, headers={"Referer": base})
    assert posted.status_code == 405  # read-only: nothing to change through it
    assert snapshot() == before


def test_the_outbox_list_costs_the_same_queries_whatever_its_length(tools, django_assert_max_num_queries):
    from django.test import Client

    messages(tools)
    with transaction.atomic():
        for index in range(40):
            notify(tenant_id=tools.acme.pk, kind="alert", recipients=[f"r{index}@example.com"], subject=f"n{index}",
                   template="recovery/email/correction_trail",
                   context={"run": None, "trail": {"headline": "h", "statements": []}, "url": "/x/", "days": 1})
    oscar = Client()
    oscar.force_login(tools.oscar)
    with django_assert_max_num_queries(8):
        response = oscar.get("/console/outbox/")
    assert response.status_code == 200 and response.content.count(b'class="outbox-row"') == 30
