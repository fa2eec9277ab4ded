"""The action ledger: the system of record every recovery decision is made from.

Status fields are never assigned directly: each state machine has one transition function in
`ledger.engine.transitions` that applies an allowed change with a conditional UPDATE and checks the rowcount.

Longer than 500 lines: Django finds an app's models in this module, and the ledger's tables are one schema whose
state machines name each other; a package of model modules would spread it over files a reader opens together.
"""
import hashlib
import re
from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q


class Risk(models.TextChoices):
    LOW = "low", "low"
    MEDIUM = "medium", "medium"
    HIGH = "high", "high"
    CRITICAL = "critical", "critical"


RISK_ORDER = {Risk.LOW: 0, Risk.MEDIUM: 1, Risk.HIGH: 2, Risk.CRITICAL: 3}


class ActionClass(models.TextChoices):
    READ_ONLY = "read_only", "read-only"
    DRAFT = "draft", "draft"
    INTERNAL_UPDATE = "internal_update", "internal update"
    EXTERNAL_REVERSIBLE = "external_reversible", "external reversible"
    EXTERNAL_IRREVERSIBLE = "external_irreversible", "external irreversible"


class SagaRole(models.TextChoices):
    COMPENSATABLE = "compensatable", "compensatable"
    PIVOT = "pivot", "pivot"
    RETRIABLE = "retriable", "retriable"


class ApprovalRule(models.TextChoices):
    AUTO = "auto", "automatic"
    MANUAL = "manual", "manual"
    THRESHOLD = "threshold", "manual from the tenant's risk threshold"


class Executor(models.TextChoices):
    HTTP = "http", "HTTP endpoint"
    PYTHON = "python", "in-process Python callable"
    CLIENT = "client", "executed by the agent"
    MCP = "mcp", "a tool of an upstream MCP server"


class CompensationStrategy(models.TextChoices):
    TWIN = "twin", "twin tool"
    SNAPSHOT = "snapshot", "restore the before-snapshot"
    CORRECTION = "correction", "send a correction"
    NONE = "none", "none"


class OnRefusal(models.TextChoices):
    """What a tool's refusal (a 4xx but 408/425/429: "not carried out", nothing happened) does to its run."""
    ANSWER = "answer", "answer the agent, keep the run open"
    UNWIND = "unwind", "fail the step and unwind the run"


class Role(models.TextChoices):
    VIEWER = "viewer", "viewer"
    APPROVER = "approver", "approver"
    OPERATOR = "operator", "operator"
    ADMIN = "admin", "admin"


