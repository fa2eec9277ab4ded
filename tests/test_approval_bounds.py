"""Issue 31, finding 6 (the bound): one agent cannot flood the people with approval requests.

A run, and an agent across its runs, have at most UNWIND_MAX_OPEN_APPROVALS_PER_RUN and _PER_AGENT steps waiting
for approval; a proposal past either is refused, 429 too_many_open_approvals, with nothing recorded and nobody
notified. Counted in the database, so a second web process agrees. Over HTTP against a live server.
"""
from __future__ import annotations

import requests

from approvals.models import ApprovalRequest, Notification
from ledger.models import Action, AuditEvent
from tests.test_agent_target import client, open_run, propose
from tests.test_args_as_sent import put_tool


def charge(n: int) -> dict:
    return {"to": f"IBAN {n}", "amount_cents": 1000 + n}


def test_open_approvals_are_bounded_per_run_and_per_agent(http_tools, settings):
    settings.UNWIND_MAX_OPEN_APPROVALS_PER_RUN = 2
    settings.UNWIND_MAX_OPEN_APPROVALS_PER_AGENT = 3
    put_tool(http_tools, "payments.payout", {"executor": "client", "approval": "manual", "saga_role": "retriable",
                                             "args_schema": {"type": "object"}, "compensation": "none"})
    agent = client(http_tools)
    first_run, second_run = open_run(agent), open_run(agent)
    for n in range(2):
        assert propose(agent, first_run, "payments.payout", charge(n)).status_code == 202
    actions, events, notices = Action.objects.count(), AuditEvent.objects.count(), Notification.objects.count()

    refused = propose(agent, first_run, "payments.payout", charge(2))
    assert refused.status_code == 429 and refused.headers["Content-Type"].startswith("application/problem+json")
    body = refused.json()
    assert body["code"] == "too_many_open_approvals" and body["scope"] == "run" and body["limit"] == 2, body
    assert "2 steps waiting for approval" in body["detail"] and refused.headers["Retry-After"] == "60"
    assert (Action.objects.count(), AuditEvent.objects.count(), Notification.objects.count()) == \
        (actions, events, notices)

    assert propose(agent, second_run, "payments.payout", charge(3)).status_code == 202
    across = propose(agent, second_run, "payments.payout", charge(4))
    assert across.status_code == 429 and across.json()["scope"] == "agent" and across.json()["limit"] == 3
    assert ApprovalRequest.objects.filter(status="pending").count() == 3

    # A decision frees a place; a step that needs no approval is never bounded.
    request = ApprovalRequest.objects.filter(status="pending").order_by("pk").first()
    decided = requests.post(f"{http_tools.live_server.url}/api/v1/approvals/{request.pk}/approve",
                            json={"reason": "ok"}, auth=("ben", "pw-ben"), timeout=30)
    assert decided.status_code == 200, decided.text
    assert propose(agent, second_run, "payments.payout", charge(5)).status_code == 202
    assert propose(agent, open_run(agent), "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"}).status_code == 201
