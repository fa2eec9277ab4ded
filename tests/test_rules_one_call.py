"""Issue 28 on PostgreSQL's one-call proposal: a tool with rules and limits is proposed in one call of
`unwind_propose`, its rules decided before the call from the run as the caller read it, its limits counted by the
call under the tenant's chain lock (`unwind_limits_used`, the statement the Python path counts with too).

What must hold: the call decides exactly as the Python path would (tests/test_parity.py compares whole ledgers),
writes nothing when the facts the rules were decided on moved (another step came first), and records what each
limit had used as the Python path records it. The race of two agents past one budget is tests/test_rules_http.py's,
over HTTP, through this path.
"""
from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from ledger.engine import decision, execution, fastpath, runsteps
from ledger.engine.proposal import action_propose
from ledger.errors import UnwindError
from ledger.models import Action, ActionStatus as A, Run
from ledger.policy.versions import tool_upsert
from tests.conftest import in_process_policy, needs_postgres
from tests.helpers import open_run

pytestmark = needs_postgres

HOTEL = {"guest": "G", "hotel": "H", "nights": 1}


@pytest.fixture(autouse=True)
def _fast_path_on(settings):
    settings.UNWIND_FAST_PATH = True


def _ruled(world, *, rules=(), limits=()):
    spec = dict(in_process_policy()["tools"]["travel.reserve_hotel"], rules=list(rules), limits=list(limits))
    tool, _ = tool_upsert(tenant=world.acme, name="travel.reserve_hotel", spec=spec, actor="user:ada")
    return tool


def _propose(run, args, **kwargs):
    return action_propose(run=run, tool_name="travel.reserve_hotel", args=args, actor="agent:booker", **kwargs)


def _finish(proposal):
    execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)


def test_a_ruled_tool_kept_by_the_process_is_proposed_in_one_statement(tools):
    _ruled(tools, rules=[{"when": "args.nights > 10", "risk": "critical", "reason": "long stays"}],
           limits=[{"per": "run", "sum": "args.nights", "max": 5, "window": "1h"}, {"per": "tenant", "count": 50}])
    run = open_run(tools, goal="one call")
    _finish(_propose(run, {**HOTEL, "nights": 2}))  # reads the tool, keeps it, draws the next id
    with CaptureQueriesContext(connection) as queries:
        proposal = _propose(run, {**HOTEL, "hotel": "H2", "nights": 3})
    statements = [q["sql"] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]]  # the test's transaction
    assert len(statements) == 1 and "public.unwind_propose(" in statements[0]
    assert proposal.claimed and proposal.action.status == A.RUNNING
    stored = Action.objects.get(pk=proposal.action.pk).policy_decision
    assert stored == proposal.action.policy_decision  # what the caller holds is what the call wrote
    assert [(limit["used"], limit["asks"]) for limit in stored["limits"]] == [(2, 3), (1, 1)]
    assert stored["fired"] == [] and stored["risk"] == "medium" and stored["required"] == 0


def test_a_step_over_its_budget_is_refused_by_the_python_path_and_nothing_is_sent(tools):
    _ruled(tools, limits=[{"per": "run", "sum": "args.nights", "max": 3}])
    run = open_run(tools, goal="budget")
    _finish(_propose(run, {**HOTEL, "nights": 2}))
    edge = _propose(run, {**HOTEL, "hotel": "H2", "nights": 1})  # exactly the budget: the call takes it
    assert edge.claimed and edge.action.policy_decision["limits"][0]["used"] == 2
    _finish(edge)
    with CaptureQueriesContext(connection) as queries, pytest.raises(decision.PolicyDenied) as refused:
        _propose(run, {**HOTEL, "hotel": "H3", "nights": 1})
    assert "the budget on nights is 3 per run: 3 is already spent" in str(refused.value.detail)
    assert any("public.unwind_propose(" in q["sql"] for q in queries.captured_queries)  # tried, handed over
    refusal = Action.objects.get(run=run, seq=3)
    assert refusal.status == A.FAILED and refusal.error_class == decision.REFUSED and refusal.attempts == 0
    assert not refusal.attempt_set.exists()  # no attempt: nothing reached the tool


def test_rules_decided_on_a_step_count_that_moved_are_decided_again(tools):
    """The caller's copy of the run says no step was taken; another proposal took one first. A rule that reads
    `run.steps` must see the count under the lock: the call writes nothing, and the Python path refuses."""
    _ruled(tools, rules=[{"when": "run.steps >= 1", "deny": "one reservation per run"}])
    run = open_run(tools, goal="steps")
    # Read with its steps before the first step, as a second process would hold it (a copy without them is read
    # again with them before the decision, and never goes stale this way).
    stale, _ = runsteps.run_with_steps(run.pk)
    _finish(_propose(run, {**HOTEL, "nights": 1}))
    assert stale.next_seq == 1
    with CaptureQueriesContext(connection) as queries, pytest.raises(decision.PolicyDenied) as refused:
        _propose(stale, {**HOTEL, "hotel": "H2", "nights": 1})
    assert "one reservation per run" in str(refused.value.detail)
    assert any("public.unwind_propose(" in q["sql"] for q in queries.captured_queries)
    assert list(Action.objects.filter(run=run).order_by("seq").values_list("status", flat=True)) == [
        A.SUCCEEDED, A.FAILED]


def test_two_proposals_racing_past_a_run_budget_on_the_call_leave_one(tools, transactional_db):
    """Threads on their own connections, each through the one call: the limit is counted under the tenant's lock,
    so of two proposals that each fit alone only one is recorded as acting."""
    _ruled(tools, limits=[{"per": "tenant", "sum": "args.nights", "max": 2}])
    runs = [open_run(tools, goal=f"race {i}") for i in range(2)]
    barrier, answers = threading.Barrier(2), []

    def propose(run, hotel):
        from django.db import connections

        try:
            barrier.wait()
            answers.append(_propose(run, {**HOTEL, "hotel": hotel, "nights": 2}, queued=True).action.status)
        except UnwindError as error:
            answers.append(error.code)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=propose, args=(run, f"R{i}")) for i, run in enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(map(str, answers)) == ["policy_denied", "running"]
    acting = Action.objects.filter(tenant=tools.acme, tool__name="travel.reserve_hotel", status=A.RUNNING)
    assert acting.count() == 1
    assert fastpath.usable(tools.acme.pk)
