"""Tools' argument schemas, safe to evaluate on an agent's input.

A tool's `args_schema` is written by whoever writes policy and evaluated against every proposal, so it
must not be a way to make Unwind fetch a URL or spin a CPU:

- `$ref` and `$dynamicRef` must point inside the schema ("#…"), and validation runs with a
  `referencing.Registry` that refuses to retrieve anything, so no remote schema is ever fetched.
- `pattern`, `patternProperties` (also where `additionalProperties` consults them) and `format: regex`
  run on RE2, whose matching time is linear in the input; a pattern RE2 cannot compile (backreferences,
  lookaround) is refused when the policy is written. `unevaluatedProperties` beside `patternProperties`
  is refused, because jsonschema evaluates that pair with Python's backtracking `re`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jsonschema
import re2
import referencing
import referencing.exceptions
from jsonschema import ValidationError
from jsonschema.validators import Draft202012Validator, extend

from ledger.errors import ValidationFailed

MAX_PATTERN = 1000
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False
# Schema keywords whose values are data, not schemas: their insides are reported by JSON path but walked
# all the same, because a local "$ref" can point into any part of the document.
_DATA = ("const", "enum", "default", "examples")


class Unsafe(ValueError):
    """A schema that would fetch, or run a pattern RE2 cannot; `where` is the path inside the schema."""

    def __init__(self, where: str, why: str):
        super().__init__(why)
        self.where = where
        self.why = why


@lru_cache(maxsize=1024)
def compiled(pattern: str):
    """The RE2 program for `pattern`; re2.error when RE2 cannot run it."""
    if len(pattern) > MAX_PATTERN:
        raise re2.error(f"longer than {MAX_PATTERN} characters")
    return re2.compile(pattern, _OPTIONS)


def _check_pattern(pattern: Any, where: str) -> None:
    if not isinstance(pattern, str):
        return
    try:
        compiled(pattern)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise Unsafe(where, f"pattern {pattern[:80]!r} cannot run on a linear-time regex engine ({reason}); "
                            f"backreferences and lookaround are not supported") from None


def _walk(node: Any, where: str, seen: dict) -> None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            _walk(item, f"{where}[{index}]", seen)
        return
    if not isinstance(node, dict):
        return
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if isinstance(ref, str) and not ref.startswith("#"):
            raise Unsafe(f"{where}.{keyword}", f"{ref[:80]!r} points outside the schema; only local references "
                                               f"(\"#/$defs/…\") are allowed, nothing is fetched")
    _check_pattern(node.get("pattern"), f"{where}.pattern")
    if isinstance(node.get("patternProperties"), dict):
        seen["patternProperties"] = seen.get("patternProperties") or f"{where}.patternProperties"
        for pattern in node["patternProperties"]:
            _check_pattern(pattern, f"{where}.patternProperties")
    if "unevaluatedProperties" in node:
        seen["unevaluatedProperties"] = seen.get("unevaluatedProperties") or f"{where}.unevaluatedProperties"
    for key, value in node.items():
        _walk(value, f"{where}.{key}", seen)


def check(schema: Any, *, where: str) -> None:
    """Refuse a schema that is invalid, fetches, or cannot run in linear time; the error names the field."""
    if not isinstance(schema, dict):
        raise ValidationFailed(f"{where}: must be an object, not {type(schema).__name__}", field=where)
    seen: dict = {}
    try:
        _walk(schema, where, seen)
    except Unsafe as unsafe:
        raise ValidationFailed(f"{unsafe.where}: {unsafe.why}", field=unsafe.where) from None
    if "unevaluatedProperties" in seen and "patternProperties" in seen:
        field = seen["unevaluatedProperties"]
        raise ValidationFailed(f"{field}: cannot be combined with patternProperties ({seen['patternProperties']}), "
                               f"which it would evaluate with a backtracking regex engine", field=field)
    try:
        SafeValidator.check_schema(schema, format_checker=FORMAT_CHECKER)
    except jsonschema.SchemaError as exc:
        raise ValidationFailed(f"{where}: is not a valid JSON Schema: {exc.message}", field=where) from None


# --- evaluation -----------------------------------------------------------------------------------

def _search(pattern: str, text: str) -> bool:
    try:
        return compiled(pattern).search(text) is not None
    except re2.error:
        # Only a schema written around the policy checks (the Django admin) gets here: refuse the value.
        return False


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [key for key in instance
              if key not in properties and not any(_search(pattern, key) for pattern in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        if patterns:
            joined = ", ".join(repr(each) for each in sorted(extras))
            yield ValidationError(f"{joined} {'does' if len(extras) == 1 else 'do'} not match any of the regexes: "
                                  f"{', '.join(repr(each) for each in sorted(patterns))}")
        else:
            listed = ", ".join(repr(each) for each in sorted(extras, key=str))
            yield ValidationError(f"Additional properties are not allowed ({listed} "
                                  f"{'was' if len(extras) == 1 else 'were'} unexpected)")


FORMAT_CHECKER = jsonschema.FormatChecker()


@FORMAT_CHECKER.checks("regex", raises=re2.error)
def _is_regex(instance) -> bool:
    if isinstance(instance, str):
        compiled(instance)
    return True


SafeValidator = extend(Draft202012Validator, validators={
    "pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties,
}, format_checker=FORMAT_CHECKER)


def _refuse(uri: str):
    raise referencing.exceptions.NoSuchResource(ref=uri)


NOTHING_REMOTE = referencing.Registry(retrieve=_refuse)


@lru_cache(maxsize=256)
def _validator(schema_text: str):
    """A validator for the schema written as `schema_text`, built once: building one crawls its schema for
    references, which took a proposal longer than validating its args. Validators keep no state between uses, and
    this one has a copy of the schema of its own."""
    return SafeValidator(json.loads(schema_text), registry=NOTHING_REMOTE, format_checker=FORMAT_CHECKER)


def errors(schema: dict, instance: Any) -> list[ValidationError]:
    """Every way `instance` fails `schema`, in path order, evaluated without fetching or backtracking."""
    validator = _validator(json.dumps(schema or {}))  # as written: its keywords are checked in that order
    try:
        return sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    except referencing.exceptions.Unresolvable as exc:
        raise ValidationFailed(f"args_schema: the tool's schema has a reference that cannot be resolved ({exc}); "
                               f"nothing outside the schema is fetched", field="args_schema") from None
