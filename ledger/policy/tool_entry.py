"""A tool's policy entry, field by field: each field's check, bounds and default, and `parse_tool`, which gives a tool's
model fields from its policy entry. Every error names the field it is about.
"""
from __future__ import annotations

import re
from typing import Any

from ledger.db import mapping
from ledger.errors import ValidationFailed
from ledger.executors import egress
from ledger.models import ActionClass, ApprovalRule, CompensationStrategy, Executor, OnRefusal, Risk, SagaRole
from ledger.policy import checks, describe, registry, schemas
from ledger.policy.display import parse_display
from ledger.policy.limits import parse_limits
from ledger.policy.rules import parse_rules

# `target.from: agent`: the agent names the target in its proposal (`target`), for a tool whose arguments do not say
# which record it acts on; accepted only once the tool's own read (snapshot.read) finds it.
TARGET_FROM_AGENT = "agent"


TOOL_KEYS = {
    "description", "args_schema", "action_class", "saga_role", "risk", "approval", "approvals_required",
    "executor", "endpoint", "url", "path", "method", "target", "idempotency", "snapshot", "verify", "lookup",
    "compensation", "timeout", "retry", "on_refusal", "describe", "display", "hold", "rules", "limits",
    "retention",
}


COMPENSATION_KEYS = {"strategy", "tool", "args", "risk", "approval", "approvals_required"}


ALIASES = {"delete": CompensationStrategy.TWIN, "twin": CompensationStrategy.TWIN, "cancel": CompensationStrategy.TWIN,
           "snapshot": CompensationStrategy.SNAPSHOT, "restore": CompensationStrategy.SNAPSHOT,
           "correction": CompensationStrategy.CORRECTION, "none": CompensationStrategy.NONE}


def _template(value: Any, where: str):
    try:
        mapping.check(value, where=where)
    except mapping.MappingError as exc:
        raise ValidationFailed(str(exc), field=where) from None
    return value


