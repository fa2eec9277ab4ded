"""Tool policy: parsing policy files, the approval rule, and the saga ordering law.

A policy file is JSON or YAML, either in the shape of seed 004's configuration template
(`{"agentSafety": {"policies": {...}, "unwind": {...}, "audit": {...}}}`) or flat
(`{"tenant": ..., "defaults": {...}, "tools": {...}}`). Every error names the field it is about.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ledger.policy import describe, registry, schemas
from ledger.executors import egress
from ledger.engine import mapping
from ledger.policy.display import parse_display
from ledger.policy.limits import parse_limits
from ledger.policy.rules import parse_rules
from ledger.errors import OrderingViolation, ValidationFailed
from ledger.models import (
    CUSTOMER_REQUESTS_SECONDS, RISK_ORDER, RUN_IDLE_TIMEOUT_SECONDS, ActionClass, ApprovalRule, CompensationStrategy,
    Executor, OnRefusal, Risk, SagaRole, Tool,
)

# `target.from: agent`: the agent names the target in its proposal (`target`), for a tool whose arguments do not say
# which record it acts on; accepted only once the tool's own read (snapshot.read) finds it.
TARGET_FROM_AGENT = "agent"

TOOL_KEYS = {
    "description", "args_schema", "action_class", "saga_role", "risk", "approval", "approvals_required",
    "executor", "endpoint", "url", "path", "method", "target", "idempotency", "snapshot", "verify", "lookup",
    "compensation", "timeout", "retry", "on_refusal", "describe", "display", "hold", "rules", "limits",
}
COMPENSATION_KEYS = {"strategy", "tool", "args", "risk", "approval", "approvals_required"}
ALIASES = {"delete": CompensationStrategy.TWIN, "twin": CompensationStrategy.TWIN, "cancel": CompensationStrategy.TWIN,
           "snapshot": CompensationStrategy.SNAPSHOT, "restore": CompensationStrategy.SNAPSHOT,
           "correction": CompensationStrategy.CORRECTION, "none": CompensationStrategy.NONE}


def _fail(where: str, why: str):
    raise ValidationFailed(f"{where}: {why}", field=where)


def _choice(value: Any, choices, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices.values:
        _fail(where, f"must be one of {', '.join(choices.values)}, not {value!r}")
    return value.strip().lower()


def _number(value: Any, where: str, *, minimum: float, maximum: float | None = None, integer: bool = False,
            unit: str = ""):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, f"must be a {'whole ' if integer else ''}number, not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        _fail(where, f"must be a finite number, not {value!r}")
    if integer and isinstance(value, float) and not value.is_integer():
        _fail(where, f"must be a whole number, not {value!r}")
    # Compared before any conversion: float(10**400) would raise, int(1e300) would be a 300-digit count.
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum:g} to {maximum:g}{unit}" if maximum is not None else f"at least {minimum:g}{unit}"
        shown = f"{value:.6g}" if isinstance(value, float) else (str(value) if abs(value) < 10**18 else "a number that large")
        _fail(where, f"must be {bounds}, not {shown}")
    return int(value) if integer else float(value)


def _duration(value: Any, where: str, *, minimum: float = 0, maximum: float | None = None) -> float:
    """30, "30s", "2m", "500ms" -> seconds, within [minimum, maximum]."""
    if isinstance(value, str):
        text = value.strip().lower()
        for suffix, factor in (("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600), ("d", 86400)):
            if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
                value = float(text[: -len(suffix)]) * factor
                break
        else:
            _fail(where, f"must be a duration like 30s, 2m or 500ms, not {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value, where, minimum=minimum, maximum=maximum, unit=" seconds")
    _fail(where, f"must be a duration like 30s, 2m or 500ms, not {value!r}")


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        _fail(where, f"must be an object, not {type(value).__name__}")
    return value


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


# The documented bounds (README, "Policy files"): what a policy may ask of the engine.
TIMEOUT_SECONDS = (0.1, 300.0)
MAX_ATTEMPTS = (1, 20)
BACKOFF_SECONDS = (0.0, 3600.0)
APPROVALS_REQUIRED = (1, 10)
APPROVAL_TTL_SECONDS = (1, 30 * 86400)


def _approvals(value: Any, where: str) -> int:
    return _number(value, where, minimum=APPROVALS_REQUIRED[0], maximum=APPROVALS_REQUIRED[1], integer=True)


def _tool_url(url: str, where: str) -> str:
    try:
        egress.check_url(url)
    except egress.Refused as why:
        _fail(where, str(why))
    return url


def _registered(key: str, kind: str, where: str) -> str:
    """Policy names in-process code by registry key only; nothing is imported from a policy string."""
    try:
        registry.get(key, kind)
    except registry.NotRegistered as why:
        _fail(where, f"{why}. Policy names in-process callables by the key a deployer registered in code "
                     f"(ledger.policy.registry), never by import path")
    return key


def _reader(value: Any, where: str) -> str:
    """A snapshot, lookup or verify reader: a URL ("/path" or "http(s)://…") or a registered reader key."""
    if not isinstance(value, str) or not value:
        _fail(where, f"must be a URL or a registered reader key, not {value!r}")
    return _tool_url(value, where) if egress.is_url(value) else _registered(value, "reader", where)


def _endpoint(executor: str, executor_spec: dict, prefix: str, where: str) -> str:
    """An http tool's URL or a python tool's registry key (a client tool has none)."""
    named = next((key for key in ("endpoint", "url", "path") if executor_spec.get(key)), None)
    endpoint = executor_spec.get(named, "") if named else ""
    field = f"{prefix}.{named}"
    if executor != Executor.CLIENT and not endpoint:
        _fail(f"{where}.executor", f"a {executor} tool needs an endpoint (url or path)")
    if endpoint and not isinstance(endpoint, str):
        _fail(field, f"must be a string, not {type(endpoint).__name__}")
    if executor == Executor.HTTP:
        if not egress.is_url(endpoint):
            _fail(field, f"must be an http(s) URL or a path starting with /, not {endpoint[:80]!r}")
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
        _fail(prefix, "an mcp tool names its upstream server and tool: {kind: mcp, server: NAME, tool: NAME}")
    for key in (key for key in SETTINGS_ONLY if key in executor):
        _fail(f"{prefix}.{key}", "is not taken from policy: a deployer declares upstream MCP servers (their URL, "
                                 "headers, or the command, args and env that start them) in UNWIND_MCP_SERVERS, and "
                                 "policy names a server by its name")
    unknown = set(executor) - MCP_EXECUTOR_KEYS
    if unknown:
        _fail(f"{prefix}.{sorted(unknown)[0]}", "is not an mcp executor setting (known: kind, server, tool)")
    for key in ("endpoint", "url", "path"):
        if key in spec:
            _fail(f"{where}.{key}", "is not used by an mcp tool: its executor names the server and tool")
    server, tool = executor.get("server"), executor.get("tool")
    if not isinstance(server, str) or not server:
        _fail(f"{prefix}.server", f"must name a declared MCP server, not {server!r}")
    try:
        declared = mcp_upstream.server(server)
    except mcp_upstream.NotDeclared as why:
        _fail(f"{prefix}.server", str(why))
    refusal = mcp_upstream.origin_refusal(declared)
    if refusal:
        _fail(f"{prefix}.server", f"the server's URL {refusal}")
    if not isinstance(tool, str) or not mcp_upstream.UPSTREAM_TOOL_NAME.match(tool):
        _fail(f"{prefix}.tool", f"must be the upstream tool's name (1 to 128 letters, digits and _ - . /), "
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
            _fail(f"{where}.{sorted(unknown)[0]}", f"is not a hold setting (known: {', '.join(sorted(HOLD_KEYS))})")
        if "for" not in value:
            _fail(f"{where}.for", "a hold needs its length, like 30s")
        can_stop = value.get("customer_can_stop", False)
        if not isinstance(can_stop, bool):
            _fail(f"{where}.customer_can_stop", f"must be true or false, not {can_stop!r}")
        length = value["for"]
        where = f"{where}.for"
    else:
        length, can_stop = value, False
    seconds = _duration(length, where, minimum=HOLD_MIN_SECONDS, maximum=HOLD_MAX_SECONDS)
    return {"seconds": seconds, "customer_can_stop": can_stop}


def parse_tool(name: str, spec: Any, *, where: str) -> dict:
    """Validate one tool's policy and return the Tool field values."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        _fail(where, "a tool name is 1 to 120 letters, digits and . _ : - (like crm.update_ticket)")
    spec = _dict(spec, where)
    unknown = set(spec) - TOOL_KEYS
    if unknown:
        _fail(f"{where}.{sorted(unknown)[0]}", f"is not a tool setting (known: {', '.join(sorted(TOOL_KEYS))})")
    fields: dict[str, Any] = {"description": str(spec.get("description", ""))}

    schema = spec.get("args_schema", {})
    schemas.check(schema, where=f"{where}.args_schema")
    fields["args_schema"] = schema
    fields["describe"] = _describe(spec.get("describe", {}), schema, f"{where}.describe")

    fields["action_class"] = _choice(spec.get("action_class", "internal_update"), ActionClass, f"{where}.action_class")
    fields["saga_role"] = _choice(spec.get("saga_role", "compensatable"), SagaRole, f"{where}.saga_role")
    fields["risk"] = _choice(spec.get("risk", "low"), Risk, f"{where}.risk")
    fields["approval"] = _choice(spec.get("approval", "threshold"), ApprovalRule, f"{where}.approval")
    fields["approvals_required"] = _approvals(spec.get("approvals_required", 1), f"{where}.approvals_required")

    executor = spec.get("executor", "http" if spec.get("endpoint") or spec.get("url") else
                        "python" if spec.get("path") else "client")
    if isinstance(executor, dict):
        executor_spec, prefix = executor, f"{where}.executor"
        kind = executor_spec.get("kind", "http")
    else:
        executor_spec, prefix = spec, where
        kind = executor
    fields["executor"] = _choice(kind, Executor, f"{where}.executor")
    if fields["executor"] == Executor.MCP:
        fields["endpoint"] = _mcp_executor(executor, spec, where)
    else:
        fields["endpoint"] = _endpoint(fields["executor"], executor_spec, prefix, where)

    target = _dict(spec.get("target", {}), f"{where}.target")
    fields["target_type"] = str(target.get("type", ""))
    target_from = str(target.get("from", ""))
    if target_from and target_from != TARGET_FROM_AGENT and (
            target_from.split(".")[0] not in {"args", "result"} or "." not in target_from):
        _fail(f"{where}.target.from", f"must be args.<name>, result.<name> or {TARGET_FROM_AGENT}, not {target_from!r}")
    fields["target_from"] = target_from

    idem = _dict(spec.get("idempotency", {}), f"{where}.idempotency")
    key_fields = idem.get("key_fields", [])
    if not isinstance(key_fields, list) or not all(isinstance(k, str) for k in key_fields):
        _fail(f"{where}.idempotency.key_fields", "must be a list of argument names")
    fields["key_fields"] = key_fields
    # An upstream MCP tool knows nothing of Unwind's key unless its policy says it reads it (from `_meta`).
    honours = idem.get("honours_key", fields["executor"] != Executor.MCP)
    if not isinstance(honours, bool):
        _fail(f"{where}.idempotency.honours_key", "must be true or false")
    fields["honours_idempotency_key"] = honours

    for part in ("snapshot", "verify", "lookup"):
        fields[part] = _template(_dict(spec.get(part, {}), f"{where}.{part}"), f"{where}.{part}")
        if "read" in fields[part]:
            _reader(fields[part]["read"], f"{where}.{part}.read")
    if target_from == TARGET_FROM_AGENT and not fields["snapshot"].get("read"):
        _fail(f"{where}.target.from", "an agent-named target is accepted only once the tool's own read finds it: "
                                      "add snapshot.read")
    if fields["verify"] and not (fields["snapshot"].get("read") or fields["verify"].get("read")):
        _fail(f"{where}.verify", "needs a snapshot.read (or verify.read) to read the target back")

    comp = spec.get("compensation", {"strategy": "none"})
    if isinstance(comp, str):
        comp = {"strategy": comp}
    comp = _dict(comp, f"{where}.compensation")
    unknown = set(comp) - COMPENSATION_KEYS
    if unknown:
        _fail(f"{where}.compensation.{sorted(unknown)[0]}", f"is not a compensation setting (known: {', '.join(sorted(COMPENSATION_KEYS))})")
    strategy = str(comp.get("strategy", "twin")).strip().lower()
    if strategy not in ALIASES:
        _fail(f"{where}.compensation.strategy", f"must be one of twin, snapshot, correction, none, not {comp.get('strategy')!r}")
    plan = {"strategy": ALIASES[strategy]}
    if plan["strategy"] != CompensationStrategy.NONE:
        tool = comp.get("tool")
        if isinstance(tool, dict):
            plan["inline"] = _inline_twin_spec(tool, f"{where}.compensation.tool")
            tool = twin_name(name, f"{where}.compensation.tool")
        if not tool and fields["executor"] != Executor.CLIENT:
            _fail(f"{where}.compensation.tool", f"a {plan['strategy']} compensation needs the tool that performs it")
        if plan["strategy"] == CompensationStrategy.SNAPSHOT and not fields["snapshot"].get("read") and fields["executor"] != Executor.CLIENT:
            _fail(f"{where}.snapshot.read", "a snapshot compensation needs a way to read the target (snapshot.read)")
        if tool and not isinstance(tool, str):
            _fail(f"{where}.compensation.tool", f"must be a tool's name or an inline tool (an object), not {tool!r}")
        plan["tool"] = str(tool or name)
        plan["args"] = _template(_dict(comp.get("args", {}), f"{where}.compensation.args"), f"{where}.compensation.args")
        plan["risk"] = _choice(comp.get("risk", fields["risk"]), Risk, f"{where}.compensation.risk")
        plan["approval"] = _choice(comp.get("approval", "threshold"), ApprovalRule, f"{where}.compensation.approval")
        plan["approvals_required"] = _approvals(comp.get("approvals_required", 1), f"{where}.compensation.approvals_required")
    fields["compensation"] = plan

    fields["timeout_seconds"] = _duration(spec.get("timeout", 10), f"{where}.timeout",
                                          minimum=TIMEOUT_SECONDS[0], maximum=TIMEOUT_SECONDS[1])
    retry = _dict(spec.get("retry", {}), f"{where}.retry")
    fields["max_attempts"] = _number(retry.get("max_attempts", 3), f"{where}.retry.max_attempts",
                                     minimum=MAX_ATTEMPTS[0], maximum=MAX_ATTEMPTS[1], integer=True)
    fields["backoff_seconds"] = _duration(retry.get("backoff", 0.2), f"{where}.retry.backoff",
                                          minimum=BACKOFF_SECONDS[0], maximum=BACKOFF_SECONDS[1])
    fields["on_refusal"] = _choice(spec.get("on_refusal", OnRefusal.ANSWER), OnRefusal, f"{where}.on_refusal")
    fields["display"] = parse_display(spec.get("display", {}), where=f"{where}.display")
    fields["hold"] = _hold(spec.get("hold"), f"{where}.hold")
    # Conditions on the arguments and budgets (ledger/policy/rules.py, ledger/policy/limits.py): compiled and bounded here.
    fields["rules"] = parse_rules(spec.get("rules"), where=f"{where}.rules")
    fields["limits"] = parse_limits(spec.get("limits"), where=f"{where}.limits")
    return fields


