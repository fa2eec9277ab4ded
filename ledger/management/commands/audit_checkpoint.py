"""`manage.py audit_checkpoint`: sign every tenant's audit chain head into UNWIND_AUDIT_EXPORT_DIR now."""
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ledger.audit.export import heads_checkpoint
from ledger.management.tenants import tenants_named


class Command(BaseCommand):
    help = ("Sign each tenant's audit chain head (Ed25519) and append it to that tenant's file in "
            "UNWIND_AUDIT_EXPORT_DIR; the worker does this every UNWIND_AUDIT_CHECKPOINT_SECONDS.")

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant slug")

    def handle(self, *args, tenant=None, **options):
        tenants = tenants_named(tenant)
        try:
            written, problems = heads_checkpoint(tenants=tenants)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        for line in written:
            self.stdout.write(f"signed: tenant {line['slug']} head #{line['seq']} {line['hash'][:16]}…")
        if problems:
            raise CommandError("; ".join(problems))
        self.stdout.write(f"ok: {len(written)} head(s) signed")
