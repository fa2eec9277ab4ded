"""Reads: every query the API makes, scoped to the caller's tenants — and for an agent, to its own runs.

An object outside the caller's tenants is indistinguishable from a missing one (`NotFound`, 404). Runs and
actions also take `agent_id`, which every caller passes explicitly: an agent's id keeps an agent to its own
runs (another agent's run in the same tenant is a 404 too), None is for people, who see their whole tenants.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import OuterRef, Q, QuerySet, Subquery

from ledger.db import sql
from ledger.db.partitions import recent
from ledger.engine import decision, runsteps
from ledger.errors import NotFound
from ledger.models import (
    ACTIVE_ACTION_STATUSES, RUN_FINAL, Action, ActionKind, ActionStatus, Attempt, AuditEvent, Checkpoint, ErasedRun,
    Executor, Run, Tenant, TenantPolicyVersion, Tool,
)
from ledger.policy.versions import policy_of_version

ACTION_RELATED = ("tool", "run")
# When the run's person's data was erased (recovery/erasure.py), or null: read with the run, in the same query.
ERASED_ON = Subquery(ErasedRun.objects.filter(run_id=OuterRef("pk")).values("erased_at")[:1])


def erased_on(run: Run, cache: dict | None = None):
    """When `run`'s person's data was erased, or None. A run that may still move was never erased (erasure takes
    settled runs only), so only a settled one is looked up, once per run per `cache`."""
    if hasattr(run, "erased_on"):
        return run.erased_on
    if run.status not in RUN_FINAL:
        return None
    cache = {} if cache is None else cache
    if run.pk not in cache:
        cache[run.pk] = ErasedRun.objects.filter(run_id=run.pk).values_list("erased_at", flat=True).first()
    return cache[run.pk]


def run_list(*, tenant_ids: list[int], agent_id: int | None, status: str | None = None, agent: str | None = None,
             since: datetime | None = None) -> QuerySet[Run]:
    runs = Run.objects.filter(tenant_id__in=tenant_ids).select_related("agent").annotate(erased_on=ERASED_ON)
    if agent_id is not None:
        runs = runs.filter(agent_id=agent_id)
    if status:
        runs = runs.filter(status=status)
    if agent:
        runs = runs.filter(agent__name=agent)
    if since:
        runs = runs.filter(created_at__gte=since)
    return runs


def run_get(*, tenant_ids: list[int], agent_id: int | None, run_id: int) -> Run:
    runs = Run.objects.filter(tenant_id__in=tenant_ids, pk=run_id)
    if agent_id is not None:
        runs = runs.filter(agent_id=agent_id)
    run = runs.select_related("agent", "tenant").annotate(erased_on=ERASED_ON).first()
    if run is None:
        raise NotFound(f"there is no run {run_id}")
    return run


def run_actions(run: Run) -> list[Action]:
    return list(run.actions.select_related(*ACTION_RELATED).order_by("seq"))


def run_checkpoints(run: Run) -> list[Checkpoint]:
    return list(run.checkpoints.filter(created_at__gte=recent(run.created_at)).order_by("id"))


def run_attempts(run: Run) -> QuerySet[Attempt]:
    """Every try of every step of `run` (forward steps and compensations), with the action and tool each tried."""
    return Attempt.objects.filter(action__run_id=run.pk, started_at__gte=recent(run.created_at)).select_related("action", "action__tool")


def run_events(run: Run) -> QuerySet[AuditEvent]:
    """The audit events the tenant's chain ties to `run` (its transitions and those of its actions)."""
    return AuditEvent.objects.filter(tenant_id=run.tenant_id, run_ref=run.pk, created_at__gte=recent(run.created_at))


def run_for_write(*, tenant_ids: list[int], agent_id: int | None, run_id: int) -> Run:
    """The run an agent writes to (a proposal), read with one written-once statement with its steps (kept on it for
    the proposal to decide from: ledger/engine/runsteps.py); relations load lazily."""
    run, _ = runsteps.run_with_steps(run_id)
    if run is None or run.tenant_id not in tenant_ids or (agent_id is not None and run.agent_id != agent_id):
        raise NotFound(f"there is no run {run_id}")
    return run


def action_reload(action: Action) -> Action:
    """The action as the ledger has it now (another thread may have executed it), with the tool it was loaded
    with and its run as it stands now: what an answer to its proposal shows."""
    action_columns, count = sql.columns(Action, "a")
    run_columns, _ = sql.columns(Run, "r")
    row = sql.fetch_one(f"SELECT {action_columns}, {run_columns} FROM ledger_action a JOIN ledger_run r"
                        " ON r.id = a.run_id WHERE a.id = %s AND a.tenant_id = %s", [action.pk, action.tenant_id])
    fresh = sql.instance(Action, row)
    fresh.tool = action.tool
    fresh.run = sql.instance(Run, row[count:])
    return fresh


def action_get(*, tenant_ids: list[int], agent_id: int | None, action_id: int) -> Action:
    actions = Action.objects.filter(tenant_id__in=tenant_ids, pk=action_id)
    if agent_id is not None:
        actions = actions.filter(run__agent_id=agent_id)
    action = actions.select_related(*ACTION_RELATED).first()
    if action is None:
        raise NotFound(f"there is no action {action_id}")
    return action


def action_settled(action_id: int) -> bool:
    """Whether the agent can stop waiting: the outcome is known, or the agent itself must act (a report)."""
    return action_id in actions_settled([action_id])


