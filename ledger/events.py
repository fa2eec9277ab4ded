"""The engine's one seam to the rest of the system.

The engine emits named domain events *inside* the transaction that made the change, so a
subscriber's rows (an approval request, a recovery item, an outbox notification) commit or roll
back with it. Subscribers register in their AppConfig.ready(); the engine imports none of them.

Events and their keyword payloads:
- approval_required(action, requested_by)     an action or compensation waits for people
- approval_withdrawn(action, reason)         it no longer does (run cancelled, unwound, skipped)
- run_needs_attention(run, reason, detail, action)   a human must decide; open a recovery item
- run_attention_cleared(run, resolution, actor)      the run left needs_attention
- compensation_failed(action, forward)       a compensation gave up (alert and continue)
- policy_changed(retired, current, actor)    a tool's policy got a new version; `retired` is the one it replaced
- run_finished(run)                          completed, compensated or closed
- action_held(action, run)                    a step waits out its tool's hold (ledger/engine/holds.py) until it runs
- hold_stopped(action, run, by, actor)       a held step was stopped before it ran
- sweep(now)                                 the periodic sweep, for time-based work of other apps
"""
from collections import defaultdict
from typing import Callable

KNOWN = {
    "approval_required", "approval_withdrawn", "run_needs_attention", "run_attention_cleared",
    "compensation_failed", "run_finished", "sweep", "policy_changed", "action_held", "hold_stopped",
}
_subscribers: dict[str, list[Callable]] = defaultdict(list)


def subscribe(event: str, handler: Callable) -> None:
    if event not in KNOWN:
        raise ValueError(f"unknown engine event {event!r}")
    if handler not in _subscribers[event]:
        _subscribers[event].append(handler)


def subscribed(event: str) -> bool:
    """Whether anything handles `event` (a path that cannot run handlers inside its commit checks first)."""
    return bool(_subscribers[event])


def emit(event: str, **payload) -> None:
    for handler in list(_subscribers[event]):
        handler(**payload)
