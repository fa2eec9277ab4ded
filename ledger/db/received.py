"""Arguments as the agent wrote them: numbers keep their literal text, strings their code points.

The canonical form (ledger/canonical.py) decides whether two calls are the same call: it hashes `500.0` as `500`
and a decomposed "Zoë" as the composed one. What a tool receives is another matter: it gets exactly what the
agent sent, `500.0`, `1e2`, `0.10`, 12345678901234567890123 and "Zoe\u0308" as written. So request bodies are
parsed into numbers that remember their literal (`LiteralFloat`, `LiteralInt`: still a float and an int for
JSON Schema, comparisons and arithmetic), the action keeps its arguments' JSON text as received
(`Action.args_text`; PostgreSQL's jsonb would rewrite `1e2`), and the executors send that text.
"""
from __future__ import annotations

import json
from decimal import Decimal
from typing import Any


class LiteralFloat(float):
    """A JSON number with a fraction or an exponent, and the text it was written as."""

    literal: str

    @classmethod
    def parse(cls, text: str) -> "LiteralFloat":
        number = cls(text)
        number.literal = text
        return number


class LiteralInt(int):
    """A JSON integer and the text it was written as (`-0` stays `-0`)."""

    literal: str

    @classmethod
    def parse(cls, text: str) -> "LiteralInt":
        number = cls(text)
        number.literal = text
        return number


_DECODER = json.JSONDecoder(parse_float=LiteralFloat.parse, parse_int=LiteralInt.parse)


def loads(text: str) -> Any:
    """A JSON document whose numbers remember their literal text."""
    if type(text) is str and not text.startswith("\ufeff"):
        return _DECODER.decode(text)  # what json.loads does with these, less making a decoder for each document
    return json.loads(text, parse_float=LiteralFloat.parse, parse_int=LiteralInt.parse)


def dumps(value: Any) -> str:
    """JSON text with every number as it was written (a literal number's own text; others as Python writes them),
    strings unchanged (no normalisation, non-ASCII kept as is), keys in their order, no spaces."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)


def _write(value: Any, parts: list[str]) -> None:
    if isinstance(value, (LiteralFloat, LiteralInt)):
        parts.append(value.literal)
    elif isinstance(value, Decimal) and value.is_finite():  # from a Python caller: its digits are what it meant
        parts.append(str(value))
    elif isinstance(value, dict):
        parts.append("{")
        for index, (key, item) in enumerate(value.items()):
            if index:
                parts.append(",")
            parts.append(json.dumps(str(key), ensure_ascii=False))
            parts.append(":")
            _write(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _write(item, parts)
        parts.append("]")
    else:
        parts.append(json.dumps(value, ensure_ascii=False, allow_nan=False))
