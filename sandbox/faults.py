"""Failure injection: rules that make a tool fail, hang or slow down, consumed exactly once per use.

Rules live in the database so every web process sees the same ones. Each rule belongs to a tenant and
affects only that tenant's calls. Only the POST tools consult them; the readers never fail on purpose.
"""
import time
from typing import Any

from django.db import transaction
from django.db.models import F, Q

from ledger.models import Tenant
from sandbox.arguments import Arguments
from sandbox.errors import InvalidArgument, SandboxError
from sandbox.models import Fault, FaultMode, ToolName

DEFAULT_TIMEOUT_SECONDS = 30.0
MAX_HOLD_SECONDS = 600.0
_COMMON_FIELDS = {"tool", "mode", "times", "nth"}
_MODE_FIELDS = {
    FaultMode.STATUS: {"status", "retry_after"},
    FaultMode.TIMEOUT: {"seconds"},
    FaultMode.LATENCY: {"ms"},
    FaultMode.ERROR_AFTER_EFFECT: {"status", "retry_after"},
}
_DEFAULT_STATUS = {FaultMode.STATUS: 503, FaultMode.ERROR_AFTER_EFFECT: 500}


def fault_add(raw: Any, *, tenant: Tenant) -> Fault:
    """Validate a rule as sent by a client and store it for the tenant's calls.

    {"tool": "payments.charge", "mode": "status", "status": 503, "retry_after": 2, "times": 1, "nth": null}
    `times` defaults to 1; null or 0 means every call. `nth` lets nth - 1 calls pass first.
    """
    if not isinstance(raw, dict):
        raise InvalidArgument("a fault rule must be a JSON object")
    # The mode decides which other fields a rule may have.
    mode = Arguments(raw, allowed=raw.keys()).choice("mode", FaultMode.values)
    args = Arguments(raw, allowed=_COMMON_FIELDS | _MODE_FIELDS[mode])
    tool = args.choice("tool", ToolName.values)
    times = args.integer("times", default=None if args.given("times") else 1, minimum=0) or None
    fields: dict = {}
    if mode in _DEFAULT_STATUS:
        fields["status"] = args.integer("status", default=_DEFAULT_STATUS[mode], minimum=400, maximum=599)
        fields["retry_after"] = args.integer("retry_after", default=None, minimum=0, maximum=3600)
    elif mode == FaultMode.TIMEOUT:
        fields["seconds"] = args.number("seconds", default=DEFAULT_TIMEOUT_SECONDS, minimum=0, maximum=MAX_HOLD_SECONDS)
    else:
        fields["ms"] = args.integer("ms", minimum=0, maximum=int(MAX_HOLD_SECONDS * 1000))
    return Fault.objects.create(
        tenant=tenant,
        tool=tool, mode=mode, times=times, nth=args.integer("nth", default=None, minimum=1), **fields
    )


def faults_clear(*, tenant: Tenant, tool: str | None = None) -> int:
    rules = Fault.objects.filter(tenant=tenant)
    if tool is not None:
        if tool not in ToolName.values:
            raise InvalidArgument(f"tool must be one of {', '.join(ToolName.values)}, not {tool!r}")
        rules = rules.filter(tool=tool)
    cleared, _ = rules.delete()
    return cleared


def fault_claim(*, tenant: Tenant, tool: str) -> Fault | None:
    """Return the tenant's rule that affects this call of `tool`, having consumed one use of it; None if none does.

    Positional rules (with `nth`) count every call of their tool and take precedence once due; then the
    oldest rule wins. Each use is taken with a compare-and-set on `hits`, so two concurrent calls can
    never both consume the last use of a rule.
    """
    live = (Fault.objects.filter(tenant=tenant, tool=tool)
            .filter(Q(times__isnull=True) | Q(hits__lt=F("times"))).order_by("id"))
    if not live.exists():  # the common case needs no transaction
        return None
    with transaction.atomic():
        rules = list(live.all())
        positional = [rule.pk for rule in rules if rule.nth is not None]
        if positional:
            # The increment holds the rows' locks until commit, so the re-read gives this call's own position.
            Fault.objects.filter(pk__in=positional).update(seen=F("seen") + 1)
            rules = list(live.all())
        while True:
            rule = _first_due(rules)
            if rule is None:
                return None
            if Fault.objects.filter(pk=rule.pk, hits=rule.hits).update(hits=rule.hits + 1) == 1:
                rule.hits += 1
                return rule
            # A concurrent call took that use first: look again at what is left.
            rules = list(live.all())


def _first_due(rules: list[Fault]) -> Fault | None:
    for rule in sorted(rules, key=lambda r: (r.nth is None, r.pk)):
        if not rule.spent and (rule.nth is None or rule.seen >= rule.nth):
            return rule
    return None


def fault_hold(fault: Fault) -> None:
    """Sleep for the delay the rule asks for (timeout or latency), outside any transaction."""
    if fault.mode == FaultMode.TIMEOUT:
        time.sleep(fault.seconds)
    elif fault.mode == FaultMode.LATENCY:
        time.sleep(fault.ms / 1000)


def fault_error(fault: Fault) -> SandboxError | None:
    """The error answer the rule injects, or None for a rule that only delays."""
    headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
    if fault.mode == FaultMode.STATUS:
        return SandboxError(
            f"injected fault: {fault.tool} answered {fault.status} and applied nothing",
            status=fault.status,
            code="injected_status",
            headers=headers,
        )
    if fault.mode == FaultMode.TIMEOUT:
        return SandboxError(
            f"injected timeout: {fault.tool} held the call for {fault.seconds:g}s and applied nothing",
            status=504,
            code="injected_timeout",
        )
    if fault.mode == FaultMode.ERROR_AFTER_EFFECT:
        return SandboxError(
            f"injected fault: {fault.tool} applied the effect, then answered {fault.status}",
            status=fault.status,
            code="injected_error_after_effect",
            headers=headers,
        )
    return None

