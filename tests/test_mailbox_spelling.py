"""Issue 39, finding 9: the person acted for cannot approve under a spelling mail delivers to the same mailbox.

A run for `alice@example.com.`, `alice+x@example.com` or `alice@ｅxample.com` (full-width ｅ) could be approved by
alice, whose address is `alice@example.com`. Addresses are compared as mailboxes (approvals/addresses.py): NFKC,
the domain without its trailing dot and through IDNA, the sub-address dropped at the tenant's
`subaddress_separators` ("+" by default, a versioned tenant default), the local part case-folded. Over HTTP against
a live server: the REST endpoint, the approver's page and the email (which gives her no link) refuse her, and the
request stays pending with nothing charged.
"""
from __future__ import annotations

import re

import pytest
import requests
from django.core.management import CommandError, call_command
from django.db import connection

from approvals.addresses import mailboxes
from approvals.models import ApprovalDecision, ApprovalRequest
from approvals.services import notifications_send
from ledger.models import Action, AuditEvent, Tenant, TenantPolicyVersion
from sandbox.selectors import world_state
from tests.helpers import acme
from tests.test_notifications import body_parts, smtp  # noqa: F401 - the SMTP fixture
from tests.test_self_approval_spelling import approve, gated

REFUSED = "you asked for this action (or it acts on your behalf); someone else must decide"
SPELLINGS = [
    "alice@example.com.",  # the fully qualified domain
    "alice+x@example.com",  # a sub-address
    "alice@ｅxample.com",  # full-width ｅ
    "ａｌｉｃｅ@ｅｘａｍｐｌｅ．ｃｏｍ",  # all of it full-width
    "alice@example。com",  # an ideographic full stop, a label separator to IDNA
    "Alice <ALICE+Travel@EXAMPLE.COM.>",
    '"alice+x"@example.com',
    "bob@example.com, alice+z@ｅxample.com.",
]


def untouched(request: ApprovalRequest) -> None:
    request.refresh_from_db()
    assert request.status == "pending" and not ApprovalDecision.objects.filter(request=request).exists()
    assert Action.objects.get(pk=request.action_id).status == "awaiting_approval"
    assert world_state(tenant=acme())["charges"] == []


def signed_in(world, username: str) -> requests.Session:
    browser = requests.Session()
    login = f"{world.live_server.url}/accounts/login/"
    browser.get(login, timeout=30)
    answer = browser.post(login, data={"username": username, "password": f"pw-{username}",
                                       "csrfmiddlewaretoken": browser.cookies["csrftoken"]}, timeout=30,
                          allow_redirects=False)
    assert answer.status_code == 302, answer.text[:500]
    return browser


