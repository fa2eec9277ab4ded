from django.core.management.base import BaseCommand, CommandError

from ledger.models import Tenant
from sandbox.services import SEED_TICKETS, sandbox_reset


class Command(BaseCommand):
    help = "Empty a tenant's sandbox world (records, idempotency keys, faults, call log) and seed its CRM tickets."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="the slug of the tenant whose world to reset")

    def handle(self, *args, tenant: str, **options):
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"there is no tenant {tenant!r}")
        sandbox_reset(tenant=found)
        seeded = ", ".join(ticket_id for ticket_id, _, _ in SEED_TICKETS)
        self.stdout.write(f"Sandbox of {found.slug} reset; seeded tickets {seeded}.")