ROLE_ORDER = {Role.VIEWER: 0, Role.APPROVER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


# The bounds of a run's idle timeout (README, "Policy files"): a minute to thirty days.
RUN_IDLE_TIMEOUT_SECONDS = (60, 30 * 86400)
# A sub-address (alice+tag@…) reaches alice@…'s mailbox on most mail servers (RFC 5233): "+" by default; a tenant
# whose server uses another of these characters (qmail and Exim can use "-") names it in its defaults.
SUBADDRESS_SEPARATORS = "+-=_"
SUBADDRESS_SEPARATORS_DEFAULT = "+"
# The bounds of the window for customer requests (recovery/requests.py), when on: an hour to ninety days.
CUSTOMER_REQUESTS_SECONDS = (3600, 90 * 86400)
# The bounds of a retention (docs/archive.md): an hour to a hundred years, or 0 for ever.
RETENTION_SECONDS = (3600, 100 * 365 * 86400)


def validate_retention(value: int) -> None:
    from django.core.exceptions import ValidationError

    if value and not RETENTION_SECONDS[0] <= value <= RETENTION_SECONDS[1]:
        raise ValidationError(f"a retention is 0 (for ever) or {RETENTION_SECONDS[0]} to {RETENTION_SECONDS[1]} seconds")


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    approval_threshold = models.CharField(
        max_length=16, choices=Risk.choices, default=Risk.HIGH,
        help_text="Tools whose approval rule is 'threshold' need a person from this risk up.",
    )
    approval_ttl_seconds = models.PositiveIntegerField(default=3600)
    run_idle_timeout_seconds = models.PositiveIntegerField(
        default=3600, validators=[MinValueValidator(RUN_IDLE_TIMEOUT_SECONDS[0]),
                                  MaxValueValidator(RUN_IDLE_TIMEOUT_SECONDS[1])],
        help_text="A running run with no agent activity for this long (seconds) is unwound: the agent went away.")
    local_part_case_sensitive = models.BooleanField(
        default=False, help_text="Whether Alice@… and alice@… are two people when telling a requester from an "
                                 "approver (the domain is always case-insensitive).")
    subaddress_separators = models.CharField(
        max_length=4, blank=True, default=SUBADDRESS_SEPARATORS_DEFAULT, db_default=SUBADDRESS_SEPARATORS_DEFAULT,
        validators=[RegexValidator(rf"^[{re.escape(SUBADDRESS_SEPARATORS)}]*$",
                                   f"only the characters {' '.join(SUBADDRESS_SEPARATORS)} (or nothing)")],
        help_text="Characters that start a sub-address in a local part (alice+tag@…), which is then the same mailbox "
                  "as alice@… when telling a requester from an approver; empty: none.")
    customer_requests_seconds = models.PositiveIntegerField(
        default=0, db_default=0,
        help_text="How long after a run the person it acted for may ask for a correction from its trail's share page "
                  "(recovery/requests.py); 0: never (the default).")
    retention_seconds = models.PositiveBigIntegerField(
        default=0, db_default=0, validators=[validate_retention],
        help_text="How long a settled run stays in the hot tables after it finished before `manage.py archive` moves "
                  "it to the archive (policy `audit.retention`); 0: kept hot for ever (the default).")
    legal_hold = models.BooleanField(
        default=False, db_default=False,
        help_text="Under a legal hold: none of the tenant's runs is archived (set and cleared by an admin, audited).")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return self.slug


class Agent(models.Model):
    """An API client of a tenant. Its key is stored as a SHA-256 hash and found by a visible prefix."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="agents")
    name = models.CharField(max_length=100)
    key_prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    person = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
        help_text="The person who uses this agent's MCP client, as the tenant maps it (`agent_person_set`): when "
                  "they may decide an approval the agent waits for, a client that takes URL elicitation is asked to "
                  "open the approval page for them (docs/mcp.md).")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="agent_name_unique_per_tenant")]

    def __str__(self):
        return f"{self.tenant.slug}/{self.name}"


class WaitSlot(models.Model):
    """One of a caller's waits open at once (`GET /api/v1/actions/{id}/wait`, MCP `unwind_status {wait}`): at most
    UNWIND_MAX_WAITS_PER_AGENT per caller, numbered 0 to the bound less one, so that every web process counts the
    same ones (ledger/api/waits.py). A slot is taken by inserting its number or by a conditional UPDATE of one whose
    `until` has passed, and given back by setting its `until` in the past; a process killed mid-wait leaves slots
    that free themselves at their `until`. UNLOGGED on PostgreSQL (migration 0023): a slot lives for one wait."""

    holder = models.CharField(max_length=40, help_text="Whose wait: agent:<id> or user:<id>.")
    number = models.PositiveIntegerField()
    until = models.DateTimeField(help_text="When the wait ends at the latest, on the database's clock.")
    token = models.CharField(max_length=32, help_text="Who took it: only its taker gives it back.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["holder", "number"], name="wait_slot_unique_number")]

    def __str__(self):
        return f"{self.holder} wait {self.number}"


class AgentThrottle(models.Model):
    """The agent-key throttle's state for one key (ledger/api/throttle.py, GCRA): the key's theoretical arrival time,
    moved on by one interval per request let through. One row per agent key that ever made a request, so every web
    process on every machine decides from the same one. A row whose `tat` has passed means what no row means: a full
    burst is free. UNLOGGED on PostgreSQL (migration 0033): after a crash of the database every key starts afresh."""

    key = models.CharField(max_length=16, primary_key=True, help_text="The agent key's prefix (Agent.key_prefix).")
    tat = models.BigIntegerField(help_text="Theoretical arrival time: microseconds since the Unix epoch, on the web "
                                           "processes' clocks.")

    def __str__(self):
        return f"throttle of {self.key}"


class DeployKey(models.Model):
    """A pipeline's credential for pushing reviewed tools and policy: not an agent, so it can never act.

    Accepted only on the tool and policy endpoints (`Authorization: Bearer uwd_<prefix>_<secret>`); stored
    like an agent key (SHA-256 hash, found by its visible prefix), shown once by `manage.py create_deploy_key`.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="deploy_keys")
    name = models.CharField(max_length=100)
    key_prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="deploy_key_name_unique_per_tenant")]

    def __str__(self):
        return f"{self.tenant.slug}/{self.name}"


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="one_membership_per_user_tenant")]

    def __str__(self):
        return f"{self.user} in {self.tenant} as {self.role}"


