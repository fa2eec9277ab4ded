"""Issue 28: what five rules and two limits cost a proposal (target: under 0.3 ms more at p50).

Tools alike but for their policy, each proposed through `action_propose` (the service the API calls) with new
arguments every time, by turns so that all see the same machine, all on the default path (on PostgreSQL the
one-call proposal: the rules are decided in the process before it, the limits counted by it under its locks):
- `bench.plain`: no rules, no limits;
- `bench.rules_only`: five rules (none fires: the call runs without a person, as most calls do);
- `bench.run_limits`: the five rules and two limits on the run (a count and a sum), which hold the run's steps;
- `bench.ruled`: the five rules and two limits, a count per run and a sum per tenant within 24 hours, whose window
  holds every `bench.ruled` proposal of the measurement (0 to n + 20 of them; about n / 2 at the median);
- `bench.busy`: the same policy, its tenant's 24-hour window holding BUSY more steps, spread over the last day;
- `bench.plain` with UNWIND_FAST_PATH off: the Python path, for reference.

A limit per run reads the run's steps; per agent or per tenant it reads running totals kept by triggers
(`unwind_limits_used`, migration 0022): its cost should not grow with the steps in its window, which `busy` shows.
Alone: `python -m bench.rules` (BENCH_RULES_N proposals per case, default 300); in `make bench` it is part 7.
"""
from __future__ import annotations

import os
import sys
import time

from bench.common import QUICK, log, summary

SCHEMA = {"type": "object", "required": ["amount", "currency", "email"], "properties": {
    "amount": {"type": "integer"}, "currency": {"type": "string"}, "email": {"type": "string"},
    "n": {"type": "integer"}}}
PLAIN = {"executor": {"kind": "python", "path": "bench.noop.noop"}, "risk": "low", "saga_role": "retriable",
         "args_schema": SCHEMA, "compensation": "none"}
RULED = {**PLAIN, "rules": [
    {"when": "args.amount > 1000000", "risk": "high", "reason": "large amounts need a person"},
    {"when": "args.currency != 'EUR'", "deny": "EUR only"},
    {"when": "!args.email.endsWith('@example.com')", "approvals_required": 2, "reason": "outside the company"},
    {"when": "run.steps > 100000", "deny": "a run takes at most 100000 steps"},
    {"when": "agent.name == 'blocked' || args.n < 0", "deny": "not this agent"}],
    "limits": [{"per": "run", "count": 1000000}, {"per": "tenant", "sum": "args.amount", "max": 10**12, "window": "24h"}]}
RULES_ONLY = {**RULED, "limits": []}
RUN_LIMITS = {**RULED, "limits": [{"per": "run", "count": 1000000}, {"per": "run", "sum": "args.amount", "max": 10**12}]}
PER_RUN = 50
BUSY = int(os.environ.get("BENCH_RULES_BUSY", "2000" if QUICK else "20000"))


