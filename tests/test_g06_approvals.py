"""Guarantee 6: approvals bind to what was approved, expire, need someone other than the requester, and can need N people."""
from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import ApprovalRequest
from approvals.services import approval_decide, approvals_expire
from ledger.errors import PermissionDenied, StateConflict, ValidationFailed
from ledger.models import Action
from ledger.engine.actions import action_approve
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from sandbox.selectors import world_state
from tests.conftest import in_process_policy
from tests.helpers import acme, act, open_run


def propose_charge(world, run=None, amount=5000):
    run = run or open_run(world)
    act(run, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2026-12-01"})
    charge = act(run, "payments.charge", {"customer": "cus_1", "amount_cents": amount})
    return run, charge, ApprovalRequest.objects.get(action=charge)


def test_a_gated_action_waits_and_runs_after_approval(tools, django_capture_on_commit_callbacks):
    run, charge, request = propose_charge(tools)
    run.refresh_from_db()
    assert charge.status == "awaiting_approval" and run.status == "awaiting_approval"
    assert world_state(tenant=acme())["charges"] == []
    assert request.args_hash == charge.args_hash and request.preview["args"]["amount_cents"] == 5000
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=request, user=tools.alice, approve=True)
    charge.refresh_from_db()
    run.refresh_from_db()
    assert charge.status == "succeeded" and run.status == "running" and run.pivot_committed
    assert len(world_state(tenant=acme())["charges"]) == 1


def test_an_approval_for_other_arguments_does_not_apply(tools):
    _, charge, _ = propose_charge(tools)
    with pytest.raises(StateConflict):
        action_approve(action=charge, args_hash="0" * 64, actor="user:alice")
    charge.refresh_from_db()
    assert charge.status == "awaiting_approval"


def test_the_request_is_bound_to_the_args_hash_it_showed(tools):
    _, charge, request = propose_charge(tools)
    ApprovalRequest.objects.filter(pk=request.pk).update(args_hash="f" * 64)
    with pytest.raises(StateConflict):
        approval_decide(request=request, user=tools.alice, approve=True)
    assert Action.objects.get(pk=charge.pk).status == "awaiting_approval"


def test_the_requester_cannot_approve_their_own_request(tools):
    run = open_run(tools)
    run.on_behalf_of = "alice"
    run.save(update_fields=["on_behalf_of"])
    _, _, request = propose_charge(tools, run=run)
    with pytest.raises(PermissionDenied):
        approval_decide(request=request, user=tools.alice, approve=True)


def test_viewers_and_outsiders_cannot_decide(tools):
    _, _, request = propose_charge(tools)
    for user in (tools.victor, tools.mallory):
        with pytest.raises(PermissionDenied):
            approval_decide(request=request, user=user, approve=True)


def test_a_quorum_counts_distinct_people(tools, django_capture_on_commit_callbacks):
    spec = dict(in_process_policy()["tools"]["payments.charge"], approvals_required=2)
    tool_upsert(tenant=tools.acme, name="payments.charge", spec=spec, actor="test")
    _, charge, request = propose_charge(tools)
    approval_decide(request=request, user=tools.alice, approve=True)
    with pytest.raises(StateConflict):
        approval_decide(request=request, user=tools.alice, approve=True)
    assert Action.objects.get(pk=charge.pk).status == "awaiting_approval"
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=request, user=tools.ben, approve=True)
    assert Action.objects.get(pk=charge.pk).status == "succeeded"


def test_a_rejection_needs_a_reason_and_unwinds_before_the_pivot(tools, django_capture_on_commit_callbacks):
    run, charge, request = propose_charge(tools)
    with pytest.raises(ValidationFailed):
        approval_decide(request=request, user=tools.alice, approve=False, reason=" ")
    with django_capture_on_commit_callbacks(execute=True):
        approval_decide(request=request, user=tools.alice, approve=False, reason="Amount looks wrong")
    charge.refresh_from_db()
    run.refresh_from_db()
    assert charge.status == "rejected" and charge.decision_reason == "Amount looks wrong"
    assert run.status == "compensated"
    assert [f["status"] for f in world_state(tenant=acme())["flights"]] == ["cancelled"]


def test_an_expired_request_counts_as_a_rejection(tools, django_capture_on_commit_callbacks):
    run, charge, request = propose_charge(tools)
    with django_capture_on_commit_callbacks(execute=True):
        assert approvals_expire(now=timezone.now() + timedelta(hours=2)) == 1
    run.refresh_from_db()
    assert Action.objects.get(pk=charge.pk).status == "expired" and run.status == "compensated"
    with pytest.raises(StateConflict):
        approval_decide(request=request, user=tools.alice, approve=True)


def test_an_expiry_after_the_pivot_goes_to_the_recovery_queue(tools, django_capture_on_commit_callbacks):
    spec = dict(in_process_policy()["tools"]["email.send"], approval="manual")
    tool_upsert(tenant=tools.acme, name="email.send", spec=spec, actor="test")
    tools.acme.approval_threshold = "critical"
    tools.acme.save()
    run = open_run(tools)
    act(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    act(run, "email.send", {"to": "a@x.io", "subject": "Receipt", "body": "b"})
    with django_capture_on_commit_callbacks(execute=True):
        approvals_expire(now=timezone.now() + timedelta(hours=2))
    run.refresh_from_db()
    assert run.status == "needs_attention"
    assert RecoveryItem.objects.get(run=run).reason == "approval_expired"
    assert len(world_state(tenant=acme())["charges"]) == 1  # forward-only: the charge stands
