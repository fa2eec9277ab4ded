import getpass

from django.core.management.base import BaseCommand, CommandError

from ledger.management.policy_files import read_policy_file, tenant_named
from ledger.errors import UnwindError
from ledger.policy.document import keys_left_implicit
from ledger.policy.versions import tools_load


def shell_actor() -> str:
    """Who ran the command, for the audit chain: shell access to the deployment is a deployer's."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        user = "unknown"
    return f"system:load_tools:{user}"


class Command(BaseCommand):
    help = ("Load tools and their policy from a JSON or YAML policy file (see README, 'Policy files'). For deployers "
            "with shell access; audit events name the OS user (system:load_tools:<user>).")

    def add_arguments(self, parser):
        parser.add_argument("file")
        parser.add_argument("--tenant", help="tenant slug (default: the file's 'tenant' field)")

    def handle(self, *args, file, tenant=None, **options):
        document = read_policy_file(file)
        tenant_obj = tenant_named(tenant, document)
        try:
            tools = tools_load(tenant=tenant_obj, document=document, actor=shell_actor())
        except UnwindError as exc:
            raise CommandError(f"{file}: {exc.detail}") from None
        for tool in tools:
            self.stdout.write(f"  {tool.name:32s} {tool.saga_role:14s} risk={tool.risk:8s} approval={tool.approval}")
        for warning in keys_left_implicit(document):
            self.stderr.write(self.style.WARNING(f"warning: {warning}"))
        self.stdout.write(self.style.SUCCESS(f"loaded {len(tools)} tool(s) into {tenant_obj.slug}"))
