"""Small helpers shared by tests: driving runs through the real services."""
import json
import os
import subprocess
import sys
from pathlib import Path

from django.db import connection

from ledger.models import Run
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_open


def open_run(world, goal="test run", **kwargs) -> Run:
    return run_open(tenant=world.acme, agent=world.agent, goal=goal, on_behalf_of="carol@example.com",
                    actor="agent:booker", **kwargs)


def act(run, tool, args, *, key=None, target=None, intent=None):
    """Propose and, when claimed, execute inline, as the API's fast path does. Returns the action."""
    proposal = action_propose(run=run, tool_name=tool, args=args, actor="agent:booker", idempotency_key=key,
                              target=target, intent=intent or {"goal": run.goal, "confidence": 0.9})
    if proposal.claimed:
        execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)
        run.refresh_from_db()
        if run.status == "unwinding":
            execution.unwind(run.pk)
    proposal.action.refresh_from_db()
    run.refresh_from_db()
    return proposal.action


def fault(tool, mode="status", *, tenant="acme", **rule):
    """Inject a sandbox fault for `tenant` (the tests' runs act for acme)."""
    from ledger.models import Tenant
    from sandbox.faults import fault_add

    return fault_add({"tool": tool, "mode": mode, **rule}, tenant=Tenant.objects.get(slug=tenant))


def acme():
    """The tenant the tests' runs act for, whose sandbox world they read."""
    from ledger.models import Tenant

    return Tenant.objects.get(slug="acme")


def signed_post(url: str, payload: dict, *, tenant: str = "acme", headers: dict | None = None):
    """POST to a sandbox tool as Unwind does: the JSON body signed for `tenant` (ledger.executors.signing)."""
    import json

    import requests

    from ledger.executors import signing

    body = json.dumps(payload).encode()
    signed = signing.sign(tenant=tenant, method="POST", url=url, body=body)
    return requests.post(url, data=body, timeout=5,
                         headers={"Content-Type": "application/json", **signed, **(headers or {})})


# --- the archive (docs/archive.md) -----------------------------------------------------------------------------------

def archive_store_at(settings, tmp_path):
    """A signing key and an archive directory under `tmp_path`, named in the settings; the directory."""
    import io

    from django.core.management import call_command

    key_file = tmp_path / "keys" / "audit-signing.pem"
    call_command("audit_keygen", str(key_file), stdout=io.StringIO(), stderr=io.StringIO())
    settings.UNWIND_AUDIT_SIGNING_KEY_FILE = str(key_file)
    settings.UNWIND_ARCHIVE_URL = f"file://{tmp_path / 'archive'}"
    return tmp_path / "archive"


def archive_past_retention(world, runs, days=100):
    """Move settled runs `days` back and archive acme's runs past a 90-day retention: they must be exactly these."""
    from datetime import timedelta

    from django.utils import timezone

    from ledger.archive.service import archive_tenant
    from ledger.models import Tenant
    from ledger.policy.versions import tenant_defaults_set

    past = timezone.now() - timedelta(days=days)
    Run.objects.filter(pk__in=[r.pk for r in runs]).update(created_at=past, finished_at=past)
    tenant_defaults_set(tenant=world.acme, values={"retention_seconds": 90 * 86400}, actor="test")
    assert archive_tenant(tenant=Tenant.objects.get(pk=world.acme.pk), actor="test").runs == len(runs)


# --- a live server (pytest-django's live_server; `world.url` is its address) ---------------------------------------

def live_api(world, path, key, method="get", **kwargs):
    """A request to the live server with an agent's key."""
    import requests

    return getattr(requests, method)(f"{world.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                                     **kwargs)


def live_session(world, user):
    """A browser logged in as `user` on the live server."""
    import requests
    from django.test import Client

    client = Client()
    client.force_login(user)
    browser = requests.Session()
    browser.cookies.set("sessionid", client.cookies["sessionid"].value)
    return browser


def as_if(answer, real_id: int, other_id: int) -> str:
    """An answer's body with every mention of `real_id` (as a whole number) read as `other_id`: a refusal about a
    real object must be this body of one that never was, byte for byte."""
    import re

    return re.sub(rf"(?<![0-9]){real_id}(?![0-9])", str(other_id), answer.text)


def in_scratch_database(script: str, suffix: str) -> dict:
    """Run `script` (Python) in a child process on a PostgreSQL database of its own (this test database's name and
    `_suffix`, made afresh and dropped after), with the benchmark's no-op tools; the JSON object its last line
    prints. For a migration tested on a database that holds data."""
    base = connection.settings_dict
    name = f"{base['NAME']}_{suffix}"
    url = f"postgres://{base['USER']}@{base['HOST']}:{base['PORT']}"
    root = Path(__file__).resolve().parent.parent
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        cursor.execute(f'CREATE DATABASE "{name}"')
    try:
        env = dict(os.environ, DATABASE_URL=f"{url}/{name}", DJANGO_SETTINGS_MODULE="config.settings",
                   UNWIND_INSECURE_DEV_KEY="1", UNWIND_PYTHON_TOOL_MODULES="bench.noop_tools", UNWIND_SANDBOX="0",
                   PYTHONPATH=str(root))
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
