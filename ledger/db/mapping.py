"""A small declarative mapping for compensation args and verification expectations.

Values are literals, except:
- a string starting with "$" is a path into the context: "$args.user_id", "$result.id",
  "$before.priority", "$after.version", "$target", "$key"; "$$" starts a literal "$";
- {"$concat": [part, ...]} joins the parts as text;
- {"$default": [path, fallback]} is the path's value, or the fallback when it is missing.
A path steps into a string that holds a JSON object or array, as LLM tools often return one
(`{"content": "{\"id\": \"B1\"}"}`: "$result.content.id" is "B1"); any other string ends the path.
Nothing is evaluated; an unknown path is an error that names it.
"""
import json
from typing import Any

ROOTS = {"args", "result", "before", "after", "target", "key", "run", "intent"}


class MappingError(ValueError):
    pass


_MISSING = object()


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def decoded(value: Any) -> Any:
    """A string holding a JSON object or array, parsed, so a path can go on into it; anything else as it is."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            parsed = json.loads(value, parse_constant=_not_json)
        except (ValueError, RecursionError):
            return value
        if isinstance(parsed, (dict, list)):
            return parsed
    return value


def _lookup(context: dict, path: str) -> Any:
    head, *rest = path.split(".")
    if head not in ROOTS:
        raise MappingError(f"${path}: unknown root {head!r}; use one of {', '.join(sorted(ROOTS))}")
    value = context.get(head, _MISSING)
    for part in rest:
        value = decoded(value)
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def _text(value: Any) -> str:
    """A value as text in a $concat: a number the agent wrote keeps its literal (`1e2`, not `100.0`)."""
    return getattr(value, "literal", None) or str(value)


def resolve(template: Any, context: dict) -> Any:
    if isinstance(template, str):
        if template.startswith("$$"):
            return template[1:]
        if template.startswith("$"):
            value = _lookup(context, template[1:])
            if value is _MISSING:
                raise MappingError(f"{template} is not present in the action's {template[1:].split('.')[0]}")
            return value
        return template
    if isinstance(template, dict):
        if set(template) == {"$concat"}:
            return "".join(_text(resolve(part, context)) for part in template["$concat"])
        if set(template) == {"$default"}:
            path, fallback = template["$default"]
            try:
                return resolve(path, context)
            except MappingError:
                return resolve(fallback, context)
        return {key: resolve(value, context) for key, value in template.items()}
    if isinstance(template, list):
        return [resolve(item, context) for item in template]
    return template


def check(template: Any, *, where: str) -> None:
    """Validate a template's shape without a context (for policy files)."""
    if isinstance(template, str) and template.startswith("$") and not template.startswith("$$"):
        head = template[1:].split(".")[0]
        if head not in ROOTS:
            raise MappingError(f"{where}: {template} starts with unknown root {head!r}")
    elif isinstance(template, dict):
        if "$concat" in template and not isinstance(template["$concat"], list):
            raise MappingError(f"{where}: $concat takes a list")
        if "$default" in template and not (isinstance(template["$default"], list) and len(template["$default"]) == 2):
            raise MappingError(f"{where}: $default takes [path, fallback]")
        for key, value in template.items():
            check(value, where=f"{where}.{key}")
    elif isinstance(template, list):
        for index, item in enumerate(template):
            check(item, where=f"{where}[{index}]")
