"""`manage.py archive`: move settled runs past their retention out of the hot tables into signed, content-addressed
segments in UNWIND_ARCHIVE_URL (docs/archive.md). Schedule it like `audit_checkpoint` (docs/production.md)."""
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from ledger.archive.service import archive_tenant
from ledger.archive.store import archive_store
from ledger.management.tenants import tenants_named


class Command(BaseCommand):
    help = ("Archive each tenant's settled runs older than its retention (policy audit.retention, a tool's "
            "retention) to UNWIND_ARCHIVE_URL, then remove them from the hot tables. Runs under a legal hold, "
            "unsettled runs and runs with anything open stay.")

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant slug")
        parser.add_argument("--dry-run", action="store_true", help="say what would be archived; change nothing")
        parser.add_argument("--limit", type=int, help="at most this many runs per tenant in this pass")
        parser.add_argument("--pace", type=float, help="the share of its time the pass works, above 0 and at most 1 "
                            "(default UNWIND_ARCHIVE_PACE): it rests after each segment, leaving the machine to agents")

    def handle(self, *args, tenant=None, dry_run=False, limit=None, pace=None, **options):
        if limit is not None and limit < 1:
            raise CommandError("--limit must be at least 1")
        if pace is not None and not 0 < pace <= 1:
            raise CommandError(f"--pace is the share of its time the pass works: above 0 and at most 1, not {pace}")
        try:
            store = None if dry_run else archive_store()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        runs = actions = 0
        for t in tenants_named(tenant):
            try:
                report = archive_tenant(tenant=t, actor="manage.py archive", dry_run=dry_run, store=store, limit=limit,
                                        pace=pace)
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from None
            runs, actions = runs + report.runs, actions + report.actions
            if report.kept:
                self.stdout.write(f"tenant {t.slug}: nothing archived: {report.kept}")
            elif dry_run:
                listed = ", ".join(str(pk) for pk in report.due[:20]) + (" …" if len(report.due) > 20 else "")
                self.stdout.write(f"tenant {t.slug}: would archive {report.runs} run(s), {report.actions} "
                                  f"action(s){': ' + listed if listed else ''}")
            else:
                working = report.seconds - report.rested
                rate = f", {report.actions / working:,.0f} actions/s working" if working > 0 and report.actions else ""
                rate += f", resting {report.rested:.1f} of {report.seconds:.1f} s" if report.rested else ""
                self.stdout.write(f"tenant {t.slug}: archived {report.runs} run(s), {report.actions} action(s) in "
                                  f"{len(report.segments)} segment(s) to {store.where}{rate}")
                for sha in report.segments:
                    self.stdout.write(f"  segment {sha}")
            if report.stopped:
                raise CommandError(f"tenant {t.slug}: stopped: {report.stopped}")
        if not dry_run:
            self._detach_emptied_months()
        verb = "would archive" if dry_run else "archived"
        self.stdout.write(f"ok: {verb} {runs} run(s), {actions} action(s)")

    def _detach_emptied_months(self):
        """On PostgreSQL, the months archiving left empty are detached and dropped, never rewritten
        (ledger/db/partitions.py); a month that still holds a row stays, and is counted."""
        from datetime import datetime, timezone as dt_timezone

        from ledger.db import partitions

        if not partitions.supported():
            return
        done = partitions.detach_before(partitions.month_of(datetime.now(dt_timezone.utc)))
        dropped = [d.name for d in done if d.dropped]
        if dropped:
            self.stdout.write(f"partitions: detached and dropped {len(dropped)} empty month(s): {', '.join(dropped)}")
        busy = [d.name for d in done if not d.dropped and d.why.startswith("busy")]
        kept = len(done) - len(dropped) - len(busy)
        if kept:
            self.stdout.write(f"partitions: {kept} older month(s) still hold rows (runs kept hot, or events of "
                              "runs still open): `manage.py partitions` lists them")
        if busy:
            self.stdout.write(f"partitions: {', '.join(busy)} stayed busy past UNWIND_PARTITION_LOCK_TIMEOUT (steps "
                              "kept writing): its emptied months go in the next pass")
