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
    # Every fingerprint and event body goes through here, several times a step: the exact types JSON decodes to
    # are answered first, ASCII text (keys, hashes, ids) without normalising; anything else (a number that remembers
    # its literal, ledger/db/received.py; a tuple, a Decimal) takes `_general`, which gives the same answer for these.
    # Inside a dict or a list, an item that is ASCII text without a NUL, an int, a bool or None is its own canonical
    # form (the branches below return it as it is): kept without a call, as most items of a fingerprint's values are.
    kind = type(value)
    if kind is str:
        if value.isascii():
            if "\x00" in value:
                raise ValueError(UNSTORABLE)
            return value
        return _text(value)
    if kind is dict:
        return {key if type(key) is str and key.isascii() and "\x00" not in key else canonical(str(key)):
                item if (type(item) is str and item.isascii() and "\x00" not in item) or type(item) is int
                or item is None or type(item) is bool else canonical(item) for key, item in value.items()}
    if kind is int or kind is bool or value is None:
        return value
    if kind is list:
        return [item if (type(item) is str and item.isascii() and "\x00" not in item) or type(item) is int
                or item is None or type(item) is bool else canonical(item) for item in value]
    return _general(value)


UNSTORABLE = "text contains a NUL character or a lone surrogate, which cannot be stored"


def _text(value: str) -> str:
    if "\x00" in value or _has_lone_surrogate(value):
        raise ValueError(UNSTORABLE)
    # Most text (keys, hashes, ids) is ASCII: already NFC.
    return value if value.isascii() else unicodedata.normalize("NFC", value)


def _general(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, int):
        return int(value)  # a plain int, even from a number that remembers its literal (ledger/db/received.py)
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


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# `_ENCODER`'s C encoder made once, not on every call as `JSONEncoder.encode` makes it (a third of a small value's
# encoding): the same arguments, but no check for circular references, which `canonical`'s copy cannot hold (a
# value that refers to itself never gets past `canonical`, which recurses into it first).
_C_ENCODE = None if json.encoder.c_make_encoder is None else json.encoder.c_make_encoder(
    None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", True, False, False)


def dumps(value: Any) -> str:
    value = canonical(value)
    if _C_ENCODE is None or type(value) is str:
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


def digest(*parts: Any) -> str:
    return hashlib.sha256(dumps(list(parts)).encode()).hexdigest()


# --- reading back what was stored --------------------------------------------------------------------------------
# `verify_chain` recomputes the canonical text of every event it reads (millions, for a ledger that lives for years),
# and most of them are plain: dicts with text keys, lists, text, integers, booleans and nulls, as JSON decodes them,
# with no number that has a fraction or an exponent. Such a value whose encoder text is ASCII without a NUL is left
# as it is by `canonical` (every branch it takes returns its input's equal, of the same type), so that text is
# `dumps` of it already: the copy is skipped, never the rules (anything else takes `dumps`).


class _NotPlain(Exception):
    pass


def _not_plain(_text: str):
    raise _NotPlain


_PLAIN_DECODER = json.JSONDecoder(parse_float=_not_plain, parse_constant=_not_plain)


def loads_noting_plain(text: str) -> tuple[Any, bool]:
    """`json.loads(text)` (raising as it does), and whether that value is plain: JSON has no other keys than text, so
    it is, unless a number has a fraction or an exponent (or is NaN or Infinity)."""
    if type(text) is not str or text.startswith("\ufeff"):
        return json.loads(text), False  # its own refusal (bytes are decoded first), word for word
    try:
        return _PLAIN_DECODER.decode(text), True
    except _NotPlain:
        return json.loads(text), False


def dumps_plain(value: Any) -> str:
    """`dumps(value)` for a plain value (see `loads_noting_plain`; built of exactly those types): the encoder's text
    when it is ASCII and holds no NUL (escaped as \\u0000), else `dumps`, which normalises or refuses the text."""
    text = _ENCODER.encode(value)
    if text.isascii() and "\\u0000" not in text:
        return text
    return dumps(value)


def digest_plain(*parts: Any) -> str:
    """`digest(*parts)` for plain parts (see `dumps_plain`)."""
    return hashlib.sha256(dumps_plain(list(parts)).encode()).hexdigest()


def storable(value: Any, *, field: str) -> Any:
    """The canonical form of a JSON value, or a validation error naming the field it cannot be stored in."""
    from ledger.errors import ValidationFailed

    try:
        return canonical(value)
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"{field}: {exc}", field=field) from None
