"""Issue 28, property tests: a proposal's decision by its tool's rules and limits never depends on the order of the
argument keys, nor on the path that records it (on PostgreSQL the one-call proposal or the Python path; on SQLite
both runs take the Python path, so there it is the key order that is tested)."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from ledger.errors import UnwindError
from ledger.models import Action
from ledger.db.received import loads
from ledger.engine.proposal import action_propose
from ledger.policy.versions import tool_upsert
from tests.helpers import open_run
from tests.test_rules_policy import REFUND

SPEC = {**REFUND, "limits": [{"per": "run", "sum": "args.amount", "max": 1000}]}
amounts = st.one_of(st.integers(min_value=-10, max_value=2000), st.floats(min_value=0, max_value=2000),
                    st.sampled_from([500, 500.0, 500.5, 1000, "750"]))
arguments = st.fixed_dictionaries(
    {"amount": amounts, "currency": st.sampled_from(["USD", "EUR", "usd"])},
    optional={"email": st.sampled_from(["ana@example.com", "ana@elsewhere.test", ""]),
              "note": st.text(max_size=8)})


def decision(run, text: str) -> dict:
    """The proposal's outcome as the agent and the approver see it, from the args' JSON text as sent."""
    try:
        proposal = action_propose(run=run, tool_name="payments.refund", args=loads(text), actor="agent:booker")
    except UnwindError as refused:
        extra = dict(refused.extra)
        extra.pop("action_id", None)
        refused_step = Action.objects.filter(run=run).order_by("-seq").first()
        recorded = refused_step.policy_decision if refused_step is not None else None
        return {"refused": refused.code, "detail": refused.detail.split(". Nothing was done")[0], "extra": extra,
                "recorded": recorded}
    action = proposal.action
    return {"status": action.status, "risk": action.risk, "required": action.approvals_required,
            "recorded": action.policy_decision}


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=arguments, order=st.randoms(use_true_random=False), fast=st.booleans())
def test_a_decision_never_depends_on_key_order_or_path(tools, settings, args, order, fast):
    tool_upsert(tenant=tools.acme, name="payments.refund", spec=SPEC, actor="test")
    keys = list(args)
    shuffled = keys[:]
    order.shuffle(shuffled)
    settings.UNWIND_FAST_PATH = True
    first = decision(open_run(tools), json.dumps({key: args[key] for key in keys}))
    settings.UNWIND_FAST_PATH = fast
    second = decision(open_run(tools), json.dumps({key: args[key] for key in reversed(shuffled)}))
    assert first == second
