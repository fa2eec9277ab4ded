from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Tenant
from ledger.tenancy import tenant_create


class Command(BaseCommand):
    help = "Create a tenant."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", default="")

    def handle(self, *args, slug, name, **options):
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"tenant {slug!r} already exists")
        try:
            tenant_create(slug=slug, name=name)
        except UnwindError as exc:
            raise CommandError(exc.detail) from None
        self.stdout.write(self.style.SUCCESS(f"created tenant {slug}"))
