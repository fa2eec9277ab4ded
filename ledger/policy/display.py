"""Display hints: how the pages show a tool's argument values (a policy's `display` setting).

An agent sends `amount_cents: 92000`; an approver should read "€920.00", not a raw number that looks like
something to type into. The hint is part of the tool's policy version, so a page shows an action's values the
way the version it was proposed under declared them:

    display:
      amount_cents: {money: {currency: EUR, minor_units: 2}}
      refund_cents: {money: {currency_from: args.currency, currency: EUR}}   # EUR when args.currency is missing

Formatting is locale-neutral ("€920.00", "1,250.50 CHF"): the point is that a person reads a sum of money,
not that it follows their region's conventions. A value the hint does not fit (not a whole number, no
currency found) is shown as it is, never guessed at.
"""
from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

from ledger.errors import ValidationFailed

ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
CURRENCY = re.compile(r"^[A-Z]{3}$")
MONEY_KEYS = {"currency", "currency_from", "minor_units"}
MINOR_UNITS = (0, 4)
MAX_FIELDS = 50
# The few symbols everyone reads; other ISO 4217 codes follow the amount ("1,250.50 CHF").
SYMBOLS = {"EUR": "€", "USD": "$", "GBP": "£", "JPY": "¥", "INR": "₹"}


def _fail(where: str, why: str):
    raise ValidationFailed(f"{where}: {why}", field=where)


def parse_display(value: Any, *, where: str) -> dict:
    """Validate a policy's `display` setting and return it in its stored (normalised) form."""
    if not isinstance(value, dict):
        _fail(where, f"must be an object naming arguments, not {type(value).__name__}")
    if len(value) > MAX_FIELDS:
        _fail(where, f"names at most {MAX_FIELDS} arguments, not {len(value)}")
    parsed = {}
    for name, hint in value.items():
        field = f"{where}.{name}"
        if not isinstance(name, str) or not ARG_NAME.match(name):
            _fail(field, "an argument name is letters, digits and _ (like amount_cents)")
        if not isinstance(hint, dict) or set(hint) != {"money"}:
            _fail(field, 'must be {"money": {...}}, the one kind of display hint there is')
        parsed[name] = {"money": _parse_money(hint["money"], where=f"{field}.money")}
    return parsed


def _parse_money(money: Any, *, where: str) -> dict:
    if not isinstance(money, dict):
        _fail(where, f"must be an object like {{currency: EUR, minor_units: 2}}, not {type(money).__name__}")
    unknown = set(money) - MONEY_KEYS
    if unknown:
        _fail(f"{where}.{sorted(unknown)[0]}", f"is not a money setting (known: {', '.join(sorted(MONEY_KEYS))})")
    if "currency" not in money and "currency_from" not in money:
        _fail(where, "needs a currency (an ISO 4217 code like EUR), a currency_from (args.<name>), or both "
                     "(currency is then what applies when that argument is missing)")
    parsed: dict[str, Any] = {}
    if "currency" in money:
        currency = money["currency"]
        if not isinstance(currency, str) or not CURRENCY.match(currency.strip().upper()):
            _fail(f"{where}.currency", f"must be a three-letter ISO 4217 code like EUR, not {currency!r}")
        parsed["currency"] = currency.strip().upper()
    if "currency_from" in money:
        source = money["currency_from"]
        if not isinstance(source, str) or not source.startswith("args.") or not ARG_NAME.match(source[5:]):
            _fail(f"{where}.currency_from", f"must name an argument as args.<name>, not {source!r}")
        parsed["currency_from"] = source
    units = money.get("minor_units", 2)
    if isinstance(units, bool) or not isinstance(units, int) or not MINOR_UNITS[0] <= units <= MINOR_UNITS[1]:
        low, high = MINOR_UNITS
        _fail(f"{where}.minor_units", f"must be a whole number from {low} to {high}, not {units!r}")
    parsed["minor_units"] = units
    return parsed


def format_money(amount: Any, money: dict, args: dict) -> str | None:
    """"€920.00" for 92000 minor units of EUR; None when the value or its currency does not fit the hint."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        return None
    currency = money.get("currency", "")
    if "currency_from" in money:
        found = (args or {}).get(money["currency_from"][5:])
        currency = found.strip().upper() if isinstance(found, str) else currency
    if not CURRENCY.match(currency or ""):
        return None
    units = money.get("minor_units", 2)
    value = Decimal(abs(amount)).scaleb(-units)
    number = f"{value:,.{units}f}"
    sign = "−" if amount < 0 else ""
    symbol = SYMBOLS.get(currency)
    return f"{sign}{symbol}{number}" if symbol else f"{sign}{number} {currency}"


def display_value(display: dict, name: str, value: Any, args: dict) -> str | None:
    """The value of argument `name` as its tool's display hint shows it, or None when there is no hint for it."""
    hint = (display or {}).get(name)
    if not hint:
        return None
    return format_money(value, hint["money"], args)


def shown_value(value: Any, *, name: str, display: dict, args: dict) -> dict:
    """One value for reading on a page: a display hint's words ("€920.00"), plain text, or JSON for a structure.

    `raw` is the value as JSON (a hinted value's tooltip); `block` says it needs a <pre>.
    """
    raw = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    hinted = display_value(display, name, value, args)
    if hinted is not None:
        return {"text": hinted, "raw": raw, "block": False, "hinted": True}
    if isinstance(value, str) and "\n" not in value:
        return {"text": value, "raw": raw, "block": False, "hinted": False}
    if value is None or isinstance(value, (bool, int, float)):
        return {"text": raw, "raw": raw, "block": False, "hinted": False}
    return {"text": raw, "raw": raw, "block": True, "hinted": False}


def shown_args(args: Any, display: dict) -> dict:
    """The arguments with every hinted value in words ("€920.00"), for sentences a person reads.

    What the hint does not fit stays as it is (the caller decides whether a raw value may be shown at all).
    """
    if not isinstance(args, dict):
        return {}
    shown = dict(args)
    for name, value in args.items():
        hinted = display_value(display, name, value, args)
        if hinted is not None:
            shown[name] = hinted
    return shown


def money_source_args(display: dict) -> set[str]:
    """The arguments a money hint reads its currency from: already said by the amount, so not repeated."""
    return {hint["money"]["currency_from"][5:] for hint in (display or {}).values()
            if isinstance(hint, dict) and "currency_from" in hint.get("money", {})}


# How a person outside the company reads who decided: their role and the company, never a login.
ROLE_WORDS = {"viewer": "someone", "approver": "a reviewer", "operator": "an operator", "admin": "an administrator"}


def person_at(role: str | None, company: str) -> str:
    """"a reviewer at Demo Company": the words a customer reads for a member of staff with `role`."""
    who = ROLE_WORDS.get(role or "", "someone")
    return f"{who} at {company}" if company else who


def money_in(args: Any, display: dict) -> list[str]:
    """Every amount among the arguments, in words ("€920.00"), in the order the hint names them: what a list row
    shows so a person knows what a request is about without opening it."""
    if not isinstance(args, dict):
        return []
    return [shown for name in (display or {}) if name in args
            for shown in [display_value(display, name, args[name], args)] if shown is not None]