def actions_settled(action_ids: list[int]) -> set[int]:
    """Which of `action_ids` the agent can stop waiting on (`action_settled`), in one query: every wait of a web
    process is checked at once (ledger/api/waits.py). An id that names no action is settled: nothing will change."""
    rows = Action.objects.filter(pk__in=action_ids).values_list("pk", "status", "tool__executor")
    pending = {pk for pk, status, executor in rows
               if status in ACTIVE_ACTION_STATUSES and not awaiting_report(status, executor)}
    return set(action_ids) - pending


def awaiting_report(status: str, executor: str) -> bool:
    return status == ActionStatus.RUNNING and executor == Executor.CLIENT


def compensations_pending_report(*, tenant_ids: list[int], agent_id: int | None,
                                 run_id: int | None = None) -> QuerySet[Action]:
    """Compensations of client-executed tools that wait for the agent to run them and report."""
    pending = Action.objects.filter(tenant_id__in=tenant_ids, kind=ActionKind.COMPENSATION,
                                    status=ActionStatus.RUNNING, tool__executor=Executor.CLIENT)
    if agent_id is not None:
        pending = pending.filter(run__agent_id=agent_id)
    if run_id is not None:
        pending = pending.filter(run_id=run_id)
    return pending.select_related(*ACTION_RELATED, "compensates", "compensates__tool")


def tool_list(*, tenant_id: int) -> QuerySet[Tool]:
    """The current version of each of the tenant's tools."""
    return Tool.objects.filter(tenant_id=tenant_id, is_current=True)


def tool_get(*, tenant_id: int, name: str) -> Tool:
    """The current version of the tool named `name`."""
    tool = Tool.objects.filter(tenant_id=tenant_id, name=name, is_current=True).first()
    if tool is None:
        raise NotFound(f"there is no tool {name!r}")
    return tool


# --- policy versions ---------------------------------------------------------------------------------

@dataclass
class FieldChange:
    field: str
    before: object
    after: object

    @property
    def before_text(self) -> str:
        return json.dumps(self.before, indent=2, sort_keys=True, ensure_ascii=False)

    @property
    def after_text(self) -> str:
        return json.dumps(self.after, indent=2, sort_keys=True, ensure_ascii=False)


@dataclass
class PolicyVersion:
    """One version of a tool's policy or of the tenant's defaults, with what changed since the version before."""

    subject: str
    version: int
    actor: str
    created_at: datetime
    is_current: bool
    changes: list[FieldChange] = field(default_factory=list)
    first: bool = False
    tool_id: int | None = None
    rules: list = field(default_factory=list)  # the version's rules and limits in words (ledger/engine/decision.py)


def policy_changes(before: dict | None, after: dict) -> list[FieldChange]:
    """The fields whose value differs (every field of a first version, against nothing)."""
    if before is None:
        return [FieldChange(name, None, value) for name, value in after.items()]
    return [FieldChange(name, before.get(name), value) for name, value in after.items() if before.get(name) != value]


def tool_versions(*, tenant_id: int, name: str = "") -> QuerySet[Tool]:
    """Every version of the tenant's tools (or of one), newest first."""
    versions = Tool.objects.filter(tenant_id=tenant_id)
    if name:
        versions = versions.filter(name=name)
    return versions.order_by("-created_at", "-id")


def tool_version_diffs(versions: list[Tool]) -> list[PolicyVersion]:
    """`versions` (a page of them) each against the version before it, read in one more query."""
    wanted = Q(pk__in=[])
    for tool in versions:
        if tool.version > 1:
            wanted |= Q(name=tool.name, version=tool.version - 1)
    tenant_ids = {tool.tenant_id for tool in versions}
    earlier = ({(t.name, t.version): t for t in Tool.objects.filter(wanted, tenant_id__in=tenant_ids)}
               if versions else {})
    shown = []
    for tool in versions:
        previous = earlier.get((tool.name, tool.version - 1))
        shown.append(PolicyVersion(
            subject=tool.name, version=tool.version, actor=tool.actor, created_at=tool.created_at,
            is_current=tool.is_current, first=tool.version == 1, tool_id=tool.pk, rules=decision.policy_words(tool),
            changes=policy_changes(policy_of_version(previous) if previous is not None else None,
                                   policy_of_version(tool))))
    return shown


def tenant_policy_versions(*, tenant_id: int) -> list[PolicyVersion]:
    """The tenant's changed defaults, newest first; the first against those it was created with (version 0, stored
    since issue 31; the model's defaults for a tenant without it)."""
    fields = ("approval_threshold", "approval_ttl_seconds", "run_idle_timeout_seconds", "local_part_case_sensitive",
              "subaddress_separators")
    created_with = {name: Tenant._meta.get_field(name).get_default() for name in fields}
    versions = list(TenantPolicyVersion.objects.filter(tenant_id=tenant_id).order_by("version"))
    if versions and versions[0].version == 0:
        created_with = {name: getattr(versions[0], name) for name in fields}
        versions = versions[1:]
    shown, before = [], created_with
    for index, row in enumerate(versions):
        values = {name: getattr(row, name) for name in fields}
        shown.append(PolicyVersion(subject="tenant defaults", version=row.version, actor=row.actor,
                                   created_at=row.created_at, is_current=index == len(versions) - 1,
                                   changes=policy_changes(before, values)))
        before = values
    return shown[::-1]
