"""Seed a fresh database for the TypeScript client's tests, as `manage.py demo` does: a tenant with the sandbox's
tools and world, its people (approver, operator, admin), an agent; prints what the tests need as one JSON line.

Run by scripts/test.mjs as `manage.py shell -c "exec(open('clients/typescript/scripts/seed.py').read())"`: one Django
start for everything, through the same management commands a deployer runs.
"""
import io
import json
import sys
from pathlib import Path

import yaml
from django.core.management import call_command

from ledger.models import Tenant
from ledger.policy.versions import tool_upsert

SLUG = "ts"
PEOPLE = {"approver": "approver", "operator": "operator", "admin": "admin"}  # username: role
PASSWORD = "ts-client-tests"

call_command("migrate", verbosity=0, interactive=False)
call_command("create_tenant", SLUG, name="TypeScript client tests")
call_command("load_tools", "sandbox/policy.yaml", tenant=SLUG, stdout=io.StringIO())
tenant = Tenant.objects.get(slug=SLUG)
# A held step to stop: the sandbox's email tool under another name, held 30 s before it sends.
email = yaml.safe_load(Path("sandbox/policy.yaml").read_text())["tools"]["email.send"]
tool_upsert(tenant=tenant, name="email.send_held", spec={**email, "hold": {"for": "30s"}}, actor="system:ts-tests")
# Keyed by some of its args only (idempotency.key_fields), for the derived key's parity.
tool_upsert(tenant=tenant, name="email.send_keyed", actor="system:ts-tests",
            spec={**email, "idempotency": {"honours_key": False, "key_fields": ["to", "subject"]}})
# Client-executed tools (the agent runs them and reports), one undoing the other.
notes_schema = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
tool_upsert(tenant=tenant, name="notes.erase", actor="system:ts-tests", spec={
    "description": "Erase a note.", "action_class": "internal_update", "saga_role": "compensatable", "risk": "low",
    "executor": "client", "args_schema": {"type": "object", "properties": {"note_id": {"type": "string"}}}})
tool_upsert(tenant=tenant, name="notes.write", actor="system:ts-tests", spec={
    "description": "Write a note.", "action_class": "internal_update", "saga_role": "compensatable", "risk": "low",
    "executor": "client", "args_schema": notes_schema,
    "compensation": {"strategy": "twin", "tool": "notes.erase", "args": {"note_id": "$result.id"}}})
for username, role in PEOPLE.items():
    stdin, sys.stdin = sys.stdin, io.StringIO(PASSWORD + "\n")
    try:
        call_command("create_user", username, tenant=SLUG, role=role, password_stdin=True, stdout=io.StringIO(),
                     stderr=io.StringIO())
    finally:
        sys.stdin = stdin
call_command("sandbox_reset", tenant=SLUG, stdout=io.StringIO())
key = io.StringIO()
call_command("create_agent", SLUG, "ts-agent", stdout=key, stderr=io.StringIO())
other = io.StringIO()
call_command("create_agent", SLUG, "ts-other-agent", stdout=other, stderr=io.StringIO())
print(json.dumps({"key": key.getvalue().strip(), "other_key": other.getvalue().strip(), "tenant_id": tenant.pk,
                  "password": PASSWORD, "people": list(PEOPLE)}))
