"""OpenAI-style function definitions (`{"type": "function", "function": {...}}`) accepted as tool policy."""
from __future__ import annotations

from typing import Any

from ledger.policy import checks, schemas, tool_entry

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
    spec = checks.require_mapping(spec, where)
    if spec.get("type") != "function":
        checks.fail(f"{where}.type", f"must be \"function\" (an OpenAI function definition), not {spec.get('type')!r}")
    nested = "function" in spec
    if nested:
        function, prefix = checks.require_mapping(spec["function"], f"{where}.function"), f"{where}.function"
        stray = sorted(FUNCTION_KEYS & set(spec))
        if stray:
            checks.fail(f"{where}.{stray[0]}", "belongs inside function (or drop function and use the flat form)")
        unknown = set(function) - FUNCTION_KEYS
        if unknown:
            checks.fail(f"{prefix}.{sorted(unknown)[0]}", f"is not part of a function definition (known: "
                                                    f"{', '.join(sorted(FUNCTION_KEYS))})")
        policy = {key: value for key, value in spec.items() if key not in ("type", "function")}
    else:
        function, prefix = spec, where
        policy = {key: value for key, value in spec.items() if key not in FUNCTION_KEYS | {"type"}}
    if "args_schema" in policy:
        checks.fail(f"{where}.args_schema", "comes from the function's parameters here; give it there only")
    declared = function.get("name")
    if not isinstance(declared, str) or not tool_entry.TOOL_NAME.match(declared):
        checks.fail(f"{prefix}.name", f"a function needs a name of 1 to 120 letters, digits and . _ : -, not {declared!r}")
    if name is not None and declared != name:
        checks.fail(f"{prefix}.name", f"is {declared!r}, but this tool is {name!r}")
    description = function.get("description", "")
    if not isinstance(description, str):
        checks.fail(f"{prefix}.description", f"must be a string, not {type(description).__name__}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    schemas.check(parameters, where=f"{prefix}.parameters")
    if "strict" in function and not isinstance(function["strict"], bool):
        checks.fail(f"{prefix}.strict", "must be true or false")
    return declared, {**policy, "description": description, "args_schema": parameters}