class ToolQuerySet(models.QuerySet):
    def update(self, **values):
        """Only the `is_current` flag of a version ever changes: its policy is what its actions ran with."""
        frozen = set(values) - Tool.MUTABLE_FIELDS
        if frozen:
            raise ImmutableVersion(f"a tool version's policy cannot be changed ({', '.join(sorted(frozen))}); "
                                   "write a new version instead")
        return super().update(**values)


class ImmutableVersion(Exception):
    """A write that would change a recorded policy version in place."""


class Tool(models.Model):
    """One immutable version of a registered tool's policy (see README, "Policy files").

    Each change of a tool's policy inserts a new row with the next `version` and flips the previous one's
    `is_current` off: an action points at the row it was proposed under, so it runs (and is approved,
    retried and compensated) with that version's executor, limits and compensation, whatever changes later.
    Lookups by name take the current version.
    """

    MUTABLE_FIELDS = {"is_current", "updated_at"}

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tools")
    name = models.CharField(max_length=120)
    version = models.PositiveIntegerField(default=1)
    is_current = models.BooleanField(default=True)
    actor = models.CharField(max_length=160, blank=True, help_text="Who wrote this version.")
    description = models.TextField(blank=True)
    describe = models.JSONField(default=dict, blank=True,
                                help_text='How its steps read on the correction trail: {"done", "undone", "failed"} '
                                          'sentences with {args.x}, {result.x} or {target} (ledger/policy/describe.py).')
    args_schema = models.JSONField(default=dict, blank=True)
    action_class = models.CharField(max_length=32, choices=ActionClass.choices, default=ActionClass.INTERNAL_UPDATE)
    saga_role = models.CharField(max_length=16, choices=SagaRole.choices, default=SagaRole.COMPENSATABLE)
    risk = models.CharField(max_length=16, choices=Risk.choices, default=Risk.LOW)
    approval = models.CharField(max_length=16, choices=ApprovalRule.choices, default=ApprovalRule.THRESHOLD)
    approvals_required = models.PositiveSmallIntegerField(default=1)
    executor = models.CharField(max_length=16, choices=Executor.choices, default=Executor.HTTP)
    endpoint = models.CharField(max_length=500, blank=True, help_text="URL (http), registry key (python) or server/tool (mcp).")
    target_type = models.CharField(max_length=60, blank=True)
    target_from = models.CharField(max_length=120, blank=True, help_text="Where the target id comes from, e.g. args.ticket_id")
    key_fields = models.JSONField(default=list, blank=True, help_text="Arg paths that identify the logical action; empty = all args.")
    honours_idempotency_key = models.BooleanField(default=True)
    snapshot = models.JSONField(default=dict, blank=True, help_text='{"read": URL or dotted path, "fields": [...]}')
    verify = models.JSONField(default=dict, blank=True, help_text='{"expect": {"field": "$args.x"}} against the after-snapshot')
    lookup = models.JSONField(default=dict, blank=True, help_text='{"read": URL with {key}}: did a call with this key happen?')
    compensation = models.JSONField(default=dict, blank=True)
    timeout_seconds = models.FloatField(default=10.0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    backoff_seconds = models.FloatField(default=0.2)
    on_refusal = models.CharField(
        max_length=16, choices=OnRefusal.choices, default=OnRefusal.ANSWER,
        help_text="A refusal (4xx but 408/425/429) answers the agent and keeps the run open, or unwinds it.")
    hold = models.JSONField(default=dict, blank=True,
                            help_text='An undo window before its steps run (ledger/engine/holds.py): {"seconds": 30, '
                                      '"customer_can_stop": false}; empty: none.')
    display = models.JSONField(default=dict, blank=True,
                               help_text='How pages show argument values: {"amount_cents": {"money": {"currency": "EUR"}}}')
    rules = models.JSONField(default=list, blank=True,
                             help_text='CEL conditions on the arguments: [{"when", "risk" | "deny" | "approvals_required", '
                                       '"reason"}] (ledger/policy/rules.py).')
    limits = models.JSONField(default=list, blank=True,
                              help_text='Budgets and rates: [{"per", "count" | "sum" and "max", "window"}] (ledger/policy/limits.py).')
    retention_seconds = models.PositiveBigIntegerField(
        default=0, db_default=0,
        help_text="How long a settled run that called it stays hot (policy `retention`); the longest of its tools' and "
                  "its tenant's wins; 0: the tenant's.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ToolQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name", "version"], name="tool_version_unique"),
            models.UniqueConstraint(fields=["tenant", "name"], condition=Q(is_current=True),
                                    name="one_current_tool_version"),
        ]
        ordering = ["name", "-version"]

    def __str__(self):
        return self.name if self.version == 1 else f"{self.name} v{self.version}"

    def save(self, *args, **kwargs):
        # A recorded version is never rewritten (see ToolQuerySet.update); a new version is a new row.
        if not self._state.adding:
            raise ImmutableVersion(f"{self.name} version {self.version} is recorded; write a new version instead")
        super().save(*args, **kwargs)