def measure(n: int) -> dict:
    from django.conf import settings
    from django.db import connection

    from bench.engine import tenant_with_tools
    from ledger.engine.proposal import action_propose
    from ledger.engine.runs import run_open
    from ledger.policy.versions import tool_upsert

    # A tenant of its own each time: the limits count only this measurement's steps (at most n of each tool).
    tenant, agent, _ = tenant_with_tools(slug=f"bench-rules-{int(time.time())}")
    tool_upsert(tenant=tenant, name="bench.plain", spec=PLAIN, actor="bench")
    tool_upsert(tenant=tenant, name="bench.ruled", spec=RULED, actor="bench")
    tool_upsert(tenant=tenant, name="bench.rules_only", spec=RULES_ONLY, actor="bench")
    tool_upsert(tenant=tenant, name="bench.run_limits", spec=RUN_LIMITS, actor="bench")
    tool_upsert(tenant=tenant, name="bench.busy", spec=RULED, actor="bench")
    busy = _fill_window(tenant, agent, "bench.busy", BUSY)
    fast = settings.UNWIND_FAST_PATH
    cases = {"plain": ("bench.plain", fast), "rules_only": ("bench.rules_only", fast),
             "run_limits": ("bench.run_limits", fast), "ruled": ("bench.ruled", fast), "busy": ("bench.busy", fast),
             "python": ("bench.plain", False)}
    runs = {case: None for case in cases}
    times: dict[str, list[float]] = {case: [] for case in cases}
    counter = 0
    for i in range(n + 20):  # the first 20 of each warm up (connections, compiled expressions, kept tools)
        for case, (tool, path) in cases.items():
            if i % PER_RUN == 0:
                runs[case] = run_open(tenant=tenant, agent=agent, goal="bench rules", actor="agent:bench")
            counter += 1
            args = {"amount": 100 + counter, "currency": "EUR", "email": f"u{counter}@example.com", "n": counter}
            settings.UNWIND_FAST_PATH = path
            started = time.perf_counter()
            proposal = action_propose(run=runs[case], tool_name=tool, args=args, actor="agent:bench")
            elapsed = time.perf_counter() - started
            settings.UNWIND_FAST_PATH = fast
            assert proposal.action.status == "running", proposal.action.status
            if i >= 20:
                times[case].append(elapsed)
    result = {case: summary(values) for case, values in times.items()}
    result["decide_rules_alone"] = decide_alone(n * 10)
    result["rules"], result["limits"] = len(RULED["rules"]), len(RULED["limits"])
    for case in ("rules_only", "run_limits", "ruled", "busy"):
        result[f"{case}_over_plain_p50_ms"] = round(result[case]["p50"] - result["plain"]["p50"], 3)
    result["counted_by_tenant_limit"] = n + 20  # its window holds every ruled proposal of this measurement
    result["busy_window"] = busy + n + 20
    result["path"] = "one call" if fast and connection.vendor == "postgresql" else "Python"
    return result


