from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Tenant
from ledger.tenancy import deploy_key_create


class Command(BaseCommand):
    help = ("Create a deploy key of a tenant and print it once (only its hash is stored). A deploy key writes tools "
            "and policy (PUT /api/v1/tools/{name}, POST /api/v1/policy) for a pipeline that pushes a reviewed "
            "policy file; it can never open runs or propose actions. Revoke it in the Django admin.")

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("name", help="what uses it, e.g. ci-policy; audit events name it deploy:<name>")

    def handle(self, *args, tenant, name, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"tenant {tenant!r} does not exist (create it with: manage.py create_tenant {tenant})")
        try:
            key, raw = deploy_key_create(tenant=tenant_obj, name=name, actor="system:create_deploy_key")
        except UnwindError as exc:
            raise CommandError(exc.detail) from None
        self.stderr.write(f"deploy key {tenant}/{key.name} created; it is shown once, store it in your pipeline's "
                          f"secrets now:")
        self.stdout.write(raw)
