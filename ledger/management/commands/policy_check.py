"""`manage.py policy_check FILE --tenant T`: validate a policy file and show what loading it would change."""
import json

from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.management.policy_files import read_policy_file, tenant_named
from ledger.models import POLICY_FIELDS, Tool
from ledger.policy.document import keys_left_implicit, parse_document
from ledger.policy.versions import _check_compensation_tools, _check_inline_twins, _check_mcp_servers


def shown(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def changes(current: Tool, fields: dict) -> list[str]:
    """Each policy field the file changes, as `field: old → new`; rules and limits one entry a line."""
    lines = []
    for name in POLICY_FIELDS:
        old, new = getattr(current, name), fields.get(name, getattr(current, name))
        if name == "compensation":  # the version bindings are written at load
            old = {k: v for k, v in (old or {}).items() if k != "twin_version"}
            new = {k: v for k, v in (new or {}).items() if k != "twin_version"}
        if old == new:
            continue
        if name in ("rules", "limits"):
            lines.extend(f"{name}: - {shown(item)}" for item in old if item not in new)
            lines.extend(f"{name}: + {shown(item)}" for item in new if item not in old)
        else:
            lines.append(f"{name}: {shown(old)} → {shown(new)}")
    return lines


class Command(BaseCommand):
    help = ("Validate a policy file (rules compiled and bounded, as loading does) and show the difference from the "
            "tenant's current policy, tool by tool. Writes nothing.")

    def add_arguments(self, parser):
        parser.add_argument("file")
        parser.add_argument("--tenant", help="tenant slug (default: the file's 'tenant' field)")

    def handle(self, *args, file, tenant=None, **options):
        document = read_policy_file(file)
        tenant = tenant_named(tenant, document)
        where = "agentSafety.policies" if "agentSafety" in document else "tools"
        try:
            parsed = parse_document(document)
            _check_compensation_tools(tenant, parsed.tools, where=where)
            _check_mcp_servers(tenant, parsed.tools, where=where)
            _check_inline_twins(tenant, parsed.tools, where=where)
        except UnwindError as exc:
            raise CommandError(f"{file}: {exc.detail}") from None
        current = {tool.name: tool for tool in Tool.objects.filter(tenant=tenant, is_current=True)}
        changed = 0
        for name, fields in sorted(parsed.tools.items()):
            tool = current.get(name)
            if tool is None:
                changed += 1
                self.stdout.write(f"+ {name}: new tool ({len(fields['rules'])} rule(s), {len(fields['limits'])} "
                                  f"limit(s))")
                continue
            lines = changes(tool, fields)
            if not lines:
                self.stdout.write(f"= {name}: unchanged (version {tool.version})")
                continue
            changed += 1
            self.stdout.write(f"~ {name}: version {tool.version} → {tool.version + 1}")
            for line in lines:
                self.stdout.write(f"    {line}")
        for name in sorted(set(current) - set(parsed.tools)):
            self.stdout.write(f"  {name}: not in the file (stays as it is)")
        for warning in keys_left_implicit(document):
            self.stderr.write(self.style.WARNING(f"warning: {warning}"))
        self.stdout.write(self.style.SUCCESS(
            f"{file} is valid: {changed} tool(s) would change in {tenant.slug}; nothing was written"))
