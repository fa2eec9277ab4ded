from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.management.tenants import tenants_named
from recovery.erasure import subject_erase


class Command(BaseCommand):
    help = ("Erase a person's data at their request: every text of the runs acted for them (--subject, the address "
            "their runs name), in every tenant or one (--tenant), audited in each tenant's chain, which keeps "
            "verifying. Only settled runs are erased; a run that may still move is named and nothing changes. "
            "SECURITY.md says what erasure does not reach.")

    def add_arguments(self, parser):
        parser.add_argument("--subject", required=True, help="the address the person's runs act for (on_behalf_of)")
        parser.add_argument("--tenant", help="only this tenant slug")
        parser.add_argument("--reason", required=True, help="why: the request's reference (never the person's name)")
        parser.add_argument("--by", required=True, help="who erases (recorded in the audit chain)")

    def handle(self, *args, subject, tenant=None, reason, by, **options):
        erased_any = False
        for each in tenants_named(tenant):
            try:
                result = subject_erase(tenant=each, subject=subject, reason=reason, by=by)
            except UnwindError as exc:
                raise CommandError(f"tenant {each.slug}: {exc}") from None
            if result.runs or tenant:
                self.stdout.write(result.sentence())
            erased_any = erased_any or bool(result.runs)
        if not erased_any and not tenant:
            self.stdout.write("no run of any tenant acts for this person (never recorded, or already erased): "
                              "nothing changed")
