"""Issue 28 on PostgreSQL: a limit per agent or per tenant reads running totals, not every step in its window.

What must hold: the totals say exactly what reading the steps says (this file's `reference`: the steps of the tool
in the scope and window whose status is in limits.COUNTED, counted or added up in Python), whatever moves the steps
made after the totals were first built (recorded, moved in or out of the counted statuses, deleted as archiving
deletes them, a run's agent changed),
for any window and any moment. The triggers that keep them hold their own list of the counted statuses (migration
0022): a status they disagree on with limits.COUNTED fails here.

The steps are written straight to the table, marked `totalled` as the engine marks a step of a tool with such
limits: the triggers, not the engine, keep the totals. What the engine adds: a tool version that drops a limit
drops its totals, and one that adds it again builds them from the ledger and marks the steps proposed meanwhile.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from ledger.models import Action, ActionKind, ActionStatus, LimitMeasure, LimitTotal, Run
from ledger.policy import limits
from ledger.tenancy import agent_create
from tests.conftest import needs_postgres
from tests.helpers import open_run

pytestmark = needs_postgres

TOOL = "travel.reserve_hotel"
BASE = datetime(2026, 11, 20, 9, 59, 30, 250000, tzinfo=dt_timezone.utc)
WINDOWS = [None, 1, 45, 60, 90, 3600, 3600 + 61, 86400, 86400 + 3600 * 5 + 17, 3 * 86400]
AMOUNTS = [0, 1, 2.5, 0.01, 1000, 123456789.123456789, -5, "12", None, True, {"nested": 1}]


def _limits(window):
    spec = {} if window is None else {"window": window}
    return [{"per": "agent", "count": 10**6, **spec}, {"per": "tenant", "count": 10**6, **spec},
            {"per": "agent", "sum": "args.amount", "max": 10**12, **spec},
            {"per": "tenant", "sum": "args.amount", "max": 10**12, **spec}]


def reference(limit: dict, *, run: Run, now) -> Decimal:
    """What the limit has used, read from the steps in Python: the definition the totals must meet."""
    steps = Action.objects.filter(tenant_id=run.tenant_id, tool__name=TOOL, kind=ActionKind.FORWARD,
                                  status__in=limits.COUNTED).select_related("run")
    if limit["per"] == "agent":
        steps = [step for step in steps if step.run.agent_id == run.agent_id]
    if limit.get("window"):
        steps = [step for step in steps if step.created_at >= now - timedelta(seconds=limit["window"])]
    if "count" in limit:
        return Decimal(len(steps))
    return sum((amount for step in steps for amount in [limits.amount_of(limit["sum"], step.args)] if amount is not None),
               Decimal(0))


class Ledger:
    """Steps of TOOL in three runs (two agents and none), written as rows."""

    def __init__(self, world, now=None):
        self.tool = world.acme.tools.get(name=TOOL, is_current=True)
        second, _ = agent_create(tenant=world.acme, name="second")
        self.agents = [world.agent, second, None]
        self.runs = [open_run(world, goal="one"), open_run(world, goal="two"), open_run(world, goal="none")]
        Run.objects.filter(pk=self.runs[1].pk).update(agent=second)
        Run.objects.filter(pk=self.runs[2].pk).update(agent=None)
        for run in self.runs:
            run.refresh_from_db()
        self.steps: list[int] = []
        # A moment in the past: a step the triggers left where the insert put it (now) would count in every window.
        self.now = now or BASE

    def add(self, run: int, amount, status: str, seconds_ago: int) -> None:
        run = self.runs[run]
        args = {"guest": "G", "hotel": "H", "nights": 1, **({} if amount is None else {"amount": amount})}
        seq = len(self.steps) + 1
        created_at = Action._meta.get_field("created_at")
        created_at.auto_now_add = False  # recorded at the moment the example says, as the engine records it at its own
        try:
            step = Action.objects.create(tenant_id=run.tenant_id, run=run, seq=seq, tool=self.tool,
                                         saga_role=self.tool.saga_role, risk="low", args=args, args_hash="-",
                                         idempotency_key=f"step-{seq}", status=status, totalled=True,
                                         created_at=self.now - timedelta(seconds=seconds_ago))
        finally:
            created_at.auto_now_add = True
        self.steps.append(step.pk)

    def check(self, window, *, later: int = 0) -> None:
        now = self.now + timedelta(seconds=later)
        for run in self.runs:
            asked = _limits(window)
            used = limits.used_by(asked, tool_name=TOOL, run=run, now=now)
            assert used == [reference(limit, run=run, now=now) for limit in asked], (window, later, run.goal)


def _rolled_back(test):
    """Each example in a transaction of its own, rolled back: the next starts from the same ledger."""
    def wrapped(*args, **kwargs):
        with transaction.atomic():
            test(*args, **kwargs)
            transaction.set_rollback(True)
    return wrapped


def test_a_step_counts_in_the_totals_exactly_when_its_status_is_one_limits_counts(tools):
    ledger = Ledger(tools)
    ledger.check(None)  # builds the totals (none yet): from here on only the triggers keep them
    for status in ActionStatus.values:
        ledger.add(0, 2, status, 30)
        ledger.check(None)
        ledger.check(3600)
    first = ledger.steps[0]
    for status in [*ActionStatus.values, *reversed(ActionStatus.values)]:  # every move in and out, by UPDATE
        Action.objects.filter(pk=first).update(status=status)
        ledger.check(None)
    counted = {status for status in ActionStatus.values if status in limits.COUNTED}
    assert ActionStatus.HELD in counted  # a held step may still act when its window ends
    used = limits.used_by(_limits(None), tool_name=TOOL, run=ledger.runs[0], now=ledger.now)
    assert used[0] == len(counted)  # the moved one ended where it started (planned)


def test_a_compensation_never_counts(tools):
    ledger = Ledger(tools)
    ledger.check(None)
    ledger.add(0, 3, ActionStatus.SUCCEEDED, 5)
    Action.objects.filter(pk=ledger.steps[0]).update(kind=ActionKind.COMPENSATION)  # as if recorded as one
    LimitTotal.objects.all().delete()
    LimitMeasure.objects.all().delete()  # built again from the ledger: the fill skips it
    ledger.check(None)
    ledger.add(0, 4, ActionStatus.SUCCEEDED, 5)
    Action.objects.filter(pk=ledger.steps[0]).update(status=ActionStatus.COMPENSATED)  # a move of no forward step
    ledger.check(None)
    assert limits.used_by(_limits(None), tool_name=TOOL, run=ledger.runs[0], now=ledger.now)[:3:2] == [1, 4]


def test_a_run_whose_agent_changed_is_counted_for_its_new_agent(tools):
    ledger = Ledger(tools)
    ledger.add(0, 5, ActionStatus.SUCCEEDED, 10)
    ledger.add(1, 7, ActionStatus.SUCCEEDED, 10)
    ledger.check(None)
    assert LimitMeasure.objects.filter(per="agent").count() == 2
    Run.objects.filter(pk=ledger.runs[0].pk).update(agent=None)  # as deleting its agent does
    ledger.runs[0].refresh_from_db()
    assert not LimitMeasure.objects.filter(per="agent").exists()  # dropped, to be built again
    ledger.check(None)
    ledger.check(60)


# Steps near a window's start, where it cuts a minute, an hour or a day in two, as well as anywhere in four days.
AGO = st.one_of(st.integers(0, 4 * 86400),
                st.builds(lambda window, off: max(0, window + off), st.sampled_from([w for w in WINDOWS if w]),
                          st.integers(-90, 90)))
LATER = st.one_of(st.sampled_from([0, 1, 29, 59, 61, 3599, 3601]), st.integers(-120, 3 * 86400))
def test_a_limit_dropped_and_added_again_counts_what_was_proposed_meanwhile(tools):
    """Steps proposed while the tool had no limit per tenant carry none in their policy decision, and no trigger
    counts them: the version that dropped the limit dropped its totals, so the version that adds it back builds them
    from the ledger."""
    from ledger.policy.versions import tool_upsert
    from tests.conftest import in_process_policy
    from tests.helpers import act

    def policy(limits):
        spec = dict(in_process_policy()["tools"][TOOL], limits=limits)
        tool_upsert(tenant=tools.acme, name=TOOL, spec=spec, actor="user:ada")

    budget = [{"per": "tenant", "sum": "args.nights", "max": 100}]
    policy(budget)
    run = open_run(tools, goal="budget")
    act(run, TOOL, {"guest": "G", "hotel": "H1", "nights": 3})
    assert LimitMeasure.objects.filter(tool_name=TOOL).count() == 1
    policy([])
    assert not LimitMeasure.objects.filter(tool_name=TOOL).exists()
    act(run, TOOL, {"guest": "G", "hotel": "H2", "nights": 4})  # no limit: counted by no trigger
    policy(budget)
    second = Action.objects.get(run=run, seq=2)
    assert second.totalled  # marked when the totals were built again
    third = act(run, TOOL, {"guest": "G", "hotel": "H3", "nights": 5})
    assert third.policy_decision["limits"][0]["used"] == 7
    assert limits.used_by(budget_limits := [{"per": "tenant", "sum": "args.nights", "max": 100}], tool_name=TOOL,
                          run=run, now=third.created_at) == [reference(budget_limits[0], run=run, now=third.created_at)]
    assert limits.used_by(budget_limits, tool_name=TOOL, run=run, now=third.created_at) == [Decimal(12)]
    Action.objects.filter(pk=second.pk).update(status=ActionStatus.COMPENSATED)  # gives its 4 back
    assert limits.used_by(budget_limits, tool_name=TOOL, run=run, now=third.created_at) == [Decimal(8)]


STEP = st.tuples(st.just("add"), st.integers(0, 2), st.sampled_from(AMOUNTS), st.sampled_from(ActionStatus.values), AGO)
MOVE = st.tuples(st.just("move"), st.integers(0, 40), st.sampled_from(ActionStatus.values))
AGENT = st.tuples(st.just("agent"), st.integers(0, 2), st.integers(0, 2))
DELETE = st.tuples(st.just("delete"), st.integers(0, 40))  # archived: a step leaves the hot table
READ = st.tuples(st.just("read"), st.sampled_from(WINDOWS), LATER)


@needs_postgres
@given(ops=st.lists(st.one_of(STEP, STEP, MOVE, AGENT, DELETE, READ), min_size=1, max_size=30),
       last=st.lists(st.tuples(st.sampled_from(WINDOWS), LATER), min_size=1, max_size=4),
       start=st.integers(0, 2 * 3600 * 1000))
@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_totals_say_what_reading_the_steps_says(tools, ops, last, start):
    @_rolled_back
    def example():
        ledger = Ledger(tools, BASE + timedelta(milliseconds=start))  # anywhere in two hours: minute and hour edges
        for op in ops:
            kind, *values = op
            if kind == "add":
                ledger.add(*values)
            elif kind == "read":
                ledger.check(values[0], later=values[1])
            elif ledger.steps and kind == "move":
                step = ledger.steps[values[0] % len(ledger.steps)]
                Action.objects.filter(pk=step).update(status=values[1])
            elif ledger.steps and kind == "delete":
                Action.objects.filter(pk=ledger.steps[values[0] % len(ledger.steps)]).delete()  # gone, seq kept
            elif kind == "agent":
                run = ledger.runs[values[0]]
                Run.objects.filter(pk=run.pk).update(agent=ledger.agents[values[1]])
                run.refresh_from_db()
        for window, later in last:
            ledger.check(window, later=later)
        # What the totals hold never drifts from a fresh build: drop them and count again.
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM ledger_limittotal WHERE value < 0")
            assert cursor.fetchone()[0] == 0
        LimitTotal.objects.all().delete()
        LimitMeasure.objects.all().delete()
        for window, later in last:
            ledger.check(window, later=later)

    example()
