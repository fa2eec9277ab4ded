"""What the audit commands share: the tenants a `--tenant` option names (all of them without it)."""
from django.core.management.base import CommandError

from ledger.models import Tenant


def tenants_named(slug: str | None):
    tenants = Tenant.objects.order_by("pk")
    if slug:
        tenants = tenants.filter(slug=slug)
        if not tenants.exists():
            raise CommandError(f"tenant {slug!r} does not exist")
    return tenants
