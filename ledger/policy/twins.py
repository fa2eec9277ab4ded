"""Inline compensation twins: a tool whose `compensation.tool` is a policy of its own, registered beside it as
`<tool>.undo`, with its argument schema derived from the forward tool's.
"""
from __future__ import annotations

from typing import Any

from ledger.models import CompensationStrategy, SagaRole
from ledger.policy import checks, tool_entry


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
    twin = tool_entry.parse_tool(plan["tool"], spec, where=f"{where}.compensation.tool")
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
            checks.fail(f"{where_of(name)}.compensation.tool", f"the inline twin is registered as {twin!r}, which is "
                                                         f"defined here too; keep one of them")
        everything[twin] = twin_fields
    return everything
