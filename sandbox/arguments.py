"""Strict readers for a tool's JSON arguments: exact types, required fields, no unknown names.

A request the sandbox cannot understand is refused with a 400 that names the field, never guessed at.
"""
import datetime
import math
from collections.abc import Iterable, Sequence
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import validate_email

from sandbox.errors import InvalidArgument

_REQUIRED = object()
_ABSENT = object()
MAX_DEPTH = 20


def check_json_document(value: Any, *, depth: int = 0) -> None:
    """Refuse what a JSON column cannot hold: NUL characters, NaN or infinite numbers, non-JSON values,
    and nesting no tool needs."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"the arguments nest deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument("the arguments contain a NUL character")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument("the arguments contain a number that is not finite")
    elif isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise InvalidArgument("the arguments' field names must be strings")
            check_json_document(name, depth=depth + 1)
            check_json_document(item, depth=depth + 1)
    elif isinstance(value, list):
        for item in value:
            check_json_document(item, depth=depth + 1)
    elif value is not None and not isinstance(value, (bool, int)):
        raise InvalidArgument(f"the arguments hold a {type(value).__name__}, which is not JSON")


class Arguments:
    def __init__(self, raw: Any, *, allowed: Iterable[str]):
        allowed = set(allowed)
        if not isinstance(raw, dict):
            raise InvalidArgument(f"the arguments must be a JSON object, not {_json_type(raw)}")
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise InvalidArgument(
                f"unknown field {', '.join(map(repr, unknown))}; the fields are {', '.join(sorted(allowed))}"
            )
        self._raw = raw

    def given(self, name: str) -> bool:
        """Whether the field was sent at all (even as null)."""
        return name in self._raw

    def _value(self, name: str) -> Any:
        """The sent value, or _ABSENT when the field is missing or null."""
        value = self._raw.get(name)
        return _ABSENT if value is None else value

    @staticmethod
    def _default(name: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise InvalidArgument(f"{name} is required")
        return default

    def text(self, name: str, *, default: Any = _REQUIRED, max_length: int = 200) -> Any:
        value = self._value(name)
        if value is _ABSENT:
            return self._default(name, default)
        if not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a string, not {_json_type(value)}")
        value = value.strip()
        if not value:
            raise InvalidArgument(f"{name} must not be empty")
        if len(value) > max_length:
            raise InvalidArgument(f"{name} must be at most {max_length} characters")
        return value

    def email(self, name: str) -> str:
        value = self.text(name, max_length=254)
        try:
            validate_email(value)
        except ValidationError:
            raise InvalidArgument(f"{name} must be an email address, not {value!r}") from None
        return value

    def integer(
        self, name: str, *, default: Any = _REQUIRED, minimum: int | None = None, maximum: int | None = None
    ) -> Any:
        value = self._value(name)
        if value is _ABSENT:
            return self._default(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name} must be a whole number, not {_json_type(value)}")
        _check_range(name, value, minimum, maximum)
        return value

    def number(
        self, name: str, *, default: Any = _REQUIRED, minimum: float | None = None, maximum: float | None = None
    ) -> Any:
        value = self._value(name)
        if value is _ABSENT:
            return self._default(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"{name} must be a number, not {_json_type(value)}")
        _check_range(name, value, minimum, maximum)
        return float(value)

    def choice(self, name: str, choices: Sequence[str], *, default: Any = _REQUIRED) -> Any:
        value = self._value(name)
        if value is _ABSENT:
            return self._default(name, default)
        if value not in choices:
            raise InvalidArgument(f"{name} must be one of {', '.join(choices)}, not {value!r}")
        return value

    def date(self, name: str) -> datetime.date:
        value = self.text(name, max_length=10)
        try:
            return datetime.date.fromisoformat(value)
        except ValueError:
            raise InvalidArgument(f"{name} must be a date as YYYY-MM-DD, not {value!r}") from None


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name} must be at least {minimum:g}, not {value:g}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name} must be at most {maximum:g}, not {value:g}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