# --- inline compensation twins ------------------------------------------------------------------------

TWIN_SUFFIX = ".undo"
TWIN_DERIVED = {"args_schema": "derived from the forward tool's schema and compensation.args",
                "compensation": "an undo has no undo of its own"}


def twin_name(forward: str, where: str) -> str:
    """The name an inline twin is registered under: the forward tool's, with .undo."""
    name = forward + TWIN_SUFFIX
    if not TOOL_NAME.match(name):
        _fail(where, f"an inline twin is registered as {name[:130]!r}, which is longer than a tool name may be "
                     f"(120); shorten the tool's name or register the twin under its own name")
    return name


def _inline_twin_spec(spec: dict, where: str) -> dict:
    """Check the inline twin's own settings (the rest is checked when it is parsed as a tool)."""
    for key, why in TWIN_DERIVED.items():
        if key in spec:
            _fail(f"{where}.{key}", f"is not set on an inline twin: {why}")
    if str(spec.get("saga_role", "compensatable")).strip().lower() == SagaRole.PIVOT:
        _fail(f"{where}.saga_role", "an undo cannot be a pivot; use compensatable or retriable")
    return spec


def _schema_at(schema: Any, path: list[str]) -> dict:
    """The schema of the property at `path` inside an object schema, or {} (anything) when it does not say."""
    for part in path:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or not isinstance(properties.get(part), dict):
            return {}
        schema = properties[part]
    return schema