POLICY_FIELDS = tuple(
    f.name for f in Tool._meta.concrete_fields
    if f.name not in ("id", "tenant", "name", "version", "is_current", "actor", "created_at", "updated_at")
)


class TenantPolicyVersion(models.Model):
    """One immutable version of a tenant's defaults: written on every change, never edited.

    Version numbers start at 1 with the first change; before it the tenant has the defaults it was created
    with (version 0 in an action's `defaults_version`).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="policy_versions")
    version = models.PositiveIntegerField()
    approval_threshold = models.CharField(max_length=16, choices=Risk.choices)
    approval_ttl_seconds = models.PositiveIntegerField()
    run_idle_timeout_seconds = models.PositiveIntegerField(default=3600)
    local_part_case_sensitive = models.BooleanField(default=False)
    subaddress_separators = models.CharField(max_length=4, blank=True, default=SUBADDRESS_SEPARATORS_DEFAULT,
                                             db_default=SUBADDRESS_SEPARATORS_DEFAULT)
    customer_requests_seconds = models.PositiveIntegerField(default=0, db_default=0)
    retention_seconds = models.PositiveBigIntegerField(default=0, db_default=0)
    actor = models.CharField(max_length=160)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "version"], name="tenant_policy_version_unique")]
        ordering = ["tenant_id", "-version"]

    def __str__(self):
        return f"{self.tenant} defaults v{self.version}"


class RunStatus(models.TextChoices):
    RUNNING = "running", "running"
    AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
    COMPLETED = "completed", "completed"
    UNWINDING = "unwinding", "unwinding"
    COMPENSATED = "compensated", "compensated"
    NEEDS_ATTENTION = "needs_attention", "needs attention"
    CLOSED = "closed", "closed"


RUN_FINAL = {RunStatus.COMPLETED, RunStatus.COMPENSATED, RunStatus.CLOSED}


class Run(models.Model):
    """One agent workflow: a saga."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="runs",
                               db_index=False)  # (tenant, -created_at) leads with it
    agent = models.ForeignKey(Agent, on_delete=models.SET_NULL, null=True, blank=True, related_name="runs")
    on_behalf_of = models.CharField(max_length=200, blank=True)
    fingerprint_key = models.CharField(
        max_length=64, blank=True, default="", editable=False,
        help_text="A run acted for someone: the random key (hex) the chain's fingerprints of its rows are made under "
                  "(ledger/audit/subjects.py); erasing the person blanks it. Empty for a run acted for nobody.")
    goal = models.TextField(blank=True)
    intent = models.JSONField(default=dict, blank=True)
    plan = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=24, choices=RunStatus.choices, default=RunStatus.RUNNING)
    pivot_committed = models.BooleanField(default=False)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    attention_reason = models.CharField(max_length=40, blank=True)
    attention_detail = models.TextField(blank=True)
    next_seq = models.PositiveIntegerField(default=1)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    open_key = models.CharField(max_length=255, blank=True, help_text="The Idempotency-Key the run was opened with.")
    idle_timeout_seconds = models.PositiveIntegerField(
        default=3600, help_text="How long the run may stay idle (no agent activity) before it is unwound.")
    idle_deadline = models.DateTimeField(
        null=True, blank=True, help_text="When the sweep looks at the run again: its last known activity plus the "
                                         "idle timeout (activity since only pushes it on).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    legal_hold = models.BooleanField(
        default=False, db_default=False,
        help_text="Under a legal hold: never archived, whatever its age (set and cleared by an admin, audited).")

    class Meta:
        constraints = [
            # An agent's keys are its own (issue 31): another agent's key is neither seen nor taken.
            models.UniqueConstraint(fields=["tenant", "agent", "open_key"],
                                    condition=~Q(open_key="") & Q(agent__isnull=False),
                                    name="run_open_key_unique_per_agent"),
            models.UniqueConstraint(fields=["tenant", "open_key"], condition=~Q(open_key="") & Q(agent__isnull=True),
                                    name="run_open_key_unique_without_agent"),
        ]
        indexes = [
            models.Index(fields=["tenant", "-created_at"], name="run_tenant_recent"),
            # The console's run list spans all of a person's tenants, newest first: walked, never sorted.
            models.Index(fields=["-created_at", "-id"], name="run_recent"),
            models.Index(fields=["status", "lease_expires_at"], name="run_status_lease"),
            models.Index(fields=["status", "idle_deadline"], name="run_status_idle"),
        ]

    def __str__(self):
        return f"run {self.pk} ({self.status})"


