"""Issue 28: rules and limits in a tool's policy, checked when the policy is loaded and decided at proposal time.

Load-time refusals (a malformed expression, an expensive one, a bad limit) name the rule and the position; the
decision (ledger/engine/decision.py) is driven through the real services on the test database.
"""
from __future__ import annotations

import pytest

from ledger.policy import rules
from ledger.engine.decision import PolicyDenied
from ledger.errors import ValidationFailed
from ledger.models import Action, AuditEvent
from ledger.policy.versions import tool_upsert
from tests.helpers import act, open_run

REFUND = {
    "executor": "client", "saga_role": "retriable", "compensation": "none", "risk": "low",
    "args_schema": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string"},
                                                     "email": {"type": "string"}}},
    "display": {"amount": {"money": {"currency_from": "args.currency", "minor_units": 0}}},
    "rules": [
        {"when": "args.amount > 500", "risk": "high", "reason": "refunds above 500 need a person"},
        {"when": "args.currency != 'USD'", "deny": "only USD refunds are allowed"},
        {"when": "has(args.email) && !args.email.endsWith('@example.com')", "approvals_required": 2,
         "reason": "two people for mail outside the company"},
    ],
}


def upsert(world, spec, name="payments.refund"):
    return tool_upsert(tenant=world.acme, name=name, spec=spec, actor="test")


def refused_at_load(world, spec) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as caught:
        upsert(world, spec)
    return caught.value


def test_a_malformed_expression_is_refused_at_load_naming_the_rule_and_column(world):
    error = refused_at_load(world, {**REFUND, "rules": [REFUND["rules"][0], {"when": "args.amount > ", "deny": "no"}]})
    assert error.extra["field"] == "tools.payments.refund.rules[1].when" or "rules[1].when" in error.detail, error.detail
    assert "column 15" in error.detail and "Syntax error" in error.detail, error.detail
    error = refused_at_load(world, {**REFUND, "rules": [{"when": "secrets.key == 'x'", "deny": "no"}]})
    assert "rules[0].when" in error.detail and "undeclared reference to 'secrets.key'" in error.detail, error.detail
    error = refused_at_load(world, {**REFUND, "rules": [{"when": "args.amount + 1", "deny": "no"}]})
    assert "must be true or false" in error.detail


def test_an_expensive_expression_is_refused_at_load(world):
    nested = "args.ids.exists(x, args.ids.exists(y, x == y + 1))"
    error = refused_at_load(world, {**REFUND, "rules": [{"when": nested, "deny": "no"}]})
    assert "rules[0].when" in error.detail and "square" in error.detail, error.detail
    long = "||".join(f"args.a=={n}" for n in range(60))
    error = refused_at_load(world, {**REFUND, "rules": [{"when": long, "deny": "no"}]})
    assert "parts; an expression has at most" in error.detail, error.detail
    error = refused_at_load(world, {**REFUND, "rules": [{"when": "true" + " " * 1000, "deny": "no"}]})
    assert "characters long" in error.detail
    # One comprehension over an argument is linear, and allowed.
    upsert(world, {**REFUND, "rules": [{"when": "has(args.ids) && args.ids.exists(x, x == 1)", "deny": "no"}]})


@pytest.mark.parametrize("limit, field, words", [
    ({"per": "galaxy", "count": 1}, "limits[0].per", "must be one of run, agent, tenant"),
    ({"per": "run", "sum": "args.amount"}, "limits[0].max", "needs the most"),
    ({"per": "run", "sum": "amount", "max": 5}, "limits[0].sum", "must name a number among the arguments"),
    ({"per": "run", "count": 2, "sum": "args.amount", "max": 1}, "limits[0]", "one of them"),
    ({"per": "run", "count": 0}, "limits[0].count", "from 1"),
    ({"per": "run", "count": 3, "window": "soon"}, "limits[0].window", "duration"),
])
def test_a_bad_limit_is_refused_at_load(world, limit, field, words):
    error = refused_at_load(world, {**REFUND, "limits": [limit]})
    assert field in error.detail and words in error.detail, error.detail


def test_rules_decide_risk_people_and_refusals(tools):
    upsert(tools, REFUND)
    run = open_run(tools)
    small = act(run, "payments.refund", {"amount": 20, "currency": "USD"})
    assert small.status == "running" and small.risk == "low" and small.policy_decision["fired"] == []
    large = act(run, "payments.refund", {"amount": 750, "currency": "USD"})
    assert large.status == "awaiting_approval" and large.risk == "high" and large.approvals_required == 1
    assert large.policy_decision["fired"][0]["read"] == {"args.amount": 750}
    two = act(run, "payments.refund", {"amount": 30, "currency": "USD", "email": "x@elsewhere.test"})
    assert two.status == "awaiting_approval" and two.approvals_required == 2
    before = Action.objects.count(), AuditEvent.objects.filter(kind="forward.refused").count()
    with pytest.raises(PolicyDenied) as denied:
        act(run, "payments.refund", {"amount": 20, "currency": "EUR"})
    assert "only USD refunds are allowed" in denied.value.detail
    refused = Action.objects.get(pk=denied.value.extra["action_id"])
    assert refused.status == "failed" and refused.error_class == "refused" and refused.attempts == 0
    assert (Action.objects.count(), AuditEvent.objects.filter(kind="forward.refused").count()) == \
        (before[0] + 1, before[1] + 1)


def test_a_rule_that_cannot_be_evaluated_refuses(tools):
    upsert(tools, {**REFUND, "rules": [{"when": "!args.email.endsWith('@example.com')", "approvals_required": 2}]})
    run = open_run(tools)
    with pytest.raises(PolicyDenied) as denied:
        act(run, "payments.refund", {"amount": 20, "currency": "USD"})
    assert "could not be decided: the call has no field 'email'" in denied.value.detail, denied.value.detail


def test_a_shape_reads_the_argument_paths():
    _, shape = rules.compiled("args.a.b > 1 && run.goal == 'x' && args.ids.exists(i, i == agent.name)")
    assert shape.reads == {"args.a.b", "run.goal", "args.ids", "agent.name"}


def test_an_edit_of_why_a_person_was_asked_breaks_the_chain(tools):
    from django.db import connection

    from ledger.audit.verify import verify_chain

    upsert(tools, REFUND)
    large = act(open_run(tools), "payments.refund", {"amount": 750, "currency": "USD"})
    assert verify_chain(tools.acme.pk).ok
    with connection.cursor() as cursor:  # an insider's edit: the approver would read another reason
        cursor.execute("UPDATE ledger_action SET policy_decision = %s WHERE id = %s",
                       ['{"fired": [], "required": 1}', large.pk])
    assert not verify_chain(tools.acme.pk).ok