def twin_args_schema(forward_schema: dict, args: dict) -> dict:
    """The inline twin's args schema: each mapped argument `"$args.x"` is what the forward schema says x is;
    anything else (a `$result` path, a literal, a `$concat`) may be anything. Every mapped key is required."""
    properties = {}
    for key, template in args.items():
        takes_arg = isinstance(template, str) and template.startswith("$args.")
        properties[key] = _schema_at(forward_schema, template[len("$args."):].split(".")) if takes_arg else {}
    schema = {"type": "object", "properties": properties, "required": sorted(args), "additionalProperties": False}
    for defs in ("$defs", "definitions"):  # a property's local $ref points into these
        if defs in forward_schema:
            schema[defs] = forward_schema[defs]
    return schema


def inline_twin(name: str, fields: dict, where: str) -> tuple[str, dict] | None:
    """The tool an inline compensation defines, as (its name, its field values), or None for a twin by name.

    It is an ordinary immutable tool version whose policy derives from the forward tool's, so it changes (and
    gets a new version) exactly when the forward tool's compensation or schema does.
    """
    plan = fields["compensation"]
    if "inline" not in plan:
        return None
    spec = {"description": f"Undo {name} (its inline compensation twin).", "saga_role": SagaRole.COMPENSATABLE,
            "risk": plan["risk"], "approval": plan["approval"], "approvals_required": plan["approvals_required"],
            **plan["inline"], "args_schema": twin_args_schema(fields["args_schema"], plan["args"])}
    twin = parse_tool(plan["tool"], spec, where=f"{where}.compensation.tool")
    twin["compensation"] = {"strategy": CompensationStrategy.NONE, "twin_of": name}
    return plan["tool"], twin


