"""Failpoints: kill this process at a named instant, for crash tests and chaos runs.

Set UNWIND_FAILPOINTS to a comma-separated list of `name` or `name:probability` (0..1), e.g.
`after_tool_call` or `before_tool_call:0.2,mid_unwind:0.1`. Unset (the default) it costs one dict
lookup. Names: before_tool_call, after_tool_call (the effect happened, its outcome is not recorded),
mid_unwind (between two compensations).

`name=raise` (or `name=raise:probability`) makes the point raise `Injected` instead of killing the process: a
failure inside the engine's own code. The points of settling an outcome (ledger/engine/execution.py, `SETTLING`)
are only ever raised at.
"""
import os
import random
import signal

_points: dict[str, tuple[float, bool]] | None = None


class Injected(RuntimeError):
    """The failure a `name=raise` failpoint injects."""


def _load() -> dict[str, tuple[float, bool]]:
    points = {}
    for item in os.environ.get("UNWIND_FAILPOINTS", "").split(","):
        if item.strip():
            name, _, chance = item.strip().partition(":")
            name, _, mode = name.partition("=")
            points[name] = (float(chance) if chance else 1.0, mode == "raise")
    return points


def reset() -> None:
    """Read UNWIND_FAILPOINTS again (tests that set it)."""
    global _points
    _points = None


def hit(name: str) -> None:
    global _points
    if _points is None:
        _points = _load()
    chance, raises = _points.get(name, (0.0, False))
    if chance and random.random() < chance:
        if raises:
            raise Injected(f"failpoint {name}")
        os.kill(os.getpid(), signal.SIGKILL)
