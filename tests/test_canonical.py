"""Canonical JSON answers the exact types JSON decodes to by a quicker path (ledger/canonical.py); it must give the
very bytes, and refuse the very values, the plain definition does, or every stored fingerprint and hash changes."""
import json
import unicodedata
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.canonical import dumps
from ledger.db.received import LiteralFloat, LiteralInt


def plain(value):
    """The definition, one isinstance at a time (as it read before the quicker path)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("unstorable")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("unstorable") from None
        return unicodedata.normalize("NFC", value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (float, Decimal)):
        number = Decimal(str(value))
        return int(number) if number == number.to_integral_value() else float(number)
    if isinstance(value, dict):
        return {plain(str(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    raise TypeError(type(value).__name__)


def plain_dumps(value) -> str:
    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["é", "e\u0301", "Zoe\u0308", "\x00", "a\ud800", "日本", "k"]))
ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(), TEXT,
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1.0, -0.0, 2.5, 1e300]),
    st.integers(-10**6, 10**6).map(LiteralInt), st.floats(allow_nan=False, allow_infinity=False).map(LiteralFloat),
    st.decimals(allow_nan=False, allow_infinity=False, places=3))
VALUES = st.recursive(ATOMS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.one_of(TEXT, st.integers(0, 9)), inner, max_size=4)), max_leaves=20)


def outcome(fn, value):
    try:
        return "ok", fn(value)
    except (ValueError, TypeError) as error:
        return "refused", type(error).__name__


@settings(max_examples=600, deadline=None)
@given(VALUES)
def test_the_quicker_path_gives_the_bytes_and_the_refusals_of_the_definition(value):
    assert outcome(dumps, value) == outcome(plain_dumps, value)
