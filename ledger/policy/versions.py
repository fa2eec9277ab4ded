"""Registering tools, loading policy files and the tenant's defaults: every change is a new immutable version.

A tool's policy is never edited in place. A write whose policy differs from the current version inserts the
next version and retires the previous one (only its `is_current` flag changes), records it in the tenant's
audit chain with a digest of the policy, and tells the rest of the system (`policy_changed`), so that an
approval requested under the retired version is voided rather than released onto a policy nobody approved.
A write identical to the current version changes nothing.
"""
from __future__ import annotations

from ledger import events
from ledger.audit.chain import AuditLog, ledger_transaction
from ledger.canonical import digest
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import POLICY_FIELDS, Executor, Tenant, TenantPolicyVersion, Tool
from ledger.policy.functions import function_tool, is_function_definition
from ledger.policy.document import parse_document
from ledger.policy.limits import keep_totals_of
from ledger.policy.tool_entry import parse_tool
from ledger.policy.twins import with_inline_twins

DEFAULT_FIELDS = ("approval_threshold", "approval_ttl_seconds", "run_idle_timeout_seconds", "local_part_case_sensitive",
                  "customer_requests_seconds", "subaddress_separators", "retention_seconds")


def policy_digest(fields: dict) -> str:
    return digest({name: fields.get(name) for name in POLICY_FIELDS})


def policy_of_version(tool: Tool) -> dict:
    """The policy fields of one version, as stored: what its digest covers and what a diff compares."""
    return {name: getattr(tool, name) for name in POLICY_FIELDS}


def _check_compensation_tools(tenant: Tenant, tools: dict[str, dict], *, where: str) -> None:
    known = set(Tool.objects.filter(tenant=tenant, is_current=True).values_list("name", flat=True)) | set(tools)
    for name, fields in tools.items():
        plan = fields["compensation"]
        if plan.get("tool") and plan["tool"] not in known and fields["executor"] != Executor.CLIENT:
            field = f"{where}.{name}.compensation.tool"
            raise ValidationFailed(f"{field}: {plan['tool']!r} is not a registered tool (define it too)", field=field)


def _check_mcp_servers(tenant: Tenant, tools: dict[str, dict], *, where: str) -> None:
    """A deployer may declare an upstream MCP server for some tenants only (`tenants` in UNWIND_MCP_SERVERS): its
    URL, its credentials (headers) or its command are theirs, and another tenant's policy may not name it."""
    from ledger.executors import mcp as mcp_upstream

    for name, fields in tools.items():
        if fields["executor"] != Executor.MCP:
            continue
        server = mcp_upstream.server(mcp_upstream.split_endpoint(fields["endpoint"])[0])
        if not server.serves(tenant.slug):
            field = f"{where}.{name}.executor.server"
            raise ValidationFailed(f"{field}: {server.name!r} is not declared for tenant {tenant.slug!r} "
                                   f"(UNWIND_MCP_SERVERS {server.name}.tenants)", field=field)


def _write_version(*, tenant: Tenant, name: str, fields: dict, actor: str, audit: AuditLog,
                   via: str = "") -> tuple[Tool, bool]:
    """Insert the next version of `name` unless `fields` equal the current one. Returns (current version, created).

    Runs inside the tenant's ledger transaction, whose chain-head lock serialises every policy write (and every
    approval decision) of the tenant, so two writers never both take the same next version.
    """
    current = Tool.objects.filter(tenant=tenant, name=name, is_current=True).first()
    fingerprint = policy_digest(fields)
    if current is not None and policy_digest(policy_of_version(current)) == fingerprint:
        return current, False
    version = 1
    if current is not None:
        # Retire it first: the partial unique constraint allows one current version per name at any instant.
        if Tool.objects.filter(pk=current.pk, is_current=True).update(is_current=False) != 1:
            raise StateConflict(f"{name} version {current.version} was replaced meanwhile; read it again")
        version = current.version + 1
    tool = Tool.objects.create(tenant=tenant, name=name, version=version, is_current=True, actor=actor[:160],
                               **{key: fields[key] for key in POLICY_FIELDS if key in fields})
    keep_totals_of(tool.limits, tenant_id=tenant.pk, tool_name=name)
    changed = [] if current is None else sorted(
        key for key in POLICY_FIELDS if getattr(current, key) != getattr(tool, key))
    extra = {"via": via} if via else {}
    audit.record("tool.registered" if current is None else "tool.updated", actor=actor, tool=name, version=version,
                 previous_version=current.version if current else None, policy=fingerprint, changed=changed,
                 rows=[tool], **extra)
    if current is not None:
        events.emit("policy_changed", retired=current, current=tool, actor=actor)
    return tool, current is None


def twin_of(fields: dict) -> str:
    """The forward tool whose inline compensation defines this tool, or "" for a tool of its own."""
    return fields["compensation"].get("twin_of", "") if isinstance(fields.get("compensation"), dict) else ""


def _check_inline_twins(tenant: Tenant, tools: dict[str, dict], *, where: str) -> None:
    """An inline twin may replace only an earlier version of itself, never a tool registered on its own."""
    for name, fields in tools.items():
        forward = twin_of(fields)
        if not forward:
            continue
        current = Tool.objects.filter(tenant=tenant, name=name, is_current=True).only("compensation").first()
        if current is not None and twin_of({"compensation": current.compensation}) != forward:
            field = f"{where}.{forward}.compensation.tool"
            raise ValidationFailed(f"{field}: the inline twin is registered as {name!r}, which is already a tool of "
                                   f"its own; name that tool in compensation.tool instead", field=field)


