"""`manage.py partitions`: list, create ahead and detach the monthly partitions of the ledger's append-only tables."""
import re
from datetime import date

from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError, connection

from ledger.db import partitions


def _month(text: str) -> date:
    found = re.fullmatch(r"(\d{4})-(\d{2})", text or "")
    if not found or not 1 <= int(found[2]) <= 12:
        raise CommandError(f"--detach-before takes a month as YYYY-MM (2026-01), not {text!r}.")
    return date(int(found[1]), int(found[2]), 1)


class Command(BaseCommand):
    help = ("PostgreSQL: list the monthly partitions of the audit events, attempts and checkpoints with their sizes; "
            "--ensure creates the coming months (the sweep does it hourly); --detach-before YYYY-MM detaches and "
            "drops the older months that archiving emptied (a month that still holds rows is named and kept).")

    def add_arguments(self, parser):
        parser.add_argument("--ensure", action="store_true", help="create this month and the coming ones now")
        parser.add_argument("--detach-before", metavar="YYYY-MM",
                            help="detach and drop the empty partitions of the months before this one")

    def handle(self, *args, ensure=False, detach_before=None, **options):
        cutoff = _month(detach_before) if detach_before is not None else None
        if not partitions.supported():
            self.stdout.write(f"{connection.vendor}: these tables are not partitioned (only PostgreSQL partitions "
                              "them by month); there is nothing to list, create or detach.")
            return
        try:
            if ensure:
                created = partitions.ensure()
                self.stdout.write(f"created: {', '.join(created)}" if created else "created: none (all there)")
            if cutoff is not None:
                for done in partitions.detach_before(cutoff):
                    self.stdout.write(f"{'detached' if done.dropped else 'kept'}: {done.name} ({done.why})")
        except OperationalError as exc:
            raise CommandError(f"the partitions' locks were busy; nothing was changed, try again ({exc})".strip())
        with connection.cursor() as cursor:
            for table in partitions.PARTITIONED:
                if not partitions.is_partitioned(cursor, table):
                    self.stdout.write(f"{table}: not partitioned (run `manage.py migrate`)")
                    continue
                for part in partitions.partitions(cursor, table):
                    month = part.month.strftime("%Y-%m") if part.month else "default"
                    rows = "rows not yet counted" if part.rows < 0 else f"~{part.rows} rows"
                    self.stdout.write(f"{part.name}\t{month}\t{rows}\t{part.bytes / 1024 / 1024:.1f} MB")
