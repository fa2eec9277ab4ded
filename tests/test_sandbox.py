"""The sandbox of external services: tools, idempotency, failure injection, state and the in-process form."""
import json
import threading
import time

import base64

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test import Client

from ledger.executors import signing
from ledger.executors.call import ToolError
from ledger.tenancy import membership_set, tenant_create
from sandbox import callables, tools
from sandbox.faults import fault_add
from sandbox.models import Charge, DirectoryUser, FlightBooking, HotelReservation, License, Message, Ticket, ToolCall
from sandbox.services import sandbox_reset
from tests.helpers import acme

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_world(db, settings):
    """acme's sandbox world, freshly seeded, and oscar, its operator."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    tenant = tenant_create(slug="acme", name="Acme")
    oscar = get_user_model().objects.create_user("oscar", "oscar@example.com", "pw-oscar")
    membership_set(tenant=tenant, user=oscar, role="operator")
    sandbox_reset(tenant=tenant)


class AcmeClient(Client):
    """What reaches acme's sandbox: every request signed for acme as Unwind signs tool calls, and carrying
    the HTTP Basic credentials of acme's operator for the world's controls. (Who is refused without
    either is tested in test_sandbox_access.py.)"""

    def generic(self, method, path, data="", content_type="application/octet-stream", secure=False, *,
                headers=None, **extra):
        body = data.encode() if isinstance(data, str) else (data or b"")
        basic = base64.b64encode(b"oscar:pw-oscar").decode()
        signed = signing.sign(tenant="acme", method=method, url=path, body=body)
        headers = {"Authorization": f"Basic {basic}", **signed, **(headers or {})}
        return super().generic(method, path, data, content_type, secure, headers=headers, **extra)


@pytest.fixture
def client():
    # Machine clients send no CSRF token; the sandbox's endpoints must not need one.
    return AcmeClient(enforce_csrf_checks=True)


def post(client, path, data=None, *, key=None, raw=None):
    headers = {"Idempotency-Key": key} if key else {}
    body = raw if raw is not None else json.dumps({} if data is None else data)
    return client.post(f"/sandbox/{path}", data=body, content_type="application/json", headers=headers)


def get(client, path):
    return client.get(f"/sandbox/{path}")


def add_fault(client, **rule):
    response = post(client, "faults", rule)
    assert response.status_code == 201, response.json()
    return response.json()


def calls_of(tool):
    return list(ToolCall.objects.filter(tool=tool).order_by("id"))


def create_user(client, email="ada@example.com", name="Ada Lovelace", **kwargs):
    response = post(client, "hr/users", {"email": email, "name": name}, **kwargs)
    assert response.status_code == 201, response.json()
    return response.json()


def charge(client, amount_cents=1250, *, key=None, **extra):
    return post(client, "payments/charge", {"customer": "cus_42", "amount_cents": amount_cents, **extra}, key=key)


# --- HR -------------------------------------------------------------------------------------------


def test_create_user_answers_201_and_reads_back(client):
    user = create_user(client)

    assert user["email"] == "ada@example.com"
    assert user["name"] == "Ada Lovelace"
    assert user["active"] is True
    assert get(client, f"hr/users/{user['id']}").json() == user


def test_delete_user_removes_it_and_a_second_delete_reports_false(client):
    user = create_user(client)

    first = post(client, "hr/users/delete", {"user_id": user["id"]})
    second = post(client, "hr/users/delete", {"user_id": user["id"]})

    assert first.status_code == 200 and first.json() == {"deleted": True, "id": user["id"]}
    assert second.status_code == 200 and second.json() == {"deleted": False, "id": user["id"]}
    assert get(client, f"hr/users/{user['id']}").status_code == 404


def test_reading_an_unknown_record_is_a_json_404(client):
    for path in (
        "hr/users/usr_nobody",
        "licenses/lic_nobody",
        "email/messages/msg_nobody",
        "payments/charges/ch_nobody",
        "travel/flights/flt_nobody",
        "travel/hotels/htl_nobody",
        "crm/tickets/T-999",
    ):
        response = get(client, path)
        assert response.status_code == 404, path
        assert "does not exist" in response.json()["detail"]


# --- Licenses -------------------------------------------------------------------------------------


def test_provision_defaults_the_sku_and_revoke_is_idempotent(client):
    user = create_user(client)

    provisioned = post(client, "licenses/provision", {"user_id": user["id"]})
    license = provisioned.json()
    first = post(client, "licenses/revoke", {"license_id": license["id"]})
    second = post(client, "licenses/revoke", {"license_id": license["id"]})

    assert provisioned.status_code == 201
    assert license["sku"] == "workspace-standard"
    assert license["status"] == "active"
    assert license["user_id"] == user["id"]
    assert first.json()["revoked"] is True and first.json()["id"] == license["id"]
    assert second.json()["revoked"] is False and second.json()["status"] == "revoked"
    assert second.json()["revoked_at"] == first.json()["revoked_at"]
    assert get(client, f"licenses/{license['id']}").json()["status"] == "revoked"


def test_provision_for_an_unknown_user_is_404_and_creates_nothing(client):
    response = post(client, "licenses/provision", {"user_id": "usr_ghost", "sku": "workspace-plus"})

    assert response.status_code == 404
    assert License.objects.count() == 0


def test_revoking_an_unknown_license_is_404(client):
    assert post(client, "licenses/revoke", {"license_id": "lic_ghost"}).status_code == 404


# --- Email ----------------------------------------------------------------------------------------


def test_send_email_answers_201_and_reads_back(client):
    response = post(client, "email/send", {"to": "bob@example.com", "subject": "Welcome", "body": "Hello Bob"})
    message = response.json()

    assert response.status_code == 201
    assert message["to"] == "bob@example.com" and message["subject"] == "Welcome"
    assert get(client, f"email/messages/{message['message_id']}").json()["body"] == "Hello Bob"
    assert get(client, "email/messages?to=bob@example.com").json()["results"] == [message]


def test_email_send_ignores_the_idempotency_key_but_records_it(client):
    mail = {"to": "bob@example.com", "subject": "Welcome", "body": "Hello"}

    first = post(client, "email/send", mail, key="welcome-bob")
    second = post(client, "email/send", mail, key="welcome-bob")

    assert first.status_code == second.status_code == 201
    assert first.json()["message_id"] != second.json()["message_id"]
    listed = get(client, "email/messages?idempotency_key=welcome-bob").json()["results"]
    assert [m["message_id"] for m in listed] == [first.json()["message_id"], second.json()["message_id"]]
    assert all(m["idempotency_key"] == "welcome-bob" for m in listed)
    assert [(c.effect_applied, c.replayed) for c in calls_of("email.send")] == [(True, False), (True, False)]


def test_listing_messages_filters_by_recipient_and_key(client):
    post(client, "email/send", {"to": "bob@example.com", "subject": "A"}, key="k-1")
    post(client, "email/send", {"to": "eve@example.com", "subject": "B"}, key="k-2")

    assert [m["subject"] for m in get(client, "email/messages?to=eve@example.com").json()["results"]] == ["B"]
    assert [m["subject"] for m in get(client, "email/messages?idempotency_key=k-1").json()["results"]] == ["A"]
    assert get(client, "email/messages?idempotency_key=unknown").json()["results"] == []
    assert get(client, "email/messages?idempotency_key=").json()["results"] == []
    assert len(get(client, "email/messages").json()["results"]) == 2


# --- Payments -------------------------------------------------------------------------------------


def test_charge_captures_in_integer_cents_with_euro_by_default(client):
    response = charge(client, 1250)
    body = response.json()

    assert response.status_code == 201
    assert body["status"] == "captured"
    assert body["amount_cents"] == 1250 and body["currency"] == "EUR" and body["customer"] == "cus_42"
    assert get(client, f"payments/charges/{body['charge_id']}").json() == body


def test_charge_normalises_the_currency_code(client):
    assert charge(client, 500, currency="usd").json()["currency"] == "USD"


def test_refunding_twice_refunds_once(client):
    charge_id = charge(client).json()["charge_id"]

    first = post(client, "payments/refund", {"charge_id": charge_id})
    second = post(client, "payments/refund", {"charge_id": charge_id})

    assert first.status_code == second.status_code == 200
    assert first.json()["refunded"] is True and first.json()["status"] == "refunded"
    assert second.json()["refunded"] is False and second.json()["status"] == "refunded"
    assert second.json()["refunded_at"] == first.json()["refunded_at"]


def test_refunding_an_unknown_charge_is_404(client):
    assert post(client, "payments/refund", {"charge_id": "ch_ghost"}).status_code == 404


@pytest.mark.parametrize("amount", [0, -5, "100", 12.5, True, None])
def test_charge_refuses_an_amount_that_is_not_a_positive_whole_number(client, amount):
    response = charge(client, amount)

    assert response.status_code == 400
    assert "amount_cents" in response.json()["detail"]
    assert Charge.objects.count() == 0


@pytest.mark.parametrize("currency", ["EU", "EURO", "12$", 978])
def test_charge_refuses_a_currency_that_is_not_three_letters(client, currency):
    assert charge(client, 100, currency=currency).status_code == 400


# --- Travel ---------------------------------------------------------------------------------------


def test_book_and_cancel_a_flight(client):
    booked = post(client, "travel/flights/book", {"passenger": "Ada Lovelace", "flight": "LH123", "date": "2026-03-14"})
    booking = booked.json()

    first = post(client, "travel/flights/cancel", {"booking_id": booking["booking_id"]})
    second = post(client, "travel/flights/cancel", {"booking_id": booking["booking_id"]})

    assert booked.status_code == 201
    assert booking["status"] == "booked" and booking["date"] == "2026-03-14" and booking["flight"] == "LH123"
    assert first.status_code == 200 and first.json()["cancelled"] is True
    assert second.json()["cancelled"] is False
    assert get(client, f"travel/flights/{booking['booking_id']}").json()["status"] == "cancelled"


def test_reserve_and_cancel_a_hotel(client):
    reserved = post(client, "travel/hotels/reserve", {"guest": "Ada Lovelace", "hotel": "Hotel Adlon", "nights": 3})
    reservation = reserved.json()

    first = post(client, "travel/hotels/cancel", {"reservation_id": reservation["reservation_id"]})
    second = post(client, "travel/hotels/cancel", {"reservation_id": reservation["reservation_id"]})

    assert reserved.status_code == 201
    assert reservation["status"] == "reserved" and reservation["nights"] == 3
    assert first.status_code == 200 and first.json()["cancelled"] is True
    assert second.json()["cancelled"] is False
    assert get(client, f"travel/hotels/{reservation['reservation_id']}").json()["status"] == "cancelled"


def test_travel_refuses_bad_dates_and_nights(client):
    bad_date = post(client, "travel/flights/book", {"passenger": "Ada", "flight": "LH123", "date": "14/03/2026"})
    no_nights = post(client, "travel/hotels/reserve", {"guest": "Ada", "hotel": "Adlon", "nights": 0})

    assert bad_date.status_code == 400 and "date" in bad_date.json()["detail"]
    assert no_nights.status_code == 400 and "nights" in no_nights.json()["detail"]
    assert FlightBooking.objects.count() == HotelReservation.objects.count() == 0


def test_cancelling_unknown_bookings_is_404(client):
    assert post(client, "travel/flights/cancel", {"booking_id": "flt_ghost"}).status_code == 404
    assert post(client, "travel/hotels/cancel", {"reservation_id": "htl_ghost"}).status_code == 404


# --- CRM ------------------------------------------------------------------------------------------


def test_reset_seeds_the_three_tickets(client):
    tickets = get(client, "crm/tickets").json()["results"]

    assert [(t["id"], t["subject"], t["priority"], t["status"], t["version"]) for t in tickets] == [
        ("T-182", "Login page times out", "normal", "open", 1),
        ("T-204", "Invoice PDF missing", "normal", "open", 1),
        ("T-311", "Export to CSV", "low", "open", 1),
    ]


def test_update_ticket_answers_the_full_ticket_and_bumps_the_version(client):
    change = {"ticket_id": "T-182", "priority": "urgent", "note": "Customer is blocked"}
    response = post(client, "crm/tickets/update", change)
    ticket = response.json()

    assert response.status_code == 200
    assert ticket["priority"] == "urgent" and ticket["status"] == "open"
    assert ticket["notes"] == ["Customer is blocked"]
    assert ticket["version"] == 2 and ticket["updated_by"] == "agent"
    assert get(client, "crm/tickets/T-182").json() == ticket


def test_restoring_a_ticket_is_an_update_with_the_old_values(client):
    before = get(client, "crm/tickets/T-204").json()
    post(client, "crm/tickets/update", {"ticket_id": "T-204", "priority": "high", "status": "pending"})

    restore = {"ticket_id": "T-204", "priority": before["priority"], "status": before["status"], "updated_by": "unwind"}
    restored = post(client, "crm/tickets/update", restore).json()

    assert (restored["priority"], restored["status"]) == (before["priority"], before["status"])
    assert restored["version"] == 3 and restored["updated_by"] == "unwind"


def test_an_update_that_changes_nothing_keeps_the_version(client):
    ticket = post(client, "crm/tickets/update", {"ticket_id": "T-311", "priority": "low"}).json()

    assert ticket["version"] == 1 and ticket["updated_by"] == "system"


def test_an_update_must_name_something_to_change(client):
    response = post(client, "crm/tickets/update", {"ticket_id": "T-311"})

    assert response.status_code == 400 and "nothing to change" in response.json()["detail"]


def test_update_refuses_unknown_tickets_and_values(client):
    assert post(client, "crm/tickets/update", {"ticket_id": "T-999", "status": "closed"}).status_code == 404
    assert post(client, "crm/tickets/update", {"ticket_id": "T-182", "status": "done"}).status_code == 400
    assert post(client, "crm/tickets/update", {"ticket_id": "T-182", "priority": "critical"}).status_code == 400
    assert Ticket.objects.get(number="T-182").version == 1


def test_create_ticket_and_refuse_a_duplicate_id(client):
    created = post(client, "crm/tickets", {"id": "T-400", "subject": "Dark mode", "priority": "high"})
    duplicate = post(client, "crm/tickets", {"id": "T-400", "subject": "Dark mode again"})

    assert created.status_code == 201
    assert created.json()["priority"] == "high" and created.json()["version"] == 1 and created.json()["notes"] == []
    assert duplicate.status_code == 409
    assert get(client, "crm/tickets/T-400").json()["subject"] == "Dark mode"


def test_a_ticket_id_cannot_shadow_an_endpoint(client):
    assert post(client, "crm/tickets", {"id": "update", "subject": "Sneaky"}).status_code == 400


# --- Idempotency ----------------------------------------------------------------------------------


def test_duplicate_key_replays_the_answer_and_charges_once(client):
    first = charge(client, 1250, key="order-7")
    second = charge(client, 1250, key="order-7")

    assert first.status_code == second.status_code == 201
    assert second.json() == first.json()
    assert Charge.objects.count() == 1
    assert [(c.effect_applied, c.replayed) for c in calls_of("payments.charge")] == [(True, False), (False, True)]


def test_duplicate_key_compares_arguments_after_defaults(client):
    first = charge(client, 1250, key="order-8")
    second = charge(client, 1250, key="order-8", currency="EUR")

    assert second.status_code == 201 and second.json() == first.json()
    assert Charge.objects.count() == 1


def test_reusing_a_key_with_other_arguments_is_422_and_has_no_effect(client):
    charge(client, 1250, key="order-9")

    response = charge(client, 9999, key="order-9")

    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1
    assert calls_of("payments.charge")[-1].effect_applied is False


def test_keys_are_scoped_to_their_tool(client):
    user = create_user(client, key="shared-key")
    ticket = post(client, "crm/tickets/update", {"ticket_id": "T-182", "note": "hi"}, key="shared-key")

    assert ticket.status_code == 200
    assert DirectoryUser.objects.filter(pk=user["id"]).exists()


def test_calls_without_a_key_each_apply(client):
    charge(client, 100)
    charge(client, 100)

    assert Charge.objects.count() == 2


def test_a_refused_call_stores_nothing_under_its_key(client):
    refused = post(client, "licenses/provision", {"user_id": "usr_later"}, key="lic-1")
    assert refused.status_code == 404

    DirectoryUser.objects.create(tenant=acme(), id="usr_later", email="later@example.com", name="Later")
    accepted = post(client, "licenses/provision", {"user_id": "usr_later"}, key="lic-1")

    assert accepted.status_code == 201
    assert License.objects.count() == 1


def test_idempotent_update_does_not_append_the_note_twice(client):
    first = post(client, "crm/tickets/update", {"ticket_id": "T-182", "note": "called the customer"}, key="note-1")
    second = post(client, "crm/tickets/update", {"ticket_id": "T-182", "note": "called the customer"}, key="note-1")

    assert second.json() == first.json()
    assert Ticket.objects.get(number="T-182").notes == ["called the customer"]


def test_the_loser_of_a_race_for_a_key_replays_the_winners_answer(client, monkeypatch):
    winner = charge(client, 1250, key="race-1").json()
    real_lookup = tools._stored_answer
    lookups = []

    def lookup_that_misses_once(tenant, tool, key):
        # The first read happens "before the winner committed": it sees no record, applies the
        # effect and then collides with the winner's record on the unique constraint.
        lookups.append(key)
        return None if len(lookups) == 1 else real_lookup(tenant, tool, key)

    monkeypatch.setattr(tools, "_stored_answer", lookup_that_misses_once)

    loser = charge(client, 1250, key="race-1")

    assert len(lookups) == 2
    assert loser.status_code == 201 and loser.json() == winner
    assert Charge.objects.count() == 1
    assert [(c.effect_applied, c.replayed) for c in calls_of("payments.charge")] == [(True, False), (False, True)]


def _concurrently(n, fn):
    barrier = threading.Barrier(n)
    results = [None] * n

    def run(i):
        try:
            barrier.wait()
            results[i] = fn()
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.django_db(transaction=True)
def test_concurrent_calls_with_one_key_charge_exactly_once():
    tenant = acme()
    sandbox_reset(tenant=tenant)
    args = {"customer": "cus_42", "amount_cents": 700}

    responses = _concurrently(
        10, lambda: tools.call_tool("payments.charge", args, tenant=tenant, idempotency_key="burst-1"))

    assert {r.status for r in responses} == {201}
    assert len({json.dumps(r.body, sort_keys=True) for r in responses}) == 1
    assert Charge.objects.count() == 1
    assert ToolCall.objects.filter(tool="payments.charge", effect_applied=True).count() == 1
    assert ToolCall.objects.filter(tool="payments.charge", replayed=True).count() == 9


@pytest.mark.django_db(transaction=True)
def test_concurrent_calls_consume_a_fault_exactly_once():
    tenant = acme()
    sandbox_reset(tenant=tenant)
    fault_add({"tool": "payments.charge", "mode": "status", "status": 503}, tenant=tenant)
    args = {"customer": "cus_42", "amount_cents": 700}

    responses = _concurrently(10, lambda: tools.call_tool("payments.charge", args, tenant=tenant, idempotency_key=None))

    assert sorted(r.status for r in responses) == [201] * 9 + [503]
    assert Charge.objects.count() == 9


@pytest.mark.django_db(transaction=True)
def test_concurrent_calls_fire_a_positional_rule_exactly_once():
    tenant = acme()
    sandbox_reset(tenant=tenant)
    fault_add({"tool": "payments.charge", "mode": "status", "status": 503, "nth": 4}, tenant=tenant)
    args = {"customer": "cus_42", "amount_cents": 700}

    responses = _concurrently(10, lambda: tools.call_tool("payments.charge", args, tenant=tenant, idempotency_key=None))

    assert sorted(r.status for r in responses) == [201] * 9 + [503]
    assert Charge.objects.count() == 9


# --- Failure injection ----------------------------------------------------------------------------


def test_status_fault_answers_the_status_without_the_effect(client):
    add_fault(client, tool="payments.charge", mode="status", status=503)

    failed = charge(client, key="pay-1")
    retried = charge(client, key="pay-1")

    assert failed.status_code == 503 and failed.json()["code"] == "injected_status"
    assert retried.status_code == 201
    assert Charge.objects.count() == 1
    assert [(c.status, c.fault, c.effect_applied) for c in calls_of("payments.charge")] == [
        (503, "status", False),
        (201, "", True),
    ]


def test_status_fault_can_send_retry_after(client):
    add_fault(client, tool="hr.create_user", mode="status", status=429, retry_after=2)

    response = post(client, "hr/users", {"email": "ada@example.com", "name": "Ada"})

    assert response.status_code == 429
    assert response["Retry-After"] == "2"
    assert DirectoryUser.objects.count() == 0


def test_status_is_the_default_503(client):
    rule = add_fault(client, tool="payments.charge", mode="status")

    assert rule["status"] == 503 and rule["times"] == 1
    assert charge(client).status_code == 503


def test_timeout_fault_holds_the_call_then_answers_504_without_the_effect(client):
    add_fault(client, tool="travel.book_flight", mode="timeout", seconds=0.3)

    started = time.monotonic()
    response = post(client, "travel/flights/book", {"passenger": "Ada", "flight": "LH123", "date": "2026-03-14"})

    assert time.monotonic() - started >= 0.3
    assert response.status_code == 504 and response.json()["code"] == "injected_timeout"
    assert FlightBooking.objects.count() == 0


def test_timeout_defaults_to_thirty_seconds(client):
    assert add_fault(client, tool="travel.book_flight", mode="timeout")["seconds"] == 30


def test_latency_fault_delays_then_applies(client):
    add_fault(client, tool="travel.reserve_hotel", mode="latency", ms=200)

    started = time.monotonic()
    response = post(client, "travel/hotels/reserve", {"guest": "Ada", "hotel": "Adlon", "nights": 2})

    assert time.monotonic() - started >= 0.2
    assert response.status_code == 201
    assert HotelReservation.objects.count() == 1
    assert calls_of("travel.reserve_hotel")[0].fault == "latency"


def test_error_after_effect_applies_the_effect_and_a_retry_replays_it(client):
    add_fault(client, tool="payments.charge", mode="error_after_effect")

    failed = charge(client, 1250, key="pay-2")
    retried = charge(client, 1250, key="pay-2")

    assert failed.status_code == 500 and failed.json()["code"] == "injected_error_after_effect"
    assert retried.status_code == 201
    assert Charge.objects.count() == 1
    assert get(client, f"payments/charges/{retried.json()['charge_id']}").status_code == 200
    assert [(c.status, c.effect_applied, c.replayed) for c in calls_of("payments.charge")] == [
        (500, True, False),
        (201, False, True),
    ]


def test_error_after_effect_on_a_tool_without_idempotency_duplicates_on_retry(client):
    add_fault(client, tool="email.send", mode="error_after_effect", status=502)
    mail = {"to": "bob@example.com", "subject": "Welcome"}

    failed = post(client, "email/send", mail, key="mail-1")
    retried = post(client, "email/send", mail, key="mail-1")

    assert failed.status_code == 502 and retried.status_code == 201
    assert Message.objects.filter(idempotency_key="mail-1").count() == 2


def test_times_counts_the_affected_calls(client):
    add_fault(client, tool="payments.charge", mode="status", status=500, times=2)

    assert [charge(client).status_code for _ in range(3)] == [500, 500, 201]


@pytest.mark.parametrize("times", [None, 0])
def test_times_null_or_zero_affects_every_call_until_cleared(client, times):
    rule = add_fault(client, tool="payments.charge", mode="status", status=500, times=times)

    statuses = [charge(client).status_code for _ in range(4)]
    cleared = client.delete("/sandbox/faults?tool=payments.charge")

    assert rule["times"] is None
    assert statuses == [500] * 4
    assert cleared.json() == {"cleared": 1}
    assert charge(client).status_code == 201


def test_nth_affects_only_the_nth_call_from_now(client):
    charge(client)  # calls before the rule do not count
    add_fault(client, tool="payments.charge", mode="status", status=503, nth=3)

    assert [charge(client).status_code for _ in range(5)] == [201, 201, 503, 201, 201]


def test_nth_with_times_affects_a_run_of_calls(client):
    add_fault(client, tool="payments.charge", mode="status", status=503, nth=2, times=2)

    assert [charge(client).status_code for _ in range(5)] == [201, 503, 503, 201, 201]


def test_a_due_positional_rule_takes_precedence(client):
    add_fault(client, tool="payments.charge", mode="status", status=500, times=None)
    add_fault(client, tool="payments.charge", mode="status", status=503, nth=2)

    assert [charge(client).status_code for _ in range(3)] == [500, 503, 500]


def test_rules_are_used_oldest_first(client):
    add_fault(client, tool="payments.charge", mode="status", status=500)
    add_fault(client, tool="payments.charge", mode="status", status=502)

    assert [charge(client).status_code for _ in range(3)] == [500, 502, 201]


def test_faults_affect_only_their_tool_and_never_the_readers(client):
    user = create_user(client)
    add_fault(client, tool="hr.create_user", mode="status", status=500, times=None)

    assert get(client, f"hr/users/{user['id']}").status_code == 200
    assert get(client, "state").status_code == 200
    assert charge(client).status_code == 201
    assert post(client, "hr/users", {"email": "b@example.com", "name": "B"}).status_code == 500


def test_fault_listing_shows_consumption(client):
    add_fault(client, tool="payments.charge", mode="status", status=500, times=2)
    charge(client)

    (rule,) = get(client, "faults").json()["results"]
    assert (rule["hits"], rule["spent"]) == (1, False)
    charge(client)
    (rule,) = get(client, "faults").json()["results"]
    assert (rule["hits"], rule["spent"]) == (2, True)


def test_clearing_faults_by_tool_or_all(client):
    add_fault(client, tool="payments.charge", mode="status")
    add_fault(client, tool="payments.refund", mode="status")
    add_fault(client, tool="email.send", mode="latency", ms=10)

    by_tool = post(client, "faults/clear", {"tool": "payments.refund"})
    remaining = [rule["tool"] for rule in get(client, "faults").json()["results"]]
    everything = client.delete("/sandbox/faults")

    assert by_tool.json() == {"cleared": 1}
    assert remaining == ["payments.charge", "email.send"]
    assert everything.json() == {"cleared": 2}
    assert get(client, "faults").json()["results"] == []


@pytest.mark.parametrize(
    "rule",
    [
        {"tool": "payments.steal", "mode": "status"},
        {"tool": "payments.charge", "mode": "explode"},
        {"tool": "payments.charge"},
        {"tool": "payments.charge", "mode": "status", "status": 200},
        {"tool": "payments.charge", "mode": "status", "status": "500"},
        {"tool": "payments.charge", "mode": "status", "ms": 100},
        {"tool": "payments.charge", "mode": "latency"},
        {"tool": "payments.charge", "mode": "timeout", "seconds": -1},
        {"tool": "payments.charge", "mode": "timeout", "seconds": 10_000},
        {"tool": "payments.charge", "mode": "status", "times": -1},
        {"tool": "payments.charge", "mode": "status", "times": False},
        {"tool": "payments.charge", "mode": "status", "nth": 0},
        ["payments.charge", "status"],
    ],
)
def test_a_bad_fault_rule_is_refused(client, rule):
    response = post(client, "faults", rule)

    assert response.status_code == 400
    assert response.json()["detail"]
    assert get(client, "faults").json()["results"] == []


def test_clearing_faults_of_an_unknown_tool_is_refused(client):
    assert client.delete("/sandbox/faults?tool=nope").status_code == 400


# --- State, reset and the call log ----------------------------------------------------------------


def test_state_holds_the_whole_world(client):
    user = create_user(client)
    post(client, "licenses/provision", {"user_id": user["id"]})
    post(client, "email/send", {"to": "bob@example.com", "subject": "Hi"})
    charge(client, key="s-1")
    charge(client, key="s-1")
    post(client, "travel/flights/book", {"passenger": "Ada", "flight": "LH1", "date": "2026-01-02"})
    post(client, "travel/hotels/reserve", {"guest": "Ada", "hotel": "Adlon", "nights": 1})
    add_fault(client, tool="payments.refund", mode="status")

    state = get(client, "state").json()

    kinds = ("users", "licenses", "messages", "charges", "flights", "hotels", "tickets", "faults")
    assert {kind: len(state[kind]) for kind in kinds} == {
        "users": 1, "licenses": 1, "messages": 1, "charges": 1, "flights": 1, "hotels": 1, "tickets": 3, "faults": 1,
    }
    assert state["call_counts"]["payments.charge"] == {"calls": 2, "effects": 1, "replays": 1}
    assert state["call_counts"]["hr.create_user"] == {"calls": 1, "effects": 1, "replays": 0}


def test_reset_empties_everything_and_forgets_keys(client):
    charge(client, key="r-1")
    post(client, "crm/tickets/update", {"ticket_id": "T-182", "status": "closed"})
    add_fault(client, tool="payments.refund", mode="status")

    state = post(client, "reset").json()
    again = charge(client, key="r-1")

    assert state["charges"] == [] and state["faults"] == [] and state["call_counts"] == {}
    assert [t["status"] for t in state["tickets"]] == ["open", "open", "open"]
    assert again.status_code == 201 and Charge.objects.count() == 1


def test_the_reset_command_resets(client):
    charge(client)

    call_command("sandbox_reset", "--tenant", "acme", stdout=open("/dev/null", "w"))

    assert Charge.objects.count() == 0 and Ticket.objects.count() == 3


def test_the_call_log_lists_every_call_with_its_outcome(client):
    charge(client, 100, key="log-1")
    charge(client, 100, key="log-1")
    charge(client, 0)
    create_user(client)

    listing = get(client, "calls?tool=payments.charge").json()
    by_key = get(client, "calls?idempotency_key=log-1").json()

    assert listing["count"] == 3
    assert [(c["status"], c["effect_applied"], c["replayed"]) for c in listing["results"]] == [
        (201, True, False),
        (201, False, True),
        (400, False, False),
    ]
    assert listing["results"][0]["args"] == {"customer": "cus_42", "amount_cents": 100}
    assert listing["results"][0]["idempotency_key"] == "log-1"
    assert by_key["count"] == 2


def test_the_call_log_keeps_the_most_recent_calls_under_a_limit(client):
    for amount in (1, 2, 3):
        charge(client, amount)

    listing = get(client, "calls?limit=2").json()

    assert listing["count"] == 3
    assert [c["args"]["amount_cents"] for c in listing["results"]] == [2, 3]
    assert get(client, "calls?limit=zero").status_code == 400


# --- Bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("hr/users", {"name": "No Email"}),
        ("hr/users", {"email": "not-an-email", "name": "Ada"}),
        ("hr/users", {"email": "ada@example.com", "name": 7}),
        ("hr/users", {"email": "ada@example.com", "name": "   "}),
        ("hr/users", {"email": "ada@example.com", "name": "Ada", "role": "admin"}),
        ("hr/users/delete", {"user_id": 12}),
        ("licenses/provision", {}),
        ("licenses/revoke", {"license_id": ["lic_1"]}),
        ("email/send", {"to": "bob@example.com"}),
        ("payments/charge", {"customer": "cus_42"}),
        ("payments/refund", {}),
        ("travel/flights/book", {"passenger": "Ada", "flight": "LH1"}),
        ("travel/flights/cancel", {"booking_id": None}),
        ("travel/hotels/reserve", {"guest": "Ada", "hotel": "Adlon", "nights": "two"}),
        ("travel/hotels/cancel", {"reservation": "htl_1"}),
        ("crm/tickets", {"subject": "No id"}),
        ("crm/tickets/update", {"status": "closed"}),
    ],
)
def test_bad_arguments_are_a_400_with_a_detail(client, path, body):
    response = post(client, path, body)

    assert response.status_code == 400
    assert isinstance(response.json()["detail"], str) and response.json()["code"] == "invalid_argument"


@pytest.mark.parametrize("raw", ["{not json", '["a", "list"]', '"text"', "null", "\xff"])
def test_a_body_that_is_not_a_json_object_is_a_400(client, raw):
    response = post(client, "payments/charge", raw=raw)

    assert response.status_code == 400
    assert response.json()["detail"]
    assert Charge.objects.count() == 0


@pytest.mark.parametrize(
    "raw",
    [
        '{"customer": "cus\\u0000", "amount_cents": 100}',
        '{"customer": "cus_42", "amount_cents": NaN}',
        '{"customer": "cus_42", "amount_cents": 100, "meta": ' + "[" * 40 + "]" * 40 + "}",
        "[" * 100_000,
    ],
)
def test_arguments_a_json_column_cannot_hold_are_a_400_and_still_logged(client, raw):
    response = post(client, "payments/charge", raw=raw)

    assert response.status_code == 400
    assert Charge.objects.count() == 0


def test_nul_characters_in_ids_filters_and_keys_are_a_400(client):
    assert get(client, "crm/tickets/T-%00").status_code == 400
    assert get(client, "email/messages?to=a%00b").status_code == 400
    assert get(client, "calls?idempotency_key=%00").status_code == 400
    assert callables.read_ticket("T-182", tenant="acme")["id"] == "T-182"
    with pytest.raises(ToolError) as failure:
        callables.payments_charge({"customer": "c", "amount_cents": 1}, idempotency_key="k\x00", target=None,
                                  tenant="acme")
    assert failure.value.status == 400
    assert Charge.objects.count() == 0


def test_a_wrong_method_is_a_json_405(client):
    response = get(client, "payments/charge")

    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert "not allowed" in response.json()["detail"]


def test_an_overlong_idempotency_key_is_refused(client):
    response = charge(client, key="k" * 256)

    assert response.status_code == 400
    assert Charge.objects.count() == 0


# --- In-process callables -------------------------------------------------------------------------


def test_callables_share_the_tool_behaviour_and_idempotency():
    args = {"customer": "cus_1", "amount_cents": 300}
    first = callables.payments_charge(args, idempotency_key="cb-1", target=None, tenant="acme")
    second = callables.payments_charge(args, idempotency_key="cb-1", target=None, tenant="acme")

    assert first == second and first["status"] == "captured"
    assert callables.read_charge(first["charge_id"], tenant="acme") == first
    assert Charge.objects.count() == 1
    assert [(c.effect_applied, c.replayed) for c in calls_of("payments.charge")] == [(True, False), (False, True)]


def test_callable_update_and_read_ticket():
    ticket = callables.crm_update_ticket(
        {"ticket_id": "T-311", "priority": "high"}, idempotency_key="cb-2", target="T-311", tenant="acme"
    )

    assert ticket["priority"] == "high"
    assert callables.read_ticket("T-311", tenant="acme") == ticket
    assert callables.read_ticket("T-999", tenant="acme") is None


def test_messages_with_key_reads_back_whether_a_send_happened(client):
    assert callables.messages_with_key("mail-9", tenant="acme") == {"results": []}

    mail = {"to": "bob@example.com", "subject": "Hi", "body": "x"}
    sent = callables.email_send(mail, idempotency_key="mail-9", target=None, tenant="acme")

    assert callables.messages_with_key("mail-9", tenant="acme") == {"results": [sent]}
    over_http = get(client, "email/messages?idempotency_key=mail-9").json()
    assert over_http == callables.messages_with_key("mail-9", tenant="acme")


def test_callable_readers_answer_none_for_unknown_records():
    readers = (
        callables.read_user,
        callables.read_license,
        callables.read_message,
        callables.read_charge,
        callables.read_flight,
        callables.read_hotel,
    )
    assert [reader("nobody", tenant="acme") for reader in readers] == [None] * len(readers)


def test_callable_raises_a_transient_tool_error_on_an_injected_fault(client):
    add_fault(client, tool="hr.create_user", mode="status", status=503)

    with pytest.raises(ToolError) as failure:
        callables.hr_create_user({"email": "ada@example.com", "name": "Ada"}, idempotency_key="cb-3", target=None,
                                 tenant="acme")

    assert failure.value.transient is True and failure.value.status == 503
    assert DirectoryUser.objects.count() == 0


def test_callable_raises_a_permanent_tool_error_on_a_refusal():
    with pytest.raises(ToolError) as failure:
        callables.payments_refund({"charge_id": "ch_ghost"}, idempotency_key="cb-4", target="ch_ghost", tenant="acme")

    assert failure.value.transient is False and failure.value.status == 404


def test_callable_error_after_effect_is_transient_and_the_retry_replays(client):
    add_fault(client, tool="licenses.provision", mode="error_after_effect")
    user = callables.hr_create_user({"email": "ada@example.com", "name": "Ada"}, idempotency_key="cb-5", target=None,
                                    tenant="acme")
    args = {"user_id": user["id"]}

    with pytest.raises(ToolError) as failure:
        callables.licenses_provision(args, idempotency_key="cb-6", target=None, tenant="acme")
    retried = callables.licenses_provision(args, idempotency_key="cb-6", target=None, tenant="acme")

    assert failure.value.transient is True and failure.value.status == 500
    assert retried["status"] == "active"
    assert License.objects.count() == 1


# --- Admin ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [
        "directoryuser", "license", "message", "charge", "flightbooking",
        "hotelreservation", "ticket", "idempotencyrecord", "fault", "toolcall",
    ],
)
def test_admin_lists_render(admin_client, model):
    create_user(AcmeClient())
    charge(AcmeClient(), key="admin-1")

    assert admin_client.get(f"/admin/sandbox/{model}/").status_code == 200