def decide_on_page(world, browser: requests.Session, request: ApprovalRequest) -> requests.Response:
    page = f"{world.live_server.url}/approvals/{request.pk}/"
    assert browser.get(page, timeout=30).status_code == 200
    return browser.post(f"{page}decide/", data={"decision": "approve", "reason": "",
                                                "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
                        headers={"Referer": page}, timeout=30)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_alice_cannot_approve_a_run_for_her_mailbox_under_any_spelling(http_tools, spelling):
    request = gated(http_tools, spelling)
    refused = approve(http_tools, "alice", request)
    assert refused.status_code == 403 and refused.headers["Content-Type"].startswith("application/problem+json")
    assert refused.json()["detail"] == REFUSED, refused.text
    untouched(request)
    assert approve(http_tools, "ben", request).status_code == 200  # someone else may


def test_her_page_refuses_her_and_her_email_has_no_link(http_tools, smtp, settings):  # noqa: F811
    settings.UNWIND_BASE_URL = http_tools.live_server.url
    request = gated(http_tools, "alice+expenses@ｅxample.com.")
    page = decide_on_page(http_tools, signed_in(http_tools, "alice"), request)
    assert page.status_code == 403 and "someone else must decide" in page.text
    untouched(request)
    notifications_send()
    mail = {message["To"]: body_parts(message)[0] for message in smtp.messages}
    assert "/approvals/link/" not in mail["alice@example.com"]  # she may not decide: no one-tap link
    assert re.search(r"Approve: \S+/approvals/link/", mail["ben@example.com"])


def test_an_approver_whose_own_address_has_a_sub_address_is_that_mailbox(http_tools):
    http_tools.alice.email = "Alice+Work@Example.com"
    http_tools.alice.save(update_fields=["email"])
    request = gated(http_tools, "alice@example.com")
    refused = approve(http_tools, "alice", request)
    assert refused.status_code == 403 and refused.json()["detail"] == REFUSED
    untouched(request)


def load_defaults(world, defaults: dict) -> requests.Response:
    return requests.post(f"{world.live_server.url}/api/v1/policy", json={"defaults": defaults},
                         auth=("ada", "pw-ada"), timeout=30)


def test_a_tenant_names_its_separators_in_its_defaults_versioned_and_audited(http_tools):
    before = TenantPolicyVersion.objects.filter(tenant=acme()).count()
    bad = load_defaults(http_tools, {"subaddress_separators": "x"})
    assert bad.status_code == 400 and bad.json()["field"] == "defaults.subaddress_separators", bad.text
    assert acme().subaddress_separators == "+" and TenantPolicyVersion.objects.filter(tenant=acme()).count() == before

    # A mail server that delivers alice-x@ to alice: "-" too.
    assert load_defaults(http_tools, {"subaddress_separators": "+-"}).status_code in (200, 201)
    assert acme().subaddress_separators == "+-"
    version = TenantPolicyVersion.objects.filter(tenant=acme()).order_by("-version").first()
    assert version.subaddress_separators == "+-"
    event = AuditEvent.objects.filter(tenant=acme(), kind="tenant.defaults").order_by("-pk").first()
    assert event.data["subaddress_separators"] == "+-" and event.data["changed"] == ["subaddress_separators"]
    for spelling in ("alice-x@example.com", "alice+x@example.com"):
        request = gated(http_tools, spelling)
        assert approve(http_tools, "alice", request).status_code == 403
        untouched(request)

    # A tenant whose server has no sub-addresses: alice+x@ is someone else's mailbox there.
    assert load_defaults(http_tools, {"subaddress_separators": ""}).status_code in (200, 201)
    request = gated(http_tools, "alice+x@example.com")
    assert approve(http_tools, "alice", request).status_code == 200
    still = gated(http_tools, "alice@ｅxample.com.")  # the other spellings are never the tenant's choice
    assert approve(http_tools, "alice", still).status_code == 403
    call_command("verify_audit")


def test_an_insider_who_switches_sub_addresses_off_is_caught(http_tools):
    call_command("verify_audit")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_tenant SET subaddress_separators = '' WHERE slug = 'acme'")
    with pytest.raises(CommandError, match=r"differ from their version .*\[check: policy\]"):
        call_command("verify_audit")
    with connection.cursor() as cursor:  # the newest version too, to match: its fingerprint no longer does
        cursor.execute("UPDATE ledger_tenantpolicyversion SET subaddress_separators = '' WHERE tenant_id = %s",
                       [Tenant.objects.get(slug="acme").pk])
    with pytest.raises(CommandError, match=r"\[check: fingerprint\]"):
        call_command("verify_audit")


@pytest.mark.parametrize("value,expected", [
    ("alice@example.com.", {"alice@example.com"}),
    ("alice+x@example.com", {"alice@example.com"}),
    ("alice@ｅxample.com", {"alice@example.com"}),
    ("alice@example。com", {"alice@example.com"}),
    ("alice@Bücher.example", {"alice@xn--bcher-kva.example"}),
    ("alice@xn--bcher-kva.example", {"alice@xn--bcher-kva.example"}),
    ('"alice+x"@example.com', {"alice@example.com"}),
    ("+alice@example.com", {"+alice@example.com"}),  # a separator that starts the local part starts no sub-address
    ("ＡＬＩＣＥ", {"alice"}),
    ("alice@[192.0.2.1]", {"alice@[192.0.2.1]"}),
])
def test_mailboxes_are_compared_the_way_mail_delivers(value, expected):
    assert mailboxes(value) == expected


def test_the_separators_and_the_case_are_the_tenants():
    assert mailboxes("alice+x@example.com", subaddress_separators="") == {"alice+x@example.com"}
    assert mailboxes("mary-jane@example.com", subaddress_separators="+-") == {"mary@example.com"}
    assert mailboxes("Alice+x@EXAMPLE.com.", local_part_case_sensitive=True) == {"Alice@example.com"}
