"""Limits on a tool: budgets and rates, counted from the ledger under the tenant's lock.

    limits:
      - {per: run, sum: "args.amount", max: 1000}                  # a budget per run
      - {per: agent, count: 20, window: 1h}                        # a rate per agent
      - {per: tenant, sum: "args.amount", max: 20000, window: 24h}

A limit counts the tool's forward steps (by name, every version) in its scope (`per`: the run, the run's agent, the
tenant), within `window` when it has one (else for all time), that acted or may still act: waiting for approval,
approved, held (waiting out its tool's undo window), running, scheduled to retry, succeeded, with an unknown
outcome, compensating, or whose undo failed. A step that was refused, rejected, expired, skipped, failed or
compensated did nothing that stands, so it gives its share back. `count: N` lets at most N such steps be; `sum:
"args.<path>", max: M` lets their values at that path add up to at most M (the new call's value included), each a
number of at least 0: a call whose value is missing, not a number or below 0 is refused.

Counted inside the proposal's transaction, after the tenant's chain lock (`ledger_transaction`, which every writer
of the tenant takes first): two proposals racing past a budget are counted one after the other, and only one wins.
On PostgreSQL a limit per agent or per tenant reads running totals that triggers keep as steps move (migration
0022, `unwind_limits_used`), so its cost does not grow with the traffic it limits; SQLite reads the steps.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.utils import timezone

from ledger.db import sql
from ledger.policy.checks import duration, fail, number
from ledger.models import ActionKind, ActionStatus as A, LimitMeasure, LimitTotal, Run

MAX_LIMITS = 8
LIMIT_KEYS = {"per", "sum", "count", "max", "window"}
SCOPES = ("run", "agent", "tenant")
WINDOW_SECONDS = (1, 366 * 86400)
MAX_AMOUNT = 10**15
PATH = re.compile(r"^args(\.[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)*)+$")  # KT splits on "__": no part holds one
# Steps that acted or may still act: they hold their share of a limit.
# On PostgreSQL the triggers that keep the running totals per agent and per tenant hold the same list (migration
# 0022 and any later one that changes it); tests/test_limit_totals.py fails when the two differ.
COUNTED = (A.PLANNED, A.AWAITING_APPROVAL, A.APPROVED, A.HELD, A.RUNNING, A.RETRY_SCHEDULED, A.SUCCEEDED, A.LOST,
           A.COMPENSATING, A.COMPENSATION_FAILED)


def parse_limits(value: Any, *, where: str) -> list[dict]:
    """A tool's `limits`, validated, as stored on its version: {per, count | sum + max, window (seconds)}."""
    if value in (None, []):
        return []
    if not isinstance(value, list):
        fail(where, f"must be a list of limits ({{per, count | sum and max, window}}), not {type(value).__name__}")
    if len(value) > MAX_LIMITS:
        fail(where, f"has {len(value)} limits; a tool has at most {MAX_LIMITS}")
    parsed = []
    for index, spec in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(spec, dict):
            fail(at, f"must be an object like {{per: run, sum: \"args.amount\", max: 1000}}, not {type(spec).__name__}")
        unknown = set(spec) - LIMIT_KEYS
        if unknown:
            fail(f"{at}.{sorted(unknown)[0]}", f"is not a limit setting (known: {', '.join(sorted(LIMIT_KEYS))})")
        per = spec.get("per")
        if per not in SCOPES:
            fail(f"{at}.per", f"must be one of {', '.join(SCOPES)}, not {per!r}")
        limit: dict = {"per": per}
        if ("sum" in spec) == ("count" in spec):
            fail(at, "counts calls (count: N) or adds up an argument (sum: \"args.amount\" with max): one of them")
        if "count" in spec:
            if "max" in spec:
                fail(f"{at}.max", "goes with sum; a count limit's number is count itself")
            limit["count"] = number(spec["count"], f"{at}.count", minimum=1, maximum=MAX_AMOUNT, integer=True)
        else:
            path = spec["sum"]
            if not isinstance(path, str) or not PATH.match(path):
                fail(f"{at}.sum", f"must name a number among the arguments, like \"args.amount\", not {path!r}")
            if "max" not in spec:
                fail(f"{at}.max", "a sum limit needs the most the values may add up to")
            limit["sum"] = path
            limit["max"] = number(spec["max"], f"{at}.max", minimum=0, maximum=MAX_AMOUNT)
            if float(limit["max"]).is_integer():
                limit["max"] = int(limit["max"])
        if "window" in spec:
            limit["window"] = int(duration(spec["window"], f"{at}.window", minimum=WINDOW_SECONDS[0],
                                            maximum=WINDOW_SECONDS[1]))
        parsed.append(limit)
    return parsed