class ActionKind(models.TextChoices):
    FORWARD = "forward", "forward"
    COMPENSATION = "compensation", "compensation"


class ActionStatus(models.TextChoices):
    PLANNED = "planned", "planned"
    AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
    APPROVED = "approved", "approved"
    REJECTED = "rejected", "rejected"
    EXPIRED = "expired", "expired"
    RUNNING = "running", "running"
    RETRY_SCHEDULED = "retry_scheduled", "retry scheduled"
    # Ready to run, waiting out its tool's hold (an undo window, ledger/engine/holds.py) until `next_attempt_at`.
    HELD = "held", "held"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    LOST = "lost", "outcome unknown"
    COMPENSATING = "compensating", "compensating"
    COMPENSATED = "compensated", "compensated"
    COMPENSATION_FAILED = "compensation_failed", "compensation failed"
    SKIPPED = "skipped", "skipped"


class Action(models.Model):
    """The ledger entry for one proposed tool call, or for the compensation of one."""

    # No index of their own: (tenant, idempotency_key), (tenant, -created_at), (run, seq) and (run, content_key) lead
    # with them. Every index takes an entry at each move of each action (a move changes its status, which partial
    # indexes name, so no update of an action is HOT).
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="actions", db_index=False)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="actions", db_index=False)
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=ActionKind.choices, default=ActionKind.FORWARD)
    compensates = models.ForeignKey(  # indexed where set (`action_compensates`)
        "self", on_delete=models.CASCADE, null=True, blank=True, related_name="compensations", db_index=False
    )
    tool = models.ForeignKey(Tool, on_delete=models.PROTECT, related_name="actions")
    saga_role = models.CharField(max_length=16, choices=SagaRole.choices)
    risk = models.CharField(max_length=16, choices=Risk.choices)
    args = models.JSONField(default=dict, help_text="The canonical form (ledger/canonical.py): what is hashed and compared.")
    args_text = models.TextField(
        blank=True, default="",
        help_text="The arguments' JSON text as the agent sent them (numbers as written, strings unnormalised): what "
                  "the tool receives. Empty on actions recorded before it was kept; they send `args`.")
    args_hash = models.CharField(max_length=64)
    content_key = models.CharField(
        max_length=64, blank=True, default="",
        help_text="Digest of the forward step's content (tool name, target, canonical args or key_fields): a new "
                  "proposal with the same content in the run matches it, whatever its Idempotency-Key.")
    repeat_of = models.ForeignKey(
        "self", on_delete=models.CASCADE, null=True, blank=True, related_name="+", db_index=False,  # `action_repeats`
        help_text="The earlier action with the same content the agent said it means to repeat (`repeat_of`).")
    target_type = models.CharField(max_length=60, blank=True)
    target_id = models.CharField(max_length=200, blank=True)
    idempotency_key = models.CharField(max_length=255)
    key_agent = models.PositiveBigIntegerField(
        default=0, help_text="The agent among whose keys `idempotency_key` is (agents are separated like tenants: "
                             "another agent's keys are invisible); 0 for a run no agent opened, and for actions "
                             "recorded before keys were scoped by agent (migration 0015), whose keys stay as sent.")
    key_source = models.CharField(max_length=16, default="derived")
    status = models.CharField(max_length=24, choices=ActionStatus.choices, default=ActionStatus.PLANNED)
    approvals_required = models.PositiveSmallIntegerField(default=0)
    defaults_version = models.PositiveIntegerField(
        default=0, help_text="The tenant's defaults version it was proposed under (0: as the tenant was created).")
    attempts = models.PositiveSmallIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=120, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    error_class = models.CharField(max_length=40, blank=True)
    error_message = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    verification = models.JSONField(null=True, blank=True)
    intent = models.JSONField(default=dict, blank=True)
    compensation_plan = models.JSONField(default=dict, blank=True)
    # The W3C trace context of the request that proposed it (ledger/tracing.py), so that its execution, later and
    # in a worker, and its compensation join the agent's trace; null when tracing was off.
    trace_context = models.JSONField(null=True, blank=True)
    decision_reason = models.TextField(blank=True)
    stopped_by = models.CharField(
        max_length=16, blank=True, default="", db_default="",
        help_text="Who stopped it while it was held (ledger/engine/holds.py): agent, operator, approver or customer.")
    # What its tool's rules and limits decided and why (ledger/engine/decision.py): null for a tool without them.
    policy_decision = models.JSONField(null=True, blank=True)
    totalled = models.BooleanField(
        default=False, db_default=False,
        help_text="Its tool keeps running totals for a limit per agent or per tenant (PostgreSQL; migration 0022): "
                  "set when it is proposed under such a limit, or when such totals are built. Only such a step's "
                  "moves call the triggers that keep them.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key_agent", "idempotency_key"],
                                    name="idempotency_key_unique_per_agent"),
            models.UniqueConstraint(fields=["run", "seq"], name="action_seq_unique_per_run"),
        ]
        indexes = [
            # The sweep's two look-ups (a running action whose lease ran out, a retry that fell due), over just the
            # actions they can find. Keyed on the status, as they were, they took an entry at every move of every
            # action, most of them into long runs of equal keys (succeeded, no retry, no lease): with these instead,
            # an unwind of nine went from 20.0 to 17.0 ms on a new database (PostgreSQL plans the sweep's queries
            # with their values, so the partial index serves them; SQLite scans, at demo sizes).
            models.Index(fields=["lease_expires_at"], condition=Q(status="running"), name="action_running_lease"),
            models.Index(fields=["next_attempt_at"], condition=Q(status="retry_scheduled"), name="action_retry_due"),
            # The sweep's look-up of held steps whose window ended (ledger/engine/holds.py).
            models.Index(fields=["next_attempt_at"], condition=Q(status="held"), name="action_held_due"),
            models.Index(fields=["tenant", "-created_at"], name="action_tenant_recent"),
            # No index on (run, content_key): a proposal compares contents among the run's steps it reads anyway
            # (ledger/engine/runsteps.py `same_content`), by (run, seq). The index cost ~106 bytes an action (0031).
            # Most actions are forward steps that compensate and repeat nothing: only those that do are indexed.
            models.Index(fields=["compensates"], condition=Q(compensates__isnull=False), name="action_compensates"),
            models.Index(fields=["repeat_of"], condition=Q(repeat_of__isnull=False), name="action_repeats"),
        ]
        ordering = ["run_id", "seq"]

    def __str__(self):
        return f"{self.tool.name}#{self.seq} ({self.status})"

    @property
    def is_compensation(self) -> bool:
        return self.kind == ActionKind.COMPENSATION

    @property
    def tool_key(self) -> str:
        """The Idempotency-Key sent to the tool: the ledger key, namespaced by tenant.

        Agents choose their keys freely and two tenants (or two agents of one tenant) may pick the same one; the
        services they call are shared, so the key that leaves Unwind must not collide across tenants or agents. An
        action recorded before keys were scoped by agent (`key_agent` 0) keeps the key it was sent with.
        """
        scope = f"{self.tenant_id}:{self.key_agent}:" if self.key_agent else f"{self.tenant_id}:"
        return "uw-" + hashlib.sha256(f"{scope}{self.idempotency_key}".encode()).hexdigest()[:40]


