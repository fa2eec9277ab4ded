"""The in-process tools a deployer put in the code: the only Python a policy can make Unwind call.

A policy names a registered callable by its key (`"executor": {"kind": "python", "path": "sandbox.crm_update_ticket"}`),
never by an importable dotted path: policy comes from people and, through a leaked key or an injected
prompt, could come from an attacker, while this registry comes only from code a deployer installed.

    from ledger.policy import registry

    @registry.tool("billing.charge")
    def charge(args: dict, *, idempotency_key: str, target: str | None, tenant: str) -> dict: ...

    @registry.reader("billing.read_charge")
    def read_charge(target: str, *, tenant: str) -> dict | None: ...

Modules holding registrations are imported once at start: the apps' own (the sandbox's, whose tools refuse while the sandbox is off)
and those named by the `UNWIND_PYTHON_TOOL_MODULES` setting.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,119}$")
KINDS = ("tool", "reader")


class NotRegistered(LookupError):
    """A policy named a key no deployer registered (or registered as the other kind)."""


@dataclass(frozen=True)
class Registered:
    key: str
    kind: str
    fn: Callable
    module: str


_registered: dict[str, Registered] = {}


def _register(kind: str, key: str) -> Callable[[Callable], Callable]:
    if not isinstance(key, str) or not KEY.match(key):
        raise ValueError(f"a registry key is 1 to 120 letters, digits and . _ - (like billing.charge), not {key!r}")

    def decorate(fn: Callable) -> Callable:
        existing = _registered.get(key)
        if existing is not None and (existing.fn is not fn and
                                     (existing.module, existing.fn.__qualname__) != (fn.__module__, fn.__qualname__)):
            raise ValueError(f"{key!r} is already registered by {existing.module}.{existing.fn.__qualname__}")
        _registered[key] = Registered(key=key, kind=kind, fn=fn, module=fn.__module__)
        return fn

    return decorate


def tool(key: str) -> Callable[[Callable], Callable]:
    """Register `fn(args, *, idempotency_key, target, tenant) -> JSON-able result` as an executor."""
    return _register("tool", key)


def reader(key: str) -> Callable[[Callable], Callable]:
    """Register `fn(target, *, tenant) -> JSON-able state | None` as a snapshot, lookup or verify reader."""
    return _register("reader", key)


def get(key: str, kind: str) -> Callable:
    """The callable registered under `key` as `kind`, or NotRegistered with a sentence saying what exists."""
    found = _registered.get(key) if isinstance(key, str) else None
    if found is None or found.kind != kind:
        known = ", ".join(sorted(k for k, r in _registered.items() if r.kind == kind)) or "none"
        raise NotRegistered(f"{key!r} is not a registered Python {kind} (registered: {known})")
    return found.fn


def keys(kind: str) -> list[str]:
    return sorted(k for k, r in _registered.items() if r.kind == kind)
