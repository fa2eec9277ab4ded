"""The checks every policy field is made of: a refusal naming the field, a choice, a bounded number or duration,
a mapping; and the bounds they are held to. The lowest layer of policy: rules, limits and tool entries use it.
"""
from __future__ import annotations

import math
from typing import Any

from ledger.errors import ValidationFailed
from ledger.models import RETENTION_SECONDS as RETENTION_BOUNDS


def fail(where: str, why: str):
    raise ValidationFailed(f"{where}: {why}", field=where)


def choice(value: Any, choices, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices.values:
        fail(where, f"must be one of {', '.join(choices.values)}, not {value!r}")
    return value.strip().lower()


def number(value: Any, where: str, *, minimum: float, maximum: float | None = None, integer: bool = False,
            unit: str = ""):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(where, f"must be a {'whole ' if integer else ''}number, not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        fail(where, f"must be a finite number, not {value!r}")
    if integer and isinstance(value, float) and not value.is_integer():
        fail(where, f"must be a whole number, not {value!r}")
    # Compared before any conversion: float(10**400) would raise, int(1e300) would be a 300-digit count.
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum:g} to {maximum:g}{unit}" if maximum is not None else f"at least {minimum:g}{unit}"
        shown = f"{value:.6g}" if isinstance(value, float) else (str(value) if abs(value) < 10**18 else "a number that large")
        fail(where, f"must be {bounds}, not {shown}")
    return int(value) if integer else float(value)


def duration(value: Any, where: str, *, minimum: float = 0, maximum: float | None = None) -> float:
    """30, "30s", "2m", "500ms" -> seconds, within [minimum, maximum]."""
    if isinstance(value, str):
        text = value.strip().lower()
        for suffix, factor in (("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600), ("d", 86400)):
            if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
                value = float(text[: -len(suffix)]) * factor
                break
        else:
            fail(where, f"must be a duration like 30s, 2m or 500ms, not {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number(value, where, minimum=minimum, maximum=maximum, unit=" seconds")
    fail(where, f"must be a duration like 30s, 2m or 500ms, not {value!r}")


# Retention (`retention`, docs/archive.md): from an hour to a hundred years; "forever" (or 0) keeps runs hot.
RETENTION_SECONDS = RETENTION_BOUNDS


def retention(value: Any, where: str) -> int:
    """A policy's `retention` in seconds: a duration like 90d, or "forever"/0 for never archiving (0)."""
    if value in ("forever", 0):
        return 0
    return int(duration(value, where, minimum=RETENTION_SECONDS[0], maximum=RETENTION_SECONDS[1]))


def require_mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        fail(where, f"must be an object, not {type(value).__name__}")
    return value


# The documented bounds (README, "Policy files"): what a policy may ask of the engine.
TIMEOUT_SECONDS = (0.1, 300.0)


MAX_ATTEMPTS = (1, 20)


BACKOFF_SECONDS = (0.0, 3600.0)


APPROVALS_REQUIRED = (1, 10)


APPROVAL_TTL_SECONDS = (1, 30 * 86400)