@dataclass
class Counted:
    """One limit as it stands for a proposal: `used` before it, what it `asks`, the `room` it needs (`asked`), and
    the `refusal` if over."""

    limit: dict
    used: Decimal
    asks: Decimal | None
    room: Decimal | None = None
    refusal: str = ""

    def as_record(self) -> dict:
        return {**self.limit, "used": plain(self.used), "asks": None if self.asks is None else plain(self.asks),
                **({"refused": self.refusal} if self.refusal else {})}


def plain(number: Decimal):
    """A Decimal as the record keeps it: an int when whole, else a float."""
    return int(number) if number == number.to_integral_value() else float(number)


def _value_at(path: str, args: dict):
    value: Any = {"args": args}
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def amount_of(path: str, args: dict) -> Decimal | None:
    """The call's value at `path` as a Decimal, or None when it is missing, not a number, or below 0."""
    value = _value_at(path, args)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = Decimal(str(value))
    return number if number >= 0 else None


def scope_words(limit: dict) -> str:
    per = {"run": "per run", "agent": "per agent", "tenant": "for the tenant"}[limit["per"]]
    window = limit.get("window")
    return f"{per} in {_duration_words(window)}" if window else per


def _duration_words(seconds: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0 and seconds >= size:
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}" if count != 1 else f"1 {unit}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def specs(limits: list[dict]) -> list[dict]:
    """The limits as `unwind_limits_used` counts them: [{per, path (the sum's path after "args", or None), window}]."""
    return [{"per": limit["per"], "path": limit["sum"].split(".")[1:] if "sum" in limit else None,
             "window": limit.get("window")} for limit in limits]


def used_by(limits: list[dict], *, tool_name: str, run: Run, now) -> list[Decimal]:
    """How many of the tool's steps in each limit's scope and window acted or may still act (`count`), or what their
    values at the limit's path add up to (`sum`: values that are numbers of at least 0; anything else counts 0).

    PostgreSQL: one call of `unwind_limits_used` (ledger/engine/plpgsql), the statement `unwind_propose` counts with
    too. SQLite: one statement per limit, its JSON read as Python numbers, added up here as Decimals (the same sum)."""
    if connection.vendor == "postgresql":
        used = sql.fetch_one("SELECT public.unwind_limits_used(%s::bigint, %s::bigint, %s::text, %s::jsonb,"
                             " %s::text[], %s::timestamptz)",
                             [run.tenant_id, run.pk, tool_name, json.dumps(specs(limits)), list(COUNTED), now])[0]
        return [Decimal(value) for value in used]
    return [_counted_sqlite(limit, tool_name=tool_name, run=run, now=now) for limit in limits]


def keep_totals_of(limits: list[dict], *, tenant_id: int, tool_name: str) -> None:
    """Make the running totals (PostgreSQL's, migration 0022) those the tool's new current version's `limits` read,
    when the version is written, under the tenant's chain lock: the totals it no longer reads are dropped, and those
    of a limit per agent or per tenant it adds are built from the ledger now (`unwind_limit_measure`), in the policy
    write rather than in the first proposal that counts them. A tenant's totals are then those of its tools' current
    limits only: what lets the trigger on a new step look only at steps whose own policy has such a limit, and what
    makes a limit added again count from the ledger, not from totals that missed steps."""
    read = {(limit["per"], limit["sum"].split(".", 1)[1] if "sum" in limit else "") for limit in limits}
    stale = [pk for pk, per, path in LimitMeasure.objects.filter(tenant_id=tenant_id, tool_name=tool_name)
             .values_list("pk", "per", "path") if (per, path) not in read]
    if stale:
        LimitTotal.objects.filter(measure_id__in=stale).delete()
        LimitMeasure.objects.filter(pk__in=stale).delete()
    if connection.vendor == "postgresql":
        for spec in specs([limit for limit in limits if limit["per"] != "run"]):
            sql.fetch_one("SELECT public.unwind_limit_measure(%s::bigint, %s::text, %s::text, %s::text[], %s::text[])",
                          [tenant_id, tool_name, spec["per"], spec["path"], list(COUNTED)])


