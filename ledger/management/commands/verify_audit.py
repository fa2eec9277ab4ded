from django.core.management.base import BaseCommand, CommandError

from ledger.audit import verify_chain
from ledger.models import Tenant


class Command(BaseCommand):
    help = "Verify every tenant's hash-chained audit log and the ledger rows it fingerprints."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant slug")

    def handle(self, *args, tenant=None, **options):
        tenants = Tenant.objects.order_by("pk")
        if tenant:
            tenants = tenants.filter(slug=tenant)
            if not tenants.exists():
                raise CommandError(f"tenant {tenant!r} does not exist")
        total = 0
        for t in tenants:
            report = verify_chain(t.pk)
            total += report.events
            if not report.ok:
                raise CommandError(f"tenant {t.slug}: broken at {report.problem}")
        self.stdout.write(f"ok: {total} events verified across {tenants.count()} tenant(s)")
