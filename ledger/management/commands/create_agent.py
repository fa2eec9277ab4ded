from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Membership, Tenant
from ledger.tenancy import agent_create, agent_person_set


class Command(BaseCommand):
    help = "Create an agent of a tenant and print its API key once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("name")
        parser.add_argument("--person", default="", help="The username of the person who uses this agent's MCP "
                                                          "client (a member of the tenant): an approval they may "
                                                          "decide is offered to them in a client that takes URL "
                                                          "elicitation.")

    def handle(self, *args, tenant, name, person="", **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"tenant {tenant!r} does not exist (create it with: manage.py create_tenant {tenant})")
        user = None
        if person:
            user = get_user_model().objects.filter(username=person).first()
            if user is None or not Membership.objects.filter(tenant=tenant_obj, user=user).exists():
                raise CommandError(f"there is no user {person!r} in {tenant} (a person is mapped within the tenant)")
        try:
            agent, key = agent_create(tenant=tenant_obj, name=name, actor="system:create_agent")
            if user is not None:
                agent_person_set(agent=agent, person=user, actor="system:create_agent")
        except UnwindError as exc:
            raise CommandError(exc.detail) from None
        self.stderr.write(f"agent {tenant}/{name} created; its key is shown once, store it now:")
        self.stdout.write(key)
