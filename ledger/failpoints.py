"""Failpoints: kill this process at a named instant, for crash tests and chaos runs.

Set UNWIND_FAILPOINTS to a comma-separated list of `name` or `name:probability` (0..1), e.g.
`after_tool_call` or `before_tool_call:0.2,mid_unwind:0.1`. Unset (the default) it costs one dict
lookup. Names: before_tool_call, after_tool_call (the effect happened, its outcome is not recorded),
mid_unwind (between two compensations).
"""
import os
import random
import signal

_points: dict[str, float] | None = None


def _load() -> dict[str, float]:
    points = {}
    for item in os.environ.get("UNWIND_FAILPOINTS", "").split(","):
        if item.strip():
            name, _, chance = item.strip().partition(":")
            points[name] = float(chance) if chance else 1.0
    return points


def hit(name: str) -> None:
    global _points
    if _points is None:
        _points = _load()
    chance = _points.get(name)
    if chance and random.random() < chance:
        os.kill(os.getpid(), signal.SIGKILL)
