"""What the policy commands share (load_tools, policy_check, policy_try): reading a policy file and the tenant it
is for, each refusal a sentence naming the file or the tenant."""
import json
from pathlib import Path

import yaml
from django.core.management.base import CommandError

from ledger.models import Tenant


def read_policy_file(file: str) -> dict:
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
    return document


def tenant_named(slug: str | None, document: dict) -> Tenant:
    slug = slug or document.get("tenant")
    if not slug:
        raise CommandError("name the tenant with --tenant or a 'tenant' field in the file")
    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        raise CommandError(f"tenant {slug!r} does not exist (create it with: manage.py create_tenant {slug})")
    return tenant
