"""Registering tools and loading policy files."""
from __future__ import annotations

from ledger.audit import ledger_transaction
from ledger.canonical import digest
from ledger.errors import ValidationFailed
from ledger.models import Executor, Tenant, Tool
from ledger.policy import parse_document, parse_tool


def _check_compensation_tools(tenant: Tenant, tools: dict[str, dict], *, where: str) -> None:
    known = set(Tool.objects.filter(tenant=tenant).values_list("name", flat=True)) | set(tools)
    for name, fields in tools.items():
        plan = fields["compensation"]
        if plan.get("tool") and plan["tool"] not in known and fields["executor"] != Executor.CLIENT:
            field = f"{where}.{name}.compensation.tool"
            raise ValidationFailed(f"{field}: {plan['tool']!r} is not a registered tool (define it too)", field=field)


def tool_upsert(*, tenant: Tenant, name: str, spec: dict, actor: str) -> tuple[Tool, bool]:
    fields = parse_tool(name, spec, where=f"tools.{name}")
    _check_compensation_tools(tenant, {name: fields}, where="tools")
    with ledger_transaction(tenant.pk) as audit:
        tool, created = Tool.objects.update_or_create(tenant=tenant, name=name, defaults=fields)
        audit.record("tool.registered" if created else "tool.updated", actor=actor, tool=name,
                     policy=digest(fields), rows=[tool])
    return tool, created


def tools_load(*, tenant: Tenant, document: dict, actor: str) -> list[Tool]:
    """Load a whole policy document atomically: every tool, or none with the first error."""
    parsed = parse_document(document)
    where = "agentSafety.policies" if "agentSafety" in document else "tools"
    _check_compensation_tools(tenant, parsed.tools, where=where)
    loaded = []
    with ledger_transaction(tenant.pk) as audit:
        if parsed.defaults:
            Tenant.objects.filter(pk=tenant.pk).update(**parsed.defaults)
            for key, value in parsed.defaults.items():
                setattr(tenant, key, value)
            audit.record("tenant.defaults", actor=actor, **parsed.defaults)
        for name, fields in parsed.tools.items():
            tool, created = Tool.objects.update_or_create(tenant=tenant, name=name, defaults=fields)
            audit.record("tool.registered" if created else "tool.updated", actor=actor, tool=name, policy=digest(fields),
                         rows=[tool])
            loaded.append(tool)
    return loaded
