"""A strict JSON parser: every malformed body is a 400 `parse_error`, never a server error.

Beyond what `json` refuses, it refuses what the ledger cannot store faithfully on every database:
non-finite numbers, integers beyond 64 bits (except inside a proposal's `args`, which are forwarded to the tool
as written and stored as text), NUL characters and lone surrogates (PostgreSQL rejects both in text and jsonb),
nesting deeper than a sane document, and bodies larger than the upload limit.

Numbers keep the text they were written as (ledger/db/received.py), so a tool receives `500.0` and `1e2`, not
what a float or the canonical form would make of them.
"""
import json
import math

from django.conf import settings
from rest_framework import exceptions
from rest_framework.parsers import BaseParser

from ledger.db.received import LiteralFloat, LiteralInt

MAX_DEPTH = 64
MAX_INT = 2**63 - 1


class PayloadTooLarge(exceptions.APIException):
    status_code = 413
    default_detail = "the request body is too large"
    default_code = "payload_too_large"


def _finite_float(text: str) -> LiteralFloat:
    value = LiteralFloat.parse(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _in_args(where: str) -> bool:
    """Inside a proposal's arguments, which reach the tool as written (their text is stored, not a 64-bit int)."""
    return where == "body.args" or where.startswith(("body.args.", "body.args["))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def check_text(value: str, where: str) -> None:
    if "\x00" in value:
        raise exceptions.ParseError(f"{where}: text may not contain NUL (\\u0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise exceptions.ParseError(f"{where}: text contains a lone surrogate escape") from None


def check_document(document) -> None:
    """Walk the parsed document iteratively (no recursion limit to hit) and refuse what cannot be stored."""
    stack = [(document, "body", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise exceptions.ParseError(f"the body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            check_text(value, where)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT and not _in_args(where):
            raise exceptions.ParseError(f"{where}: integer {str(value)[:20]}… does not fit in 64 bits")
        elif isinstance(value, dict):
            for key, item in value.items():
                check_text(key, where)
                stack.append((item, f"{where}.{key}"[:200], depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]"[:200], depth + 1) for index, item in enumerate(value))


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raw = stream.read(limit + 1) if stream is not None else b""
        if limit is not None and len(raw) > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        try:
            text = raw.decode("utf-8")  # RFC 8259: JSON exchanged between systems is UTF-8, whatever charset says
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from None
        try:
            document = json.loads(text, parse_float=_finite_float, parse_int=LiteralInt.parse,
                                  parse_constant=_refuse_constant)
        except RecursionError:
            raise exceptions.ParseError("the body is nested too deeply") from None
        except ValueError as exc:
            raise exceptions.ParseError(f"the body is not valid JSON: {exc}") from None
        check_document(document)
        return document
