"""Issue 31, finding 4: a requester cannot approve under another spelling of their address.

`on_behalf_of` is compared with the approver's username and email the way mail compares addresses: parsed, domain
case-folded, local part case-folded unless the tenant's defaults say `local_part_case_sensitive: true`. Over HTTP
against a live server: alice's approvals are refused and nothing runs.
"""
from __future__ import annotations

import pytest
import requests

from approvals.addresses import mailboxes
from approvals.models import ApprovalRequest
from ledger.models import Action
from ledger.policy.versions import tenant_defaults_set
from sandbox.selectors import world_state
from tests.helpers import acme
from tests.test_agent_target import client, propose

CHARGE = {"customer": "cus_1", "amount_cents": 4900, "currency": "EUR"}


def gated(world, on_behalf_of: str) -> ApprovalRequest:
    agent = client(world)
    run = agent.post(f"{agent.base}/api/v1/runs", json={"goal": "pay", "on_behalf_of": on_behalf_of}, timeout=30)
    assert run.status_code == 201, run.text
    action = propose(agent, run.json()["id"], "payments.charge", CHARGE)
    assert action.status_code == 202 and action.json()["status"] == "awaiting_approval", action.text
    return ApprovalRequest.objects.get(action_id=action.json()["id"])


def approve(world, username: str, request: ApprovalRequest) -> requests.Response:
    return requests.post(f"{world.live_server.url}/api/v1/approvals/{request.pk}/approve", json={"reason": "ok"},
                         auth=(username, f"pw-{username}"), timeout=30)


@pytest.mark.parametrize("spelling", [
    "alice@example.com", "alice@EXAMPLE.com", "ALICE@example.com", "Alice <alice@example.com>",
    "  \"Alice A.\" <Alice@Example.COM> ", "alice", "ALICE", "bob@example.com, alice@example.com",
])
def test_alice_cannot_approve_under_any_spelling(http_tools, spelling):
    request = gated(http_tools, spelling)
    refused = approve(http_tools, "alice", request)
    assert refused.status_code == 403 and "someone else must decide" in refused.json()["detail"], refused.text
    request.refresh_from_db()
    assert request.status == "pending" and Action.objects.get(pk=request.action_id).status == "awaiting_approval"
    assert world_state(tenant=acme())["charges"] == []
    assert approve(http_tools, "ben", request).status_code == 200  # someone else may


def test_a_tenant_that_tells_local_parts_apart_says_so_in_its_defaults(http_tools):
    tenant_defaults_set(tenant=acme(), values={"local_part_case_sensitive": True}, actor="user:ada")
    request = gated(http_tools, "ALICE@example.com")
    assert approve(http_tools, "alice", request).status_code == 200
    still = gated(http_tools, "alice@EXAMPLE.com")  # the domain is never case-sensitive
    assert approve(http_tools, "alice", still).status_code == 403


def test_mailboxes_are_compared_the_way_mail_does():
    assert mailboxes("Alice <Alice@EXAMPLE.com>") == {"alice@example.com"}
    assert mailboxes("Alice <Alice@EXAMPLE.com>", local_part_case_sensitive=True) == {"Alice@example.com"}
    assert mailboxes("a@x.io, B@Y.io") == {"a@x.io", "b@y.io"}
    assert mailboxes("carol") == {"carol"} and mailboxes("") == set()
