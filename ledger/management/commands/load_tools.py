import getpass
import json
from pathlib import Path

import yaml
from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Tenant
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
        path = Path(file)
        if not path.exists():
            raise CommandError(f"{file}: no such file")
        text = path.read_text()
        try:
            document = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise CommandError(f"{file} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
        if not isinstance(document, dict):
            raise CommandError(f"{file} must hold an object with 'tools' (or 'agentSafety'), not {type(document).__name__}")
        slug = tenant or document.get("tenant")
        if not slug:
            raise CommandError("name the tenant with --tenant or a 'tenant' field in the file")
        tenant_obj = Tenant.objects.filter(slug=slug).first()
        if tenant_obj is None:
            raise CommandError(f"tenant {slug!r} does not exist (create it with: manage.py create_tenant {slug})")
        try:
            tools = tools_load(tenant=tenant_obj, document=document, actor=shell_actor())
        except UnwindError as exc:
            raise CommandError(f"{file}: {exc.detail}") from None
        for tool in tools:
            self.stdout.write(f"  {tool.name:32s} {tool.saga_role:14s} risk={tool.risk:8s} approval={tool.approval}")
        for warning in keys_left_implicit(document):
            self.stderr.write(self.style.WARNING(f"warning: {warning}"))
        self.stdout.write(self.style.SUCCESS(f"loaded {len(tools)} tool(s) into {slug}"))