def with_inline_twins(tools: dict[str, dict], where_of) -> dict[str, dict]:
    """`tools` and the inline twins they define; a twin may not take the name of a tool defined beside it."""
    everything = dict(tools)
    for name, fields in tools.items():
        found = inline_twin(name, fields, where_of(name))
        if found is None:
            continue
        twin, twin_fields = found
        if twin in everything:
            _fail(f"{where_of(name)}.compensation.tool", f"the inline twin is registered as {twin!r}, which is "
                                                         f"defined here too; keep one of them")
        everything[twin] = twin_fields
    return everything


# --- OpenAI-style function definitions ---------------------------------------------------------------

FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def is_function_definition(spec: Any) -> bool:
    """Whether a tool entry is written as an OpenAI function definition (it has a `type` key; Unwind's own
    tool settings have none)."""
    return isinstance(spec, dict) and "type" in spec


def function_tool(spec: Any, *, where: str, name: str | None = None) -> tuple[str, dict]:
    """An OpenAI function definition with Unwind's policy keys beside it, as (tool name, Unwind tool spec).

    Chat Completions style, `{"type": "function", "function": {"name", "description", "parameters", "strict"}}`,
    or the flat Responses style, `{"type": "function", "name", "description", "parameters", "strict"}`. The
    function gives the name, the description and the argument schema (`parameters`); every other key is
    Unwind's policy (executor, saga_role, risk, compensation…). `strict` is how the model is asked to fill
    the arguments; Unwind validates them against the schema either way. `name`, when the tool is named
    elsewhere too (a URL, a key), must agree with it.
    """
    spec = _dict(spec, where)
    if spec.get("type") != "function":
        _fail(f"{where}.type", f"must be \"function\" (an OpenAI function definition), not {spec.get('type')!r}")
    nested = "function" in spec
    if nested:
        function, prefix = _dict(spec["function"], f"{where}.function"), f"{where}.function"
        stray = sorted(FUNCTION_KEYS & set(spec))
        if stray:
            _fail(f"{where}.{stray[0]}", "belongs inside function (or drop function and use the flat form)")
        unknown = set(function) - FUNCTION_KEYS
        if unknown:
            _fail(f"{prefix}.{sorted(unknown)[0]}", f"is not part of a function definition (known: "
                                                    f"{', '.join(sorted(FUNCTION_KEYS))})")
        policy = {key: value for key, value in spec.items() if key not in ("type", "function")}
    else:
        function, prefix = spec, where
        policy = {key: value for key, value in spec.items() if key not in FUNCTION_KEYS | {"type"}}
    if "args_schema" in policy:
        _fail(f"{where}.args_schema", "comes from the function's parameters here; give it there only")
    declared = function.get("name")
    if not isinstance(declared, str) or not TOOL_NAME.match(declared):
        _fail(f"{prefix}.name", f"a function needs a name of 1 to 120 letters, digits and . _ : -, not {declared!r}")
    if name is not None and declared != name:
        _fail(f"{prefix}.name", f"is {declared!r}, but this tool is {name!r}")
    description = function.get("description", "")
    if not isinstance(description, str):
        _fail(f"{prefix}.description", f"must be a string, not {type(description).__name__}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    schemas.check(parameters, where=f"{prefix}.parameters")
    if "strict" in function and not isinstance(function["strict"], bool):
        _fail(f"{prefix}.strict", "must be true or false")
    return declared, {**policy, "description": description, "args_schema": parameters}


def _tool_section(section: Any, where: str) -> dict[str, dict]:
    """A document's tools, parsed: an object of name → tool (each in Unwind's form or an OpenAI function
    definition), or a list of OpenAI function definitions, each naming itself."""
    if isinstance(section, list):
        tools: dict[str, dict] = {}
        places: dict[str, str] = {}
        for index, entry in enumerate(section):
            at = f"{where}[{index}]"
            name, spec = function_tool(entry, where=at)
            if name in tools:
                named_at = f"{at}.function.name" if isinstance(entry, dict) and "function" in entry else f"{at}.name"
                _fail(named_at, f"{name!r} is defined twice")
            tools[name], places[name] = parse_tool(name, spec, where=at), at
        return with_inline_twins(tools, places.get)
    section = _dict(section, where)
    tools = {name: parse_tool(*_unwind_form(name, spec, f"{where}.{name}"), where=f"{where}.{name}")
             for name, spec in section.items()}
    return with_inline_twins(tools, lambda name: f"{where}.{name}")


def keys_left_implicit(document: Any) -> list[str]:
    """Warnings for the tools of a (valid) policy document that can change the world and do not say whether they
    honour Unwind's idempotency key: the default is taken (true, but false for MCP tools), and a tool that in fact
    ignores keys acts twice when a lost step, or an undo, is sent again with the same key."""
    document = _dict(document, "policy")
    section = _dict(document.get("agentSafety", {}), "agentSafety").get("policies", {}) \
        if "agentSafety" in document else document.get("tools", {})
    entries = [function_tool(entry, where="tools") for entry in section] if isinstance(section, list) \
        else [_unwind_form(name, spec, f"tools.{name}") for name, spec in _dict(section, "tools").items()]
    warnings = []
    for name, spec in entries:
        fields = parse_tool(name, spec, where=f"tools.{name}")
        stated = isinstance(spec.get("idempotency"), dict) and "honours_key" in spec["idempotency"]
        if stated or fields["action_class"] == ActionClass.READ_ONLY or fields["executor"] == Executor.CLIENT:
            continue
        taken = "true" if fields["honours_idempotency_key"] else "false"
        warnings.append(f"{name} can change the world and does not say whether it honours Unwind's idempotency key "
                        f"(idempotency.honours_key); taken as {taken}. If it ignores the Idempotency-Key header, a "
                        f"step or an undo sent again after a lost answer acts twice: say false (and give it a lookup).")
    return warnings


def _unwind_form(name: str, spec: Any, where: str) -> tuple[str, Any]:
    if is_function_definition(spec):
        return function_tool(spec, where=where, name=name)
    return name, spec


@dataclass
class PolicyDocument:
    tenant: str | None
    defaults: dict
    tools: dict[str, dict]


def parse_document(document: Any) -> PolicyDocument:
    document = _dict(document, "policy")
    if "agentSafety" in document:
        safety = _dict(document["agentSafety"], "agentSafety")
        unwind = _dict(safety.get("unwind", {}), "agentSafety.unwind")
        if str(unwind.get("strategy", "LIFO")).upper() != "LIFO":
            _fail("agentSafety.unwind.strategy", "Unwind compensates newest-first; only LIFO is supported")
        if str(unwind.get("onCompensationFailure", "ALERT_AND_CONTINUE")).upper() != "ALERT_AND_CONTINUE":
            _fail("agentSafety.unwind.onCompensationFailure", "only ALERT_AND_CONTINUE is supported")
        if "timeout" in unwind:
            _duration(unwind["timeout"], "agentSafety.unwind.timeout")
        audit = _dict(safety.get("audit", {}), "agentSafety.audit")
        for flag in ("captureIntent", "captureSnapshot"):
            if flag in audit and audit[flag] is not True:
                _fail(f"agentSafety.audit.{flag}", "Unwind always captures it; it cannot be turned off")
        tools = _tool_section(safety.get("policies", {}), "agentSafety.policies")
        return PolicyDocument(tenant=document.get("tenant"), defaults=_parse_defaults(document.get("defaults", {})), tools=tools)
    unknown = set(document) - {"tenant", "defaults", "tools"}
    if unknown:
        _fail(sorted(unknown)[0], "is not a policy section (known: tenant, defaults, tools, or agentSafety)")
    tools = _tool_section(document.get("tools", {}), "tools")
    return PolicyDocument(tenant=document.get("tenant"), defaults=_parse_defaults(document.get("defaults", {})), tools=tools)


def _parse_defaults(defaults: Any) -> dict:
    defaults = _dict(defaults, "defaults")
    parsed: dict[str, Any] = {}
    unknown = set(defaults) - {"approval_threshold", "approval_ttl", "run_idle_timeout", "local_part_case_sensitive",
                               "customer_requests"}
    if unknown:
        _fail(f"defaults.{sorted(unknown)[0]}", "is not a tenant default (known: approval_threshold, approval_ttl, "
                                                "run_idle_timeout, local_part_case_sensitive, customer_requests)")
    if "customer_requests" in defaults:
        window = defaults["customer_requests"]
        parsed["customer_requests_seconds"] = 0 if window in ("off", False) else int(_duration(
            window, "defaults.customer_requests", minimum=CUSTOMER_REQUESTS_SECONDS[0],
            maximum=CUSTOMER_REQUESTS_SECONDS[1]))
    if "local_part_case_sensitive" in defaults:
        if not isinstance(defaults["local_part_case_sensitive"], bool):
            _fail("defaults.local_part_case_sensitive", "must be true or false")
        parsed["local_part_case_sensitive"] = defaults["local_part_case_sensitive"]
    if "approval_threshold" in defaults:
        parsed["approval_threshold"] = _choice(defaults["approval_threshold"], Risk, "defaults.approval_threshold")
    if "approval_ttl" in defaults:
        parsed["approval_ttl_seconds"] = int(_duration(defaults["approval_ttl"], "defaults.approval_ttl",
                                                       minimum=APPROVAL_TTL_SECONDS[0], maximum=APPROVAL_TTL_SECONDS[1]))
    if "run_idle_timeout" in defaults:
        parsed["run_idle_timeout_seconds"] = int(_duration(
            defaults["run_idle_timeout"], "defaults.run_idle_timeout",
            minimum=RUN_IDLE_TIMEOUT_SECONDS[0], maximum=RUN_IDLE_TIMEOUT_SECONDS[1]))
    return parsed


def approvals_needed(*, rule: str, risk: str, required: int, threshold: str) -> int:
    """How many distinct approvals an action needs before it runs (0 = none); `threshold` is the tenant's
    approval threshold (the lowest risk that needs a person under the threshold rule)."""
    if rule == ApprovalRule.AUTO:
        return 0
    if rule == ApprovalRule.MANUAL or RISK_ORDER[risk] >= RISK_ORDER[threshold]:
        return max(1, required)
    return 0


ROLE_RANK = {SagaRole.COMPENSATABLE: 0, SagaRole.PIVOT: 1, SagaRole.RETRIABLE: 2}


def check_order(earlier: list[tuple[int, str, str]], *, tool: Tool) -> None:
    """Refuse `tool` if it would break the ordering law after the run's `earlier` (seq, tool, role) steps.

    Compensatable steps first, then at most one pivot, then retriable steps. Read-only tools change
    nothing and may come anywhere.
    """
    if tool.action_class == ActionClass.READ_ONLY:
        return
    role = tool.saga_role
    for seq, name, other in earlier:
        if role == SagaRole.PIVOT and other == SagaRole.PIVOT:
            raise OrderingViolation(
                f"{tool.name} is a pivot, but {name} (step {seq}) already is this run's pivot; a run has at most one",
                rule="one_pivot", conflicts_with={"seq": seq, "tool": name})
        if ROLE_RANK[other] > ROLE_RANK[role]:
            rule = "compensatable_before_pivot" if role == SagaRole.COMPENSATABLE else "pivot_before_retriable"
            raise OrderingViolation(
                f"{tool.name} is {role}, but {name} (step {seq}) is {other}: compensatable steps come first, "
                f"then at most one pivot, then retriable steps",
                rule=rule, conflicts_with={"seq": seq, "tool": name})


def check_plan(plan: list[str], tools: dict[str, Tool]) -> None:
    """Check a declared plan (tool names in order) against the ordering law before anything runs."""
    earlier: list[tuple[int, str, str]] = []
    for index, name in enumerate(plan, start=1):
        tool = tools.get(name)
        if tool is None:
            raise ValidationFailed(f"plan[{index - 1}]: {name!r} is not a registered tool", field=f"plan[{index - 1}]")
        check_order(earlier, tool=tool)
        if tool.action_class != ActionClass.READ_ONLY:
            earlier.append((index, name, tool.saga_role))
