"""A policy document: a whole policy file, its tenant defaults and its tools (each through policy/tool_entry.py).

A policy file is JSON or YAML, either in the shape of seed 004's configuration template
(`{"agentSafety": {"policies": {...}, "unwind": {...}, "audit": {...}}}`) or flat
(`{"tenant": ..., "defaults": {...}, "tools": {...}}`). Every error names the field it is about.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.models import (
    CUSTOMER_REQUESTS_SECONDS, RUN_IDLE_TIMEOUT_SECONDS, SUBADDRESS_SEPARATORS, ActionClass, Executor, Risk,
)
from ledger.policy import checks, functions, tool_entry, twins

# --- inline compensation twins ------------------------------------------------------------------------


# --- OpenAI-style function definitions ---------------------------------------------------------------


def _tool_section(section: Any, where: str) -> dict[str, dict]:
    """A document's tools, parsed: an object of name → tool (each in Unwind's form or an OpenAI function
    definition), or a list of OpenAI function definitions, each naming itself."""
    if isinstance(section, list):
        tools: dict[str, dict] = {}
        places: dict[str, str] = {}
        for index, entry in enumerate(section):
            at = f"{where}[{index}]"
            name, spec = functions.function_tool(entry, where=at)
            if name in tools:
                named_at = f"{at}.function.name" if isinstance(entry, dict) and "function" in entry else f"{at}.name"
                checks.fail(named_at, f"{name!r} is defined twice")
            tools[name], places[name] = tool_entry.parse_tool(name, spec, where=at), at
        return twins.with_inline_twins(tools, places.get)
    section = checks.require_mapping(section, where)
    tools = {name: tool_entry.parse_tool(*_unwind_form(name, spec, f"{where}.{name}"), where=f"{where}.{name}")
             for name, spec in section.items()}
    return twins.with_inline_twins(tools, lambda name: f"{where}.{name}")


def keys_left_implicit(document: Any) -> list[str]:
    """Warnings for the tools of a (valid) policy document that can change the world and do not say whether they
    honour Unwind's idempotency key: the default is taken (true, but false for MCP tools), and a tool that in fact
    ignores keys acts twice when a lost step, or an undo, is sent again with the same key."""
    document = checks.require_mapping(document, "policy")
    section = checks.require_mapping(document.get("agentSafety", {}), "agentSafety").get("policies", {}) \
        if "agentSafety" in document else document.get("tools", {})
    entries = [functions.function_tool(entry, where="tools") for entry in section] if isinstance(section, list) \
        else [_unwind_form(name, spec, f"tools.{name}") for name, spec in checks.require_mapping(section, "tools").items()]
    warnings = []
    for name, spec in entries:
        fields = tool_entry.parse_tool(name, spec, where=f"tools.{name}")
        stated = isinstance(spec.get("idempotency"), dict) and "honours_key" in spec["idempotency"]
        if stated or fields["action_class"] == ActionClass.READ_ONLY or fields["executor"] == Executor.CLIENT:
            continue
        taken = "true" if fields["honours_idempotency_key"] else "false"
        warnings.append(f"{name} can change the world and does not say whether it honours Unwind's idempotency key "
                        f"(idempotency.honours_key); taken as {taken}. If it ignores the Idempotency-Key header, a "
                        f"step or an undo sent again after a lost answer acts twice: say false (and give it a lookup).")
    return warnings


def _unwind_form(name: str, spec: Any, where: str) -> tuple[str, Any]:
    if functions.is_function_definition(spec):
        return functions.function_tool(spec, where=where, name=name)
    return name, spec


@dataclass
class PolicyDocument:
    tenant: str | None
    defaults: dict
    tools: dict[str, dict]


def parse_document(document: Any) -> PolicyDocument:
    document = checks.require_mapping(document, "policy")
    if "agentSafety" in document:
        safety = checks.require_mapping(document["agentSafety"], "agentSafety")
        unwind = checks.require_mapping(safety.get("unwind", {}), "agentSafety.unwind")
        if str(unwind.get("strategy", "LIFO")).upper() != "LIFO":
            checks.fail("agentSafety.unwind.strategy", "Unwind compensates newest-first; only LIFO is supported")
        if str(unwind.get("onCompensationFailure", "ALERT_AND_CONTINUE")).upper() != "ALERT_AND_CONTINUE":
            checks.fail("agentSafety.unwind.onCompensationFailure", "only ALERT_AND_CONTINUE is supported")
        if "timeout" in unwind:
            checks.duration(unwind["timeout"], "agentSafety.unwind.timeout")
        audit = checks.require_mapping(safety.get("audit", {}), "agentSafety.audit")
        for flag in ("captureIntent", "captureSnapshot"):
            if flag in audit and audit[flag] is not True:
                checks.fail(f"agentSafety.audit.{flag}", "Unwind always captures it; it cannot be turned off")
        tools = _tool_section(safety.get("policies", {}), "agentSafety.policies")
        defaults = _parse_defaults(document.get("defaults", {}))
        if "retention" in audit:
            # Enforced by `manage.py archive` (docs/archive.md): settled runs older than it leave the hot tables.
            defaults["retention_seconds"] = checks.retention(audit["retention"], "agentSafety.audit.retention")
        return PolicyDocument(tenant=document.get("tenant"), defaults=defaults, tools=tools)
    unknown = set(document) - {"tenant", "defaults", "tools"}
    if unknown:
        checks.fail(sorted(unknown)[0], "is not a policy section (known: tenant, defaults, tools, or agentSafety)")
    tools = _tool_section(document.get("tools", {}), "tools")
    return PolicyDocument(tenant=document.get("tenant"), defaults=_parse_defaults(document.get("defaults", {})), tools=tools)


def _parse_defaults(defaults: Any) -> dict:
    defaults = checks.require_mapping(defaults, "defaults")
    parsed: dict[str, Any] = {}
    unknown = set(defaults) - {"approval_threshold", "approval_ttl", "run_idle_timeout", "local_part_case_sensitive",
                               "subaddress_separators", "customer_requests", "retention"}
    if unknown:
        checks.fail(f"defaults.{sorted(unknown)[0]}", "is not a tenant default (known: approval_threshold, approval_ttl, "
                                                "run_idle_timeout, local_part_case_sensitive, subaddress_separators, "
                                                "customer_requests, retention)")
    if "customer_requests" in defaults:
        window = defaults["customer_requests"]
        parsed["customer_requests_seconds"] = 0 if window in ("off", False) else int(checks.duration(
            window, "defaults.customer_requests", minimum=CUSTOMER_REQUESTS_SECONDS[0],
            maximum=CUSTOMER_REQUESTS_SECONDS[1]))
    if "retention" in defaults:
        parsed["retention_seconds"] = checks.retention(defaults["retention"], "defaults.retention")
    if "local_part_case_sensitive" in defaults:
        if not isinstance(defaults["local_part_case_sensitive"], bool):
            checks.fail("defaults.local_part_case_sensitive", "must be true or false")
        parsed["local_part_case_sensitive"] = defaults["local_part_case_sensitive"]
    if "subaddress_separators" in defaults:
        separators = defaults["subaddress_separators"]
        if not isinstance(separators, str) or len(separators) > 4 or set(separators) - set(SUBADDRESS_SEPARATORS):
            checks.fail("defaults.subaddress_separators", f"must be up to 4 of the characters {SUBADDRESS_SEPARATORS} "
                                                          "(\"+\", the default, as in alice+tag@…), or \"\" for none")
        parsed["subaddress_separators"] = separators
    if "approval_threshold" in defaults:
        parsed["approval_threshold"] = checks.choice(defaults["approval_threshold"], Risk, "defaults.approval_threshold")
    if "approval_ttl" in defaults:
        parsed["approval_ttl_seconds"] = int(checks.duration(defaults["approval_ttl"], "defaults.approval_ttl",
                                                       minimum=checks.APPROVAL_TTL_SECONDS[0], maximum=checks.APPROVAL_TTL_SECONDS[1]))
    if "run_idle_timeout" in defaults:
        parsed["run_idle_timeout_seconds"] = int(checks.duration(
            defaults["run_idle_timeout"], "defaults.run_idle_timeout",
            minimum=RUN_IDLE_TIMEOUT_SECONDS[0], maximum=RUN_IDLE_TIMEOUT_SECONDS[1]))
    return parsed