def _describe(value: Any, schema: Any, where: str) -> dict:
    """The tool's sentences for the correction trail (ledger/policy/describe.py): refused here, not at a customer's page."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    names = set(properties) if isinstance(properties, dict) else None
    try:
        return describe.check(value, where=where, arg_names=names)
    except describe.TemplateError as why:
        raise ValidationFailed(str(why), field=why.field) from None


def _approvals(value: Any, where: str) -> int:
    return checks.number(value, where, minimum=checks.APPROVALS_REQUIRED[0], maximum=checks.APPROVALS_REQUIRED[1], integer=True)


def _tool_url(url: str, where: str) -> str:
    try:
        egress.check_url(url)
    except egress.Refused as why:
        checks.fail(where, str(why))
    return url


def _registered(key: str, kind: str, where: str) -> str:
    """Policy names in-process code by registry key only; nothing is imported from a policy string."""
    try:
        registry.get(key, kind)
    except registry.NotRegistered as why:
        checks.fail(where, f"{why}. Policy names in-process callables by the key a deployer registered in code "
                     f"(ledger.policy.registry), never by import path")
    return key


def _reader(value: Any, where: str) -> str:
    """A snapshot, lookup or verify reader: a URL ("/path" or "http(s)://…") or a registered reader key."""
    if not isinstance(value, str) or not value:
        checks.fail(where, f"must be a URL or a registered reader key, not {value!r}")
    return _tool_url(value, where) if egress.is_url(value) else _registered(value, "reader", where)


def _endpoint(executor: str, executor_spec: dict, prefix: str, where: str) -> str:
    """An http tool's URL or a python tool's registry key (a client tool has none)."""
    named = next((key for key in ("endpoint", "url", "path") if executor_spec.get(key)), None)
    endpoint = executor_spec.get(named, "") if named else ""
    field = f"{prefix}.{named}"
    if executor != Executor.CLIENT and not endpoint:
        checks.fail(f"{where}.executor", f"a {executor} tool needs an endpoint (url or path)")
    if endpoint and not isinstance(endpoint, str):
        checks.fail(field, f"must be a string, not {type(endpoint).__name__}")
    if executor == Executor.HTTP:
        if not egress.is_url(endpoint):
            checks.fail(field, f"must be an http(s) URL or a path starting with /, not {endpoint[:80]!r}")
        _tool_url(endpoint, field)
    elif executor == Executor.PYTHON:
        _registered(endpoint, "tool", field)
    return str(endpoint)


MCP_EXECUTOR_KEYS = {"kind", "server", "tool"}


SETTINGS_ONLY = ("command", "args", "env", "cwd", "url", "headers")


def _mcp_executor(executor: Any, spec: dict, where: str) -> str:
    """`{kind: mcp, server: NAME, tool: NAME}` → "server/tool". The server must be one a deployer declared in
    UNWIND_MCP_SERVERS: policy names it and never says where it lives or what command starts it."""
    from ledger.executors import mcp as mcp_upstream

    prefix = f"{where}.executor"
    if not isinstance(executor, dict):
        checks.fail(prefix, "an mcp tool names its upstream server and tool: {kind: mcp, server: NAME, tool: NAME}")
    for key in (key for key in SETTINGS_ONLY if key in executor):
        checks.fail(f"{prefix}.{key}", "is not taken from policy: a deployer declares upstream MCP servers (their URL, "
                                 "headers, or the command, args and env that start them) in UNWIND_MCP_SERVERS, and "
                                 "policy names a server by its name")
    unknown = set(executor) - MCP_EXECUTOR_KEYS
    if unknown:
        checks.fail(f"{prefix}.{sorted(unknown)[0]}", "is not an mcp executor setting (known: kind, server, tool)")
    for key in ("endpoint", "url", "path"):
        if key in spec:
            checks.fail(f"{where}.{key}", "is not used by an mcp tool: its executor names the server and tool")
    server, tool = executor.get("server"), executor.get("tool")
    if not isinstance(server, str) or not server:
        checks.fail(f"{prefix}.server", f"must name a declared MCP server, not {server!r}")
    try:
        declared = mcp_upstream.server(server)
    except mcp_upstream.NotDeclared as why:
        checks.fail(f"{prefix}.server", str(why))
    refusal = mcp_upstream.origin_refusal(declared)
    if refusal:
        checks.fail(f"{prefix}.server", f"the server's URL {refusal}")
    if not isinstance(tool, str) or not mcp_upstream.UPSTREAM_TOOL_NAME.match(tool):
        checks.fail(f"{prefix}.tool", f"must be the upstream tool's name (1 to 128 letters, digits and _ - . /), "
                                f"not {str(tool)[:80]!r}")
    return mcp_upstream.endpoint(server, tool)


TOOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,119}$")


# A step's hold (ledger/engine/holds.py): a moment in which it can still be stopped, never a queue.
HOLD_MAX_SECONDS = 3600.0  # a hold is a moment to change one's mind, not a queue: at most an hour


HOLD_MIN_SECONDS = 1.0


HOLD_KEYS = {"for", "customer_can_stop"}


def _hold(value, where: str) -> dict:
    """A policy's `hold` as stored on the tool: {} (none, the default), or {"seconds", "customer_can_stop"}."""
    if value is None:
        return {}
    if isinstance(value, dict):
        unknown = set(value) - HOLD_KEYS
        if unknown:
            checks.fail(f"{where}.{sorted(unknown)[0]}", f"is not a hold setting (known: {', '.join(sorted(HOLD_KEYS))})")
        if "for" not in value:
            checks.fail(f"{where}.for", "a hold needs its length, like 30s")
        can_stop = value.get("customer_can_stop", False)
        if not isinstance(can_stop, bool):
            checks.fail(f"{where}.customer_can_stop", f"must be true or false, not {can_stop!r}")
        length = value["for"]
        where = f"{where}.for"
    else:
        length, can_stop = value, False
    seconds = checks.duration(length, where, minimum=HOLD_MIN_SECONDS, maximum=HOLD_MAX_SECONDS)
    return {"seconds": seconds, "customer_can_stop": can_stop}


