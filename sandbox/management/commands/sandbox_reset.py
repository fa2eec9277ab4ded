from django.core.management.base import BaseCommand

from sandbox.services import SEED_TICKETS, sandbox_reset


class Command(BaseCommand):
    help = "Empty the sandbox (records, idempotency keys, faults, call log) and seed its CRM tickets."

    def handle(self, *args, **options):
        sandbox_reset()
        self.stdout.write(f"Sandbox reset; seeded tickets {', '.join(ticket_id for ticket_id, _, _ in SEED_TICKETS)}.")
