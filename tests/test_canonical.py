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


# --- the read path: `verify_chain` decodes stored JSON noting whether it is plain, and encodes plain values at once ---

JSON_TEXT = st.one_of(TEXT, st.sampled_from(["\\u0000", "a\\b", "\n\t\x1f", "\u2028", "x" * 40]))
JSON_ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10**40, 10**40), JSON_TEXT,
    st.floats(), st.sampled_from([1.0, -0.0, 2.5, 1e300, 1e16, float("inf"), float("nan")]))
JSON_VALUES = st.recursive(JSON_ATOMS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(JSON_TEXT, inner, max_size=4)), max_leaves=20)


def holds_a_float(value) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(holds_a_float(item) for item in value.values())
    if isinstance(value, list):
        return any(holds_a_float(item) for item in value)
    return False


@settings(max_examples=800, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_stored_json_read_back_gives_the_bytes_and_the_refusals_of_the_definition(value, ascii_only):
    from ledger.canonical import dumps_plain, loads_noting_plain

    text = json.dumps(value, ensure_ascii=ascii_only)
    decoded, is_plain = loads_noting_plain(text)
    assert repr(decoded) == repr(json.loads(text))  # the very value the model's JSONField reads
    assert is_plain == (not holds_a_float(value))
    if is_plain:
        assert read_outcome(lambda: dumps_plain(decoded)) == read_outcome(lambda: plain_dumps(decoded)) \
            == read_outcome(lambda: dumps(decoded))


def read_outcome(fn):
    """What `fn()` answers, or the type of what it raises (a stored Infinity overflows: as before, so now)."""
    try:
        return "ok", fn()
    except (ValueError, TypeError, OverflowError) as error:
        return "refused", type(error).__name__


def test_text_that_is_not_json_raises_as_json_loads_does():
    """Word for word: a segment that cannot be read is named with json's own refusal (ledger/archive/segments.py)."""
    import pytest

    from ledger.canonical import loads_noting_plain

    for text in ("", "{", "[1.5,", "[1, 2.5] x", "\ufeff{}", "\ufeff[1.5]", "nope"):
        with pytest.raises(json.JSONDecodeError) as expected:
            json.loads(text)
        with pytest.raises(json.JSONDecodeError) as raised:
            loads_noting_plain(text)
        assert str(raised.value) == str(expected.value)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, TEXT, TEXT, st.one_of(st.none(), st.integers(1, 10**12)), st.integers(1, 10**9))
def test_an_event_read_back_hashes_as_it_was_signed(data, kind, actor, run_ref, seq):
    from datetime import datetime, timezone

    from ledger.audit.chain import event_hash, keyed_for_events, read_event_hash
    from ledger.canonical import loads_noting_plain

    decoded, is_plain = loads_noting_plain(json.dumps(data))
    at = datetime(2026, 11, 28, 0, 1, 2, 345678, tzinfo=timezone.utc)
    columns = dict(key_id="k1", tenant_id=7, seq=seq, kind=kind, actor=actor, run_ref=run_ref, action_ref=None,
                   data=decoded, created_at=at)
    key = b"\x01" * 32
    assert read_outcome(lambda: read_event_hash(keyed_for_events(key), "0" * 64, data_plain=is_plain, **columns)) \
        == read_outcome(lambda: event_hash(key, "0" * 64, **columns))