def _fill_window(tenant, agent, tool_name: str, count: int) -> int:
    """`count` succeeded steps of `tool_name`, PER_RUN to a finished run, created evenly over the last 24 hours: copies
    of one proposed step and its run, written in two statements."""
    if count <= 0:
        return 0
    from django.db import connection

    from ledger.engine.proposal import action_propose
    from ledger.engine.runs import run_open
    from ledger.models import Action, Run

    run = run_open(tenant=tenant, agent=agent, goal="bench rules: a busy day", actor="agent:bench")
    step = action_propose(run=run, tool_name=tool_name, args={"amount": 1, "currency": "EUR", "email": "u@example.com",
                                                                "n": 0}, actor="agent:bench").action
    run_columns = ", ".join(field.column for field in Run._meta.concrete_fields if field.column not in ("id", "status"))
    columns = ", ".join(field.column for field in Action._meta.concrete_fields
                        if field.column not in ("id", "run_id", "seq", "idempotency_key", "content_key", "created_at",
                                                "status"))
    with connection.cursor() as cursor:
        # Written in one transaction, the steps would leave one version of each total they move per step, all dead
        # at once, as a day of proposals never does: the tool's totals are dropped first, and built from the steps
        # at the first proposal (a warm-up), as when a limit is added.
        cursor.execute("DELETE FROM ledger_limittotal WHERE measure_id IN (SELECT id FROM ledger_limitmeasure"
                       " WHERE tenant_id = %s AND tool_name = %s)", [tenant.pk, tool_name])
        cursor.execute("DELETE FROM ledger_limitmeasure WHERE tenant_id = %s AND tool_name = %s", [tenant.pk, tool_name])
        cursor.execute(f"INSERT INTO ledger_run ({run_columns}, status) SELECT {run_columns}, 'completed'"
                       " FROM ledger_run, generate_series(1, %s) WHERE id = %s RETURNING id",
                       [-(-count // PER_RUN), run.pk])
        runs = [row[0] for row in cursor.fetchall()]
        cursor.execute(
            f"INSERT INTO ledger_action ({columns}, run_id, seq, idempotency_key, content_key, created_at, status)"
            f" SELECT {columns}, (%s::bigint[])[1 + (i - 1) / %s], 1 + (i - 1) %% %s, 'busy-' || i, 'busy-' || i,"
            " now() - make_interval(secs => 86000.0 * i / %s), 'succeeded'"
            " FROM ledger_action, generate_series(1, %s) i WHERE id = %s",
            [runs, PER_RUN, PER_RUN, count, count, step.pk])
        # A day's steps come with autovacuum's statistics of them; these came in a second, and PostgreSQL would plan
        # (and cache) its reads of them as of a table of a few rows until it next analyzes it.
        cursor.execute("ANALYZE ledger_action")
        cursor.execute("ANALYZE ledger_run")
    return count + 1


def decide_alone(n: int) -> dict:
    """The five rules' decision in the process alone (no database: limits left out), as `_record` makes it."""
    from ledger.engine import decision
    from ledger.models import Run, Tool
    from ledger.policy.tool_entry import parse_tool

    tool = Tool(name="bench.ruled", version=1, **parse_tool("bench.ruled", RULED, where="tools.bench.ruled"))
    run = Run(goal="bench rules", on_behalf_of="", next_seq=3)
    times = []
    for i in range(n):
        args = {"amount": 100 + i, "currency": "EUR", "email": f"u{i}@example.com", "n": i}
        started = time.perf_counter()
        decision.decide(tool=tool, run=run, args=args, threshold="high", count_limits=False, agent_name="bench")
        times.append(time.perf_counter() - started)
    return summary(times)


def lines(r: dict) -> list[str]:
    over = r["ruled_over_plain_p50_ms"]
    return [
        f"7. rules: a proposal on the {r.get('path', 'default')} path, p50 (p99): no rules {r['plain']['p50']:.2f} "
        f"({r['plain']['p99']:.2f}) ms; {r['rules']} rules {r['rules_only']['p50']:.2f} ({r['rules_only']['p99']:.2f}) ms; "
        f"with {r['limits']} limits on the run {r['run_limits']['p50']:.2f} ({r['run_limits']['p99']:.2f}) ms; with a "
        f"count per run and a 24-hour sum per tenant {r['ruled']['p50']:.2f} ({r['ruled']['p99']:.2f}) ms, the same "
        f"with {r['busy_window']} steps in the day {r['busy']['p50']:.2f} ({r['busy']['p99']:.2f}) ms "
        f"(the Python path without rules: {r['python']['p50']:.2f} ms)",
        f"   more than none: rules +{r['rules_only_over_plain_p50_ms']:.2f} ms, rules and run limits "
        f"+{r['run_limits_over_plain_p50_ms']:.2f} ms, rules and the tenant's 24-hour sum +{over:.2f} ms "
        f"(its window held 0 to {r['counted_by_tenant_limit']} steps), +{r['busy_over_plain_p50_ms']:.2f} ms with "
        f"{r['busy_window']} (target < 0.3 ms → {'met' if max(over, r['busy_over_plain_p50_ms']) < 0.3 else 'NOT met'})",
        f"   the five rules' decision in the process alone (CEL, no database): p50 "
        f"{r['decide_rules_alone']['p50'] * 1000:.0f} µs, p99 {r['decide_rules_alone']['p99'] * 1000:.0f} µs",
    ]


if __name__ == "__main__":
    from bench.common import django_setup

    django_setup(UNWIND_TASKS_SYNC="0")
    count = int(os.environ.get("BENCH_RULES_N", "300"))
    log(f"rules: {count} proposals of each kind, by turns")
    measured = measure(count)
    print("\n".join(lines(measured)))
    print(measured, file=sys.stderr)