class Attempt(models.Model):
    """One try of an action: who ran it, for how long, and how it ended."""

    action = models.ForeignKey(Action, on_delete=models.CASCADE, related_name="attempt_set",
                               db_index=False)  # (action, number) leads with it
    number = models.PositiveSmallIntegerField()
    worker = models.CharField(max_length=120)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=24, default="running")
    error_class = models.CharField(max_length=40, blank=True)
    error_message = models.TextField(blank=True)
    latency_ms = models.FloatField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True, help_text=(
        "When the request left Unwind (tools that ignore idempotency keys); empty: never sent."))
    resend_by = models.CharField(max_length=160, blank=True, default="", db_default="", help_text=(
        "Who decided, after an unknown outcome, that the tool did not act and the step is sent again."))

    class Meta:
        constraints = [models.UniqueConstraint(fields=["action", "number"], name="attempt_number_unique")]
        ordering = ["action_id", "number"]


class Checkpoint(models.Model):
    """Run state saved at a safe point; resume starts from the newest one."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    label = models.CharField(max_length=60)
    state = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run_id", "id"]


class HexDigestField(models.CharField):
    """A SHA-256 digest: 64 hex digits in Python, on SQLite and in every export (archive segments, signed heads); the
    32 bytes themselves (bytea) in a PostgreSQL column, half the text's size (issue 42: the chain's two hashes were
    130 of an event's ~520 bytes). Text that is not hex is refused before it reaches the database (ValueError)."""

    def __init__(self, *args, **kwargs):
        kwargs["max_length"] = 64
        super().__init__(*args, **kwargs)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        del kwargs["max_length"]
        return name, path, args, kwargs

    def db_type(self, connection):
        return "bytea" if connection.vendor == "postgresql" else super().db_type(connection)

    def from_db_value(self, value, expression, connection):
        return bytes(value).hex() if isinstance(value, (bytes, memoryview)) else value

    def get_db_prep_value(self, value, connection, prepared=False):
        value = super().get_db_prep_value(value, connection, prepared)
        return bytes.fromhex(value) if connection.vendor == "postgresql" and isinstance(value, str) else value