def _tool_with_twin(*, tenant: Tenant, name: str, spec: dict) -> dict[str, dict]:
    """One tool's field values (and its inline twin's, if it defines one), validated for `tenant`."""
    current = Tool.objects.filter(tenant=tenant, name=name, is_current=True).only("compensation").first()
    if current is not None and twin_of({"compensation": current.compensation}):
        forward = twin_of({"compensation": current.compensation})
        raise ValidationFailed(f"tools.{name}: is the inline compensation twin of {forward!r}; change it there, in "
                               f"{forward}'s compensation.tool", field=f"tools.{name}")
    if is_function_definition(spec):
        _, spec = function_tool(spec, where=f"tools.{name}", name=name)
    tools = with_inline_twins({name: parse_tool(name, spec, where=f"tools.{name}")}, lambda tool: f"tools.{tool}")
    _check_compensation_tools(tenant, tools, where="tools")
    _check_mcp_servers(tenant, tools, where="tools")
    _check_inline_twins(tenant, tools, where="tools")
    return tools


def tool_policy_check(*, tenant: Tenant, name: str, spec: dict) -> dict:
    """Validate one tool's policy for `tenant` (ValidationFailed names the setting) and return its field values.
    The policy may be an OpenAI function definition with Unwind's keys beside it (policy.function_tool)."""
    return _tool_with_twin(tenant=tenant, name=name, spec=spec)[name]


def _write_tools(*, tenant: Tenant, tools: dict[str, dict], actor: str, audit: AuditLog,
                 via: str = "") -> list[tuple[Tool, bool]]:
    """Write each tool's next version where it changed, an inline twin just before its forward tool: the
    forward tool's compensation records the twin's version (`twin_version`), so a step is always undone by the
    twin written with the version it was proposed under."""
    written = []
    for name, fields in tools.items():
        if twin_of(fields):
            continue
        plan = fields["compensation"]
        if "inline" in plan:
            twin = _write_version(tenant=tenant, name=plan["tool"], fields=tools[plan["tool"]], actor=actor,
                                  audit=audit, via=via)
            written.append(twin)
            fields = {**fields, "compensation": {**plan, "twin_version": twin[0].version}}
        written.append(_write_version(tenant=tenant, name=name, fields=fields, actor=actor, audit=audit, via=via))
    return written


def tool_upsert(*, tenant: Tenant, name: str, spec: dict, actor: str, via: str = "") -> tuple[Tool, bool]:
    """Register a tool or write the next version of its policy (and of its inline twin, if it defines one).
    Returns (its current version, newly registered)."""
    tools = _tool_with_twin(tenant=tenant, name=name, spec=spec)
    with ledger_transaction(tenant.pk) as audit:
        written = _write_tools(tenant=tenant, tools=tools, actor=actor, audit=audit, via=via)
    return written[-1]


def tenant_defaults_set(*, tenant: Tenant, values: dict, actor: str, via: str = "") -> TenantPolicyVersion | None:
    """Write a new version of the tenant's defaults (approval threshold, approval TTL, run idle timeout), or nothing
    when unchanged."""
    with ledger_transaction(tenant.pk) as audit:
        return _write_defaults(tenant=tenant, values=values, actor=actor, audit=audit, via=via)


def _write_defaults(*, tenant: Tenant, values: dict, actor: str, audit: AuditLog,
                    via: str = "") -> TenantPolicyVersion | None:
    unknown = sorted(set(values) - set(DEFAULT_FIELDS))
    if unknown:
        raise ValidationFailed(f"defaults.{unknown[0]}: is not a tenant default", field=f"defaults.{unknown[0]}")
    now = Tenant.objects.values(*DEFAULT_FIELDS).get(pk=tenant.pk)
    merged = {**now, **values}
    if merged == now:
        return None
    previous = TenantPolicyVersion.objects.filter(tenant=tenant).order_by("-version").first()
    version = TenantPolicyVersion.objects.create(tenant=tenant, version=(previous.version if previous else 0) + 1,
                                                 actor=actor[:160], **merged)
    Tenant.objects.filter(pk=tenant.pk).update(**merged)
    for key, value in merged.items():
        setattr(tenant, key, value)
    extra = {"via": via} if via else {}
    audit.record("tenant.defaults", actor=actor, version=version.version, policy=digest(merged),
                 changed=sorted(key for key in DEFAULT_FIELDS if merged[key] != now[key]), rows=[version], **merged,
                 **extra)
    return version


def defaults_record_initial(*, tenant: Tenant, actor: str, audit: AuditLog) -> TenantPolicyVersion:
    """Version 0 of the tenant's defaults: those it was created with, stored and chained from its creation on, so an
    edit of the tenant's row beside its versions (switching approvals off, say) is caught by `verify_audit`."""
    values = Tenant.objects.values(*DEFAULT_FIELDS).get(pk=tenant.pk)
    version = TenantPolicyVersion.objects.create(tenant=tenant, version=0, actor=actor[:160], **values)
    audit.record("tenant.defaults", actor=actor, version=0, policy=digest(values), changed=[], rows=[version],
                 **values)
    return version


def tools_load(*, tenant: Tenant, document: dict, actor: str) -> list[Tool]:
    """Load a whole policy document atomically: every tool, or none with the first error.

    Returns the current version of every tool in the document (a new one only where its policy changed).
    """
    parsed = parse_document(document)
    where = "agentSafety.policies" if "agentSafety" in document else "tools"
    _check_compensation_tools(tenant, parsed.tools, where=where)
    _check_mcp_servers(tenant, parsed.tools, where=where)
    _check_inline_twins(tenant, parsed.tools, where=where)
    with ledger_transaction(tenant.pk) as audit:
        if parsed.defaults:
            _write_defaults(tenant=tenant, values=parsed.defaults, actor=actor, audit=audit)
        written = _write_tools(tenant=tenant, tools=parsed.tools, actor=actor, audit=audit)
    return [tool for tool, _ in written]