def _counted_sqlite(limit: dict, *, tool_name: str, run: Run, now) -> Decimal:
    where = ["a.tool_id IN (SELECT t.id FROM ledger_tool t WHERE t.tenant_id = %s AND t.name = %s)",
             "a.kind = %s", f"a.status IN ({', '.join(['%s'] * len(COUNTED))})"]
    params: list = [run.tenant_id, tool_name, ActionKind.FORWARD, *COUNTED]
    if limit["per"] == "run":
        where.append("a.run_id = %s")
        params.append(run.pk)
    elif limit["per"] == "agent":
        where.append("a.run_id IN (SELECT r.id FROM ledger_run r WHERE r.tenant_id = %s AND "
                     + ("r.agent_id = %s)" if run.agent_id else "r.agent_id IS NULL)"))
        params.extend([run.tenant_id, run.agent_id] if run.agent_id else [run.tenant_id])
    if limit.get("window"):
        where.append("a.created_at >= %s")
        params.append(now - timedelta(seconds=limit["window"]))
    condition = " AND ".join(where)
    if "count" in limit:
        return Decimal(sql.fetch_one(f"SELECT count(*) FROM ledger_action a WHERE {condition}", params)[0])
    path = "$." + ".".join(limit["sum"].split(".")[1:])
    values = sql.fetch_all(
        f"SELECT json_extract(a.args, %s) FROM ledger_action a WHERE {condition}"
        " AND json_type(a.args, %s) IN ('integer', 'real')", [path, *params, path])
    return sum((number for (value,) in values for number in [Decimal(str(value))] if number >= 0), Decimal(0))


def asked(limits: list[dict], args: dict) -> list[tuple[Decimal | None, Decimal | None]]:
    """What the call asks of each limit and the room it needs: the most the limit may have used before it and still
    let it through (`used > room` refuses; the one comparison of both paths, handed to `unwind_propose`). (None,
    None) for a sum whose value in this call is missing, not a number or below 0: refused, whatever was used."""
    results = []
    for limit in limits:
        if "count" in limit:
            results.append((Decimal(1), Decimal(limit["count"]) - 1))
            continue
        asks = amount_of(limit["sum"], args)
        results.append((asks, None if asks is None else Decimal(str(limit["max"])) - asks))
    return results


def count(limits: list[dict], *, tool_name: str, run: Run, args: dict, used: list[Decimal] | None = None) -> list[Counted]:
    """Each limit as it stands for this call, read from the ledger inside the caller's locked transaction; or from
    `used` when given (zeros: what the call asks whatever was used, before the one-call proposal, `decision.in_one_call`)."""
    if used is None:
        used = used_by(limits, tool_name=tool_name, run=run, now=timezone.now())
    results = []
    for limit, spent, (asks, room) in zip(limits, used, asked(limits, args)):
        counted = Counted(limit, spent, asks, room)
        if "count" in limit:
            if spent > room:
                counted.refusal = (f"at most {limit['count']} call{'s' if limit['count'] != 1 else ''} of "
                                   f"{tool_name} {scope_words(limit)}, and {plain(spent)} already acted or may act")
        else:
            name = limit["sum"].split(".", 1)[1]
            if asks is None:
                counted.refusal = (f"the budget on {name} ({plain(Decimal(str(limit['max'])))} {scope_words(limit)}) "
                                   f"needs {name} to be a number of at least 0, and this call's is not")
            elif spent > room:
                counted.refusal = (f"the budget on {name} is {limit['max']} {scope_words(limit)}: {plain(spent)} is "
                                   f"already spent or may be, and this call asks {plain(asks)}")
        results.append(counted)
    return results