class AuditEvent(models.Model):
    """Append-only, keyed hash-chained record of every transition and decision, one chain per tenant.

    It refers to ledger rows by id, not by foreign key, so deleting a ledger row leaves its history
    (and the gap is what `verify_audit` reports).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+",
                               db_index=False)  # (tenant, seq) leads with it
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=60)
    actor = models.CharField(max_length=160)
    run_ref = models.BigIntegerField(null=True, blank=True)
    action_ref = models.BigIntegerField(null=True, blank=True)
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    prev_hash = HexDigestField()
    hash = HexDigestField()  # HMAC-SHA256 under the audit key named by key_id
    # The id of the audit key the hash was made with (config/audit_keys.py): old keys verify old events after a
    # rotation. Empty on events made before the chain was keyed; verify_audit reports those.
    key_id = models.CharField(max_length=16, default="", blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "seq"], name="audit_seq_unique_per_tenant")]
        # A run's or a step's events are read with their tenant (the pages, the trail, an undo's seal): an index on
        # the reference alone let the planner AND it with the tenant's (tenant, seq) index, which reads every event
        # of the tenant in the partitions searched, once per undo (bench/README.md, 2026-11-28).
        # A step's are few (its proposal, moves and outcome) and read whole, then sorted: without `seq` its key is the
        # same for all of them, which PostgreSQL stores once (B-tree deduplication), and run-level events (no step)
        # are left out; 64 bytes an action instead of 200 (0031). A run's keep `seq`: its page reads the first
        # TIMELINE_AUDIT_LIMIT of a run that may have thousands.
        indexes = [
            models.Index(fields=["run_ref", "tenant", "seq"], name="audit_run_tenant"),
            models.Index(fields=["action_ref", "tenant"], condition=Q(action_ref__isnull=False),
                         name="audit_action_tenant"),
        ]
        ordering = ["tenant_id", "seq"]


class ExactNumber(models.Field):
    """PostgreSQL's `numeric` with no precision or scale: a sum of any arguments' values, to their last digit."""

    def db_type(self, connection):
        return "numeric"

    def from_db_value(self, value, expression, connection):
        return None if value is None else Decimal(str(value))

    def get_prep_value(self, value):
        return None if value is None else Decimal(str(value))


class LimitMeasure(models.Model):
    """What the database keeps running totals of, for a tool's limits per agent or per tenant (PostgreSQL only).

    One row per (tenant, tool name, scope, measure): `path` is the summed argument ("amount" for `sum:
    "args.amount"`), empty for a count. `unwind_limit_measure` (ledger/engine/plpgsql) adds it and fills its totals
    from the ledger, under the tenant's chain lock, when a tool version with such a limit is written (`limits.
    keep_totals_of`, which drops those no current version reads) or, if missing, when a limit counts; from then on
    the triggers on ledger_action (migration 0022) keep them. Deleting a row makes the next count build it again.
    SQLite counts by reading the steps and keeps none."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    tool_name = models.CharField(max_length=120)
    per = models.CharField(max_length=8)  # agent | tenant: a run's few steps are read, never totalled
    path = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "tool_name", "per", "path"],
                                               name="limit_measure_unique")]


class LimitTotal(models.Model):
    """A measure's total in one scope and one time bucket: what the steps created in [bucket, bucket + span) that
    acted or may still act add up to (`span` 60, 3600 or 86400 seconds, buckets aligned to the Unix epoch; span 0:
    all time, bucket at the epoch). `scope`: the run's agent id (0 for a run no agent opened), or 0 per tenant.
    A window's count is an exact read of the steps in its first partial minute, then whole minutes, hours and days."""

    measure = models.ForeignKey(LimitMeasure, on_delete=models.CASCADE, related_name="+", db_index=False)
    scope = models.BigIntegerField()
    span = models.PositiveIntegerField()
    bucket = models.DateTimeField()
    value = ExactNumber(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["measure", "scope", "span", "bucket"],
                                               name="limit_total_unique")]


class AuditHead(models.Model):
    """The newest link of a tenant's chain; locking it serialises appends to that chain."""

    tenant = models.OneToOneField(Tenant, on_delete=models.PROTECT, primary_key=True, related_name="+")
    seq = models.PositiveBigIntegerField(default=0)
    hash = models.CharField(max_length=64, default="0" * 64)


class ArchiveSegment(models.Model):
    """One content-addressed segment file of a tenant's archive (ledger/archive, docs/archive.md): a contiguous slice
    of its audit chain (`first_seq`..`last_seq`, which may be empty) and the rows of the runs it took out of the hot
    tables. `number` orders a tenant's segments; the chain records each one (`archive.segment`)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+", db_index=False)
    number = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64, unique=True, help_text="Of the file's bytes: its name in the archive.")
    first_seq = models.PositiveBigIntegerField()
    last_seq = models.PositiveBigIntegerField()
    runs = models.PositiveIntegerField()
    actions = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "number"], name="archive_segment_number_unique")]

    def __str__(self):
        return f"segment {self.number} of tenant {self.tenant_id} ({self.sha256[:12]})"


class ArchivedRun(models.Model):
    """Where an archived run's rows are: the index that lets its page, its trail and the API find it."""

    run_id = models.BigIntegerField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="+", db_index=False)
    agent_id = models.BigIntegerField(null=True, blank=True)
    segment = models.ForeignKey(ArchiveSegment, on_delete=models.PROTECT, related_name="+")
    first_seq = models.PositiveBigIntegerField(help_text="Its first audit event: where its history starts.")
    last_seq = models.PositiveBigIntegerField(help_text="Its last audit event.")
    finished_at = models.DateTimeField(null=True, blank=True)
    archived_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["tenant", "run_id"], name="archived_run_tenant")]


class ArchivedKey(models.Model):
    """A look-up key of an archived row another app finds it by (a trail link's token hash), with the run it is in."""

    label = models.CharField(max_length=100)
    value = models.CharField(max_length=200)
    run = models.ForeignKey(ArchivedRun, on_delete=models.CASCADE, related_name="+", db_index=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["label", "value"], name="archived_key_unique")]


ACTIVE_ACTION_STATUSES = (
    ActionStatus.PLANNED, ActionStatus.AWAITING_APPROVAL, ActionStatus.APPROVED,
    ActionStatus.RUNNING, ActionStatus.RETRY_SCHEDULED, ActionStatus.HELD,
)
IN_FLIGHT = Q(status__in=[ActionStatus.RUNNING, ActionStatus.RETRY_SCHEDULED])


class Erasure(models.Model):
    """One erasure of a person's data at their request (recovery/erasure.py), as the console and the audit list it.
    Names the person by no text of theirs."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    erased_at = models.DateTimeField()
    erased_by = models.CharField(max_length=160)
    reason = models.TextField()
    runs = models.PositiveIntegerField()
    actions = models.PositiveIntegerField()
    fields = models.PositiveIntegerField(help_text="How many stored values were replaced by the erasure marker.")
    events = models.PositiveIntegerField(help_text="How many audit events were rewritten (each vouched for by the "
                                                   "erasure's own event).")
    unkeyed_events = models.PositiveIntegerField(help_text="How many of the runs' events were recorded before their "
                                                           "fingerprints were keyed: their digests stay.")


class ErasedRun(models.Model):
    """A run whose person's data was erased: its pages say so, and its trail links answer 410."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="erasure")
    erasure = models.ForeignKey(Erasure, on_delete=models.CASCADE, related_name="erased_runs")
    erased_at = models.DateTimeField()
