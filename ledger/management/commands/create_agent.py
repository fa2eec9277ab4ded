from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Tenant
from ledger.tenancy import agent_create


class Command(BaseCommand):
    help = "Create an agent of a tenant and print its API key once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("name")

    def handle(self, *args, tenant, name, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"tenant {tenant!r} does not exist (create it with: manage.py create_tenant {tenant})")
        try:
            agent, key = agent_create(tenant=tenant_obj, name=name, actor="system:create_agent")
        except UnwindError as exc:
            raise CommandError(exc.detail) from None
        self.stderr.write(f"agent {tenant}/{name} created; its key is shown once, store it now:")
        self.stdout.write(key)