def parse_tool(name: str, spec: Any, *, where: str) -> dict:
    """Validate one tool's policy and return the Tool field values."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        checks.fail(where, "a tool name is 1 to 120 letters, digits and . _ : - (like crm.update_ticket)")
    spec = checks.require_mapping(spec, where)
    unknown = set(spec) - TOOL_KEYS
    if unknown:
        checks.fail(f"{where}.{sorted(unknown)[0]}", f"is not a tool setting (known: {', '.join(sorted(TOOL_KEYS))})")
    fields: dict[str, Any] = {"description": str(spec.get("description", ""))}

    schema = spec.get("args_schema", {})
    schemas.check(schema, where=f"{where}.args_schema")
    fields["args_schema"] = schema
    fields["describe"] = _describe(spec.get("describe", {}), schema, f"{where}.describe")

    fields["action_class"] = checks.choice(spec.get("action_class", "internal_update"), ActionClass, f"{where}.action_class")
    fields["saga_role"] = checks.choice(spec.get("saga_role", "compensatable"), SagaRole, f"{where}.saga_role")
    fields["risk"] = checks.choice(spec.get("risk", "low"), Risk, f"{where}.risk")
    fields["approval"] = checks.choice(spec.get("approval", "threshold"), ApprovalRule, f"{where}.approval")
    fields["approvals_required"] = _approvals(spec.get("approvals_required", 1), f"{where}.approvals_required")

    executor = spec.get("executor", "http" if spec.get("endpoint") or spec.get("url") else
                        "python" if spec.get("path") else "client")
    if isinstance(executor, dict):
        executor_spec, prefix = executor, f"{where}.executor"
        kind = executor_spec.get("kind", "http")
    else:
        executor_spec, prefix = spec, where
        kind = executor
    fields["executor"] = checks.choice(kind, Executor, f"{where}.executor")
    if fields["executor"] == Executor.MCP:
        fields["endpoint"] = _mcp_executor(executor, spec, where)
    else:
        fields["endpoint"] = _endpoint(fields["executor"], executor_spec, prefix, where)

    target = checks.require_mapping(spec.get("target", {}), f"{where}.target")
    fields["target_type"] = str(target.get("type", ""))
    target_from = str(target.get("from", ""))
    if target_from and target_from != TARGET_FROM_AGENT and (
            target_from.split(".")[0] not in {"args", "result"} or "." not in target_from):
        checks.fail(f"{where}.target.from", f"must be args.<name>, result.<name> or {TARGET_FROM_AGENT}, not {target_from!r}")
    fields["target_from"] = target_from

    idem = checks.require_mapping(spec.get("idempotency", {}), f"{where}.idempotency")
    key_fields = idem.get("key_fields", [])
    if not isinstance(key_fields, list) or not all(isinstance(k, str) for k in key_fields):
        checks.fail(f"{where}.idempotency.key_fields", "must be a list of argument names")
    fields["key_fields"] = key_fields
    # An upstream MCP tool knows nothing of Unwind's key unless its policy says it reads it (from `_meta`).
    honours = idem.get("honours_key", fields["executor"] != Executor.MCP)
    if not isinstance(honours, bool):
        checks.fail(f"{where}.idempotency.honours_key", "must be true or false")
    fields["honours_idempotency_key"] = honours

    for part in ("snapshot", "verify", "lookup"):
        fields[part] = _template(checks.require_mapping(spec.get(part, {}), f"{where}.{part}"), f"{where}.{part}")
        if "read" in fields[part]:
            _reader(fields[part]["read"], f"{where}.{part}.read")
    if target_from == TARGET_FROM_AGENT and not fields["snapshot"].get("read"):
        checks.fail(f"{where}.target.from", "an agent-named target is accepted only once the tool's own read finds it: "
                                      "add snapshot.read")
    if fields["verify"] and not (fields["snapshot"].get("read") or fields["verify"].get("read")):
        checks.fail(f"{where}.verify", "needs a snapshot.read (or verify.read) to read the target back")

    comp = spec.get("compensation", {"strategy": "none"})
    if isinstance(comp, str):
        comp = {"strategy": comp}
    comp = checks.require_mapping(comp, f"{where}.compensation")
    unknown = set(comp) - COMPENSATION_KEYS
    if unknown:
        checks.fail(f"{where}.compensation.{sorted(unknown)[0]}", f"is not a compensation setting (known: {', '.join(sorted(COMPENSATION_KEYS))})")
    strategy = str(comp.get("strategy", "twin")).strip().lower()
    if strategy not in ALIASES:
        checks.fail(f"{where}.compensation.strategy", f"must be one of twin, snapshot, correction, none, not {comp.get('strategy')!r}")
    plan = {"strategy": ALIASES[strategy]}
    if plan["strategy"] != CompensationStrategy.NONE:
        tool = comp.get("tool")
        if isinstance(tool, dict):
            plan["inline"] = _inline_twin_spec(tool, f"{where}.compensation.tool")
            tool = twin_name(name, f"{where}.compensation.tool")
        if not tool and fields["executor"] != Executor.CLIENT:
            checks.fail(f"{where}.compensation.tool", f"a {plan['strategy']} compensation needs the tool that performs it")
        if plan["strategy"] == CompensationStrategy.SNAPSHOT and not fields["snapshot"].get("read") and fields["executor"] != Executor.CLIENT:
            checks.fail(f"{where}.snapshot.read", "a snapshot compensation needs a way to read the target (snapshot.read)")
        if tool and not isinstance(tool, str):
            checks.fail(f"{where}.compensation.tool", f"must be a tool's name or an inline tool (an object), not {tool!r}")
        plan["tool"] = str(tool or name)
        plan["args"] = _template(checks.require_mapping(comp.get("args", {}), f"{where}.compensation.args"), f"{where}.compensation.args")
        plan["risk"] = checks.choice(comp.get("risk", fields["risk"]), Risk, f"{where}.compensation.risk")
        plan["approval"] = checks.choice(comp.get("approval", "threshold"), ApprovalRule, f"{where}.compensation.approval")
        plan["approvals_required"] = _approvals(comp.get("approvals_required", 1), f"{where}.compensation.approvals_required")
    fields["compensation"] = plan

    fields["timeout_seconds"] = checks.duration(spec.get("timeout", 10), f"{where}.timeout",
                                          minimum=checks.TIMEOUT_SECONDS[0], maximum=checks.TIMEOUT_SECONDS[1])
    retry = checks.require_mapping(spec.get("retry", {}), f"{where}.retry")
    fields["max_attempts"] = checks.number(retry.get("max_attempts", 3), f"{where}.retry.max_attempts",
                                     minimum=checks.MAX_ATTEMPTS[0], maximum=checks.MAX_ATTEMPTS[1], integer=True)
    fields["backoff_seconds"] = checks.duration(retry.get("backoff", 0.2), f"{where}.retry.backoff",
                                          minimum=checks.BACKOFF_SECONDS[0], maximum=checks.BACKOFF_SECONDS[1])
    fields["on_refusal"] = checks.choice(spec.get("on_refusal", OnRefusal.ANSWER), OnRefusal, f"{where}.on_refusal")
    fields["display"] = parse_display(spec.get("display", {}), where=f"{where}.display")
    fields["hold"] = _hold(spec.get("hold"), f"{where}.hold")
    # Conditions on the arguments and budgets (ledger/policy/rules.py, ledger/policy/limits.py): compiled and bounded here.
    fields["rules"] = parse_rules(spec.get("rules"), where=f"{where}.rules")
    fields["limits"] = parse_limits(spec.get("limits"), where=f"{where}.limits")
    # How long a settled run that called it stays hot (docs/archive.md); 0: as long as its tenant says.
    fields["retention_seconds"] = checks.retention(spec.get("retention", 0), f"{where}.retention")
    return fields


TWIN_SUFFIX = ".undo"


TWIN_DERIVED = {"args_schema": "derived from the forward tool's schema and compensation.args",
                "compensation": "an undo has no undo of its own"}


def twin_name(forward: str, where: str) -> str:
    """The name an inline twin is registered under: the forward tool's, with .undo."""
    name = forward + TWIN_SUFFIX
    if not TOOL_NAME.match(name):
        checks.fail(where, f"an inline twin is registered as {name[:130]!r}, which is longer than a tool name may be "
                     f"(120); shorten the tool's name or register the twin under its own name")
    return name


def _inline_twin_spec(spec: dict, where: str) -> dict:
    """Check the inline twin's own settings (the rest is checked when it is parsed as a tool)."""
    for key, why in TWIN_DERIVED.items():
        if key in spec:
            checks.fail(f"{where}.{key}", f"is not set on an inline twin: {why}")
    if str(spec.get("saga_role", "compensatable")).strip().lower() == SagaRole.PIVOT:
        checks.fail(f"{where}.saga_role", "an undo cannot be a pivot; use compensatable or retriable")
    return spec
