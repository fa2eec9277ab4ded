"""Canonical JSON: the same logical value always gives the same bytes and the same hash.

A re-synthesised request (keys in another order, 2.0 written for 2, a string in another Unicode
normal form) is the same action, so it must hash the same (guarantee 1).
"""
import hashlib
import json
import unicodedata
from decimal import Decimal
from typing import Any


def canonical(value: Any) -> Any:
    """A normalised copy: NFC strings, integral floats as ints, dict keys sorted on dump."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        if "\x00" in value or _has_lone_surrogate(value):
            raise ValueError("text contains a NUL character or a lone surrogate, which cannot be stored")
        # Most text (keys, hashes, ids) is ASCII: already NFC.
        return value if value.isascii() else unicodedata.normalize("NFC", value)
    if isinstance(value, int):
        return int(value)  # a plain int, even from a number that remembers its literal (ledger/received.py)
    if isinstance(value, (float, Decimal)):
        number = Decimal(str(value))
        if number == number.to_integral_value():
            return int(number)
        return float(number)
    if isinstance(value, dict):
        return {canonical(str(k)): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _has_lone_surrogate(text: str) -> bool:
    """ASCII never holds one; otherwise UTF-8 encoding fails on exactly these, at C speed."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def dumps(value: Any) -> str:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def digest(*parts: Any) -> str:
    return hashlib.sha256(dumps(list(parts)).encode()).hexdigest()


def storable(value: Any, *, field: str) -> Any:
    """The canonical form of a JSON value, or a validation error naming the field it cannot be stored in."""
    from ledger.errors import ValidationFailed

    try:
        return canonical(value)
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"{field}: {exc}", field=field) from None
