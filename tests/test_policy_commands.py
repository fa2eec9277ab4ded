"""Issue 28: `policy_check` validates a policy file and shows the difference from the tenant's current policy;
`policy_try` prints what a tool's rules decide for some arguments. Neither writes anything."""
from __future__ import annotations

from io import StringIO

import pytest
import yaml
from django.apps import apps
from django.core.management import CommandError, call_command

from ledger.policy.versions import tools_load

POLICY = {"tools": {"payments.refund": {
    "executor": "client", "saga_role": "retriable", "compensation": "none", "risk": "low",
    "args_schema": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string"}}},
    "rules": [{"when": "args.amount > 500", "risk": "high", "reason": "refunds above 500 need a person"},
              {"when": "args.currency != 'USD'", "deny": "only USD refunds are allowed"}],
    "limits": [{"per": "run", "sum": "args.amount", "max": 1000}]}}}


def written(tmp_path, document, name="policy.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return str(path)


def run(command, *args, **options) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def every_row() -> dict:
    return {model._meta.label: model.objects.count() for model in apps.get_models()
            if model._meta.app_label in ("ledger", "approvals", "recovery")}


def test_policy_check_validates_and_shows_the_difference(world, tmp_path):
    tools_load(tenant=world.acme, document=POLICY, actor="test")
    changed = {"tools": {"payments.refund": {**POLICY["tools"]["payments.refund"], "rules": [
        POLICY["tools"]["payments.refund"]["rules"][0],
        {"when": "args.currency != 'EUR'", "deny": "only EUR refunds are allowed"}]}}}
    before = every_row()
    out = run("policy_check", written(tmp_path, changed), tenant="acme")
    assert "~ payments.refund: version 1 → 2" in out, out
    assert "rules: - {\"deny\": \"only USD refunds are allowed\", \"when\": \"args.currency != 'USD'\"}" in out, out
    assert "rules: + {\"deny\": \"only EUR refunds are allowed\", \"when\": \"args.currency != 'EUR'\"}" in out, out
    assert "nothing was written" in out and every_row() == before
    assert "= payments.refund: unchanged (version 1)" in run("policy_check", written(tmp_path, POLICY), tenant="acme")
    broken = {"tools": {"payments.refund": {**POLICY["tools"]["payments.refund"],
                                            "rules": [{"when": "args.amount >", "deny": "no"}]}}}
    with pytest.raises(CommandError) as refused:
        run("policy_check", written(tmp_path, broken), tenant="acme")
    assert "tools.payments.refund.rules[0].when: column 14: Syntax error" in str(refused.value), refused.value


def test_policy_try_prints_the_decision_and_writes_nothing(world, tmp_path):
    path = written(tmp_path, POLICY)
    before = every_row()
    large = run("policy_try", path, tool="payments.refund", call_args='{"amount": 750, "currency": "USD"}')
    assert "payments.refund: needs 1 approval (risk high)" in large
    assert "needs a person: refunds above 500 need a person — amount is 750" in large
    assert 'rule 1 fired: args.amount > 500  read {"args.amount": 750}' in large
    denied = run("policy_try", path, tool="payments.refund", call_args='{"amount": 7, "currency": "EUR"}')
    assert "payments.refund: refused: only USD refunds are allowed" in denied
    small = run("policy_try", path, tool="payments.refund", call_args='{"amount": 7, "currency": "USD"}')
    assert "runs without approval (risk low)" in small and "no rule fired" in small
    assert every_row() == before
    with pytest.raises(CommandError, match="--args: args.amount"):
        run("policy_try", path, tool="payments.refund", call_args='{"amount": "lots"}')


def test_the_console_policy_page_shows_a_versions_rules_and_limits(world, client):
    from django.urls import reverse

    tools_load(tenant=world.acme, document=POLICY, actor="test")
    client.force_login(world.victor)  # a viewer reads the policy
    page = client.get(reverse("recovery:policy"), {"tenant": "acme", "tool": "payments.refund"})
    assert page.status_code == 200
    text = page.content.decode()
    assert "Rules and limits of this version" in text
    assert "when <code>args.amount &gt; 500</code>: risk high: refunds above 500 need a person" in text, text
    assert "when <code>args.currency != &#x27;USD&#x27;</code>: refuse: only USD refunds are allowed" in text
    assert "limit: args.amount adds up to at most 1000 per run" in text
