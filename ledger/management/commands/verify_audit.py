from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ledger.audit.verify import verify_chain
from ledger.management.tenants import tenants_named


class Command(BaseCommand):
    help = ("Verify every tenant's audit chain, archived segments (UNWIND_ARCHIVE_URL) and hot tables as one: links, "
            "each event's HMAC under the audit key it names, the head, the newest signed head exported to "
            "UNWIND_AUDIT_EXPORT_DIR, and the ledger rows it fingerprints.")

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant slug")

    def handle(self, *args, tenant=None, **options):
        tenants = tenants_named(tenant)
        total, against_exported, segments = 0, 0, 0
        for t in tenants:
            try:
                report = verify_chain(t.pk)
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from None
            total += report.events
            if not report.ok:
                raise CommandError(f"tenant {t.slug}: broken at {report.problem} [check: {report.check}]")
            against_exported += report.exported_head is not None
            segments += report.segments
        if settings.UNWIND_AUDIT_EXPORT_DIR:
            heads = f"; {against_exported} against their signed exported head"
        else:
            heads = "; no signed heads checked (UNWIND_AUDIT_EXPORT_DIR is not set)"
        archived = f"; {segments} archived segment(s) read as part of their chains" if segments else ""
        self.stdout.write(f"ok: {total} events verified across {tenants.count()} tenant(s){heads}{archived}")
