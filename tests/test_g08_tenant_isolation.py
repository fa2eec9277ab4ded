"""Guarantee 8 at the service level: nothing of tenant A is reachable through tenant B.

The HTTP matrix (every endpoint as each persona of B against A's objects → 404) lives with the API tests.
"""
import pytest

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.errors import PermissionDenied, UnknownTool
from ledger.models import Action
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_open
from ledger.tenancy import agent_authenticate
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from recovery.services import recovery_close
from tests.helpers import act, fault, open_run


def test_keys_authenticate_to_their_own_tenant_only(tools):
    assert agent_authenticate(tools.key).tenant == tools.acme
    assert agent_authenticate(tools.other_key).tenant == tools.globex
    forged = tools.key[:-4] + "AAAA"
    assert agent_authenticate(forged) is None


def test_idempotency_keys_are_per_tenant(tools):
    a = act(open_run(tools), "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1}, key="same")
    run_b = run_open(tenant=tools.globex, agent=tools.other_agent, actor="agent:intruder")
    b = act(run_b, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1}, key="same")
    assert a.pk != b.pk and a.result != b.result  # the shared downstream service saw two keys
    assert a.tool_key != b.tool_key
    assert Action.objects.filter(idempotency_key="same").count() == 2


def test_a_run_only_sees_its_own_tenants_tools(tools):
    tool_upsert(tenant=tools.globex, name="globex.secret", spec={"executor": "client"}, actor="test")
    with pytest.raises(UnknownTool):
        action_propose(run=open_run(tools), tool_name="globex.secret", args={}, actor="agent:booker")


def test_people_of_another_tenant_cannot_decide_or_resolve(tools):
    run = open_run(tools)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    charge = act(run, "payments.charge", {"customer": "c", "amount_cents": 1})
    with pytest.raises(PermissionDenied):
        approval_decide(request=ApprovalRequest.objects.get(action=charge), user=tools.mallory, approve=True)
    other = open_run(tools)
    act(other, "hr.create_user", {"email": "a@x.io", "name": "A"})
    fault("hr.delete_user", "status", status=400)
    fault("travel.reserve_hotel", "status", status=400)
    act(other, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    item = RecoveryItem.objects.get(run=other)
    with pytest.raises(PermissionDenied):
        recovery_close(item=item, user=tools.mallory, reason="not mine")
    item.refresh_from_db()
    assert item.status == "open"
