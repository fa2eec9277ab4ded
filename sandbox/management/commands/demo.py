"""`manage.py demo`: seed a demo tenant, start the web server and a worker, run the scenarios.

--check runs them and exits non-zero on any mismatch; --serve (what `make demo` runs) keeps serving
until Ctrl-C, which stops every process it started.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

import yaml

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.management.commands.worker import stop_group
from ledger.models import Agent, Tenant
from ledger.services.tenancy import agent_create, membership_set, tenant_create
from ledger.services.tools import tools_load

TENANT = "demo"
PEOPLE = [  # username, role, password (demo only: printed on the terminal)
    ("approver", "approver", "approver-demo"),
    ("operator", "operator", "operator-demo"),
    ("viewer", "viewer", "viewer-demo"),
]


class Command(BaseCommand):
    help = "Run the demo: seed, serve with a worker, run the four scenarios (see README)."

    def add_arguments(self, parser):
        mode = parser.add_mutually_exclusive_group(required=True)
        mode.add_argument("--serve", action="store_true", help="run the scenarios, then keep serving until Ctrl-C")
        mode.add_argument("--check", action="store_true", help="run the scenarios and exit non-zero on any mismatch")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args, serve=False, check=False, port=8000, **options):
        base_url = f"http://127.0.0.1:{port}"
        self.say("migrating the database")
        call_command("migrate", verbosity=0, interactive=False)
        key = self.seed()
        # The demo is what the sandbox is for: it is on in the processes the demo starts, whatever the shell says.
        env = dict(os.environ, UNWIND_BASE_URL=base_url, UNWIND_TOOL_BASE_URL=base_url, UNWIND_TASKS_SYNC="0",
                   UNWIND_SANDBOX="1", PYTHONUNBUFFERED="1")
        env.setdefault("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
        logs = Path(settings.BASE_DIR) / "var"
        processes = []
        signal.signal(signal.SIGTERM, stop_on_sigterm)  # `kill` stops the web server and the worker as Ctrl-C does
        try:
            web_log = open(logs / "demo-web.log", "w")
            processes.append(subprocess.Popen(
                [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                cwd=settings.BASE_DIR, env=env, stdout=web_log, stderr=subprocess.STDOUT, start_new_session=True))
            processes.append(subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=settings.BASE_DIR, env=env,
                                              stdout=sys.stdout if serve else subprocess.DEVNULL,
                                              stderr=sys.stderr if serve else subprocess.DEVNULL,
                                              start_new_session=True))
            self.wait_for(base_url, processes)
            checks, runs, waiting = self.scenarios(base_url, key)
            failed = self.report(checks)
            if check:
                verdict = call_command_output("verify_audit")
                self.say(verdict.strip())
                if failed:
                    raise CommandError(f"{failed} check(s) did not match; web log: var/demo-web.log")
                self.stdout.write(self.style.SUCCESS(f"all {len(checks)} checks match"))
                return
            self.welcome(base_url, runs, waiting)
            while all(p.poll() is None for p in processes):
                time.sleep(0.5)
            raise CommandError("a demo process stopped; see var/demo-web.log")
        except KeyboardInterrupt:
            self.say("stopping")
        finally:
            for process in processes:
                stop_group(process, grace=15)

    def say(self, text: str) -> None:
        self.stdout.write(f"[demo] {text}")

    def seed(self) -> str:
        tenant = Tenant.objects.filter(slug=TENANT).first() or tenant_create(slug=TENANT, name="Demo Company")
        policy = yaml.safe_load((Path(settings.BASE_DIR) / "sandbox" / "policy.yaml").read_text())
        tools_load(tenant=tenant, document=policy, actor="system:demo")
        User = get_user_model()
        for username, role, password in PEOPLE:
            user = User.objects.filter(username=username).first() or User.objects.create_user(
                username, f"{username}@demo.example", password)
            membership_set(tenant=tenant, user=user, role=role)
        if not User.objects.filter(username="admin").exists():
            User.objects.create_superuser("admin", "admin@demo.example", "admin-demo")
        from sandbox.services import sandbox_reset

        sandbox_reset(tenant=tenant)
        name = f"demo-agent-{Agent.objects.filter(tenant=tenant).count() + 1}"
        _, key = agent_create(tenant=tenant, name=name, actor="system:demo")
        self.say(f"seeded tenant '{TENANT}' with {len(policy['tools'])} sandbox tools and agent {name}")
        return key

    def wait_for(self, base_url: str, processes) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                raise CommandError("the web server or the worker did not start; see var/demo-web.log")
            try:
                if requests.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise CommandError(f"{base_url} did not answer within 60 s")

    def scenarios(self, base_url: str, key: str):
        from sandbox import demo
        from unwind_client import Unwind

        approver = get_user_model().objects.get(username="approver")

        def decide(action_id: int, approve: bool, reason: str) -> None:
            request = ApprovalRequest.objects.get(action_id=action_id, status="pending")
            approval_decide(request=request, user=approver, approve=approve, reason=reason)

        operator = next((username, password) for username, role, password in PEOPLE if role == "operator")
        ctx = demo.Context(base_url=base_url, client=Unwind(base_url, key), approve=decide, tenant=TENANT,
                           operator=operator)
        for scenario in demo.SCENARIOS:
            self.say(f"scenario: {scenario.__doc__.strip().splitlines()[0]}")
            try:
                scenario(ctx)
            except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed check, reported with the rest
                ctx.expect(scenario.__name__, "ran to the end", "yes", f"{exc.__class__.__name__}: {exc}")
        waiting = demo.waiting_in_the_inbox(ctx)
        # The pages need their stylesheet and htmx from this very server (DEBUG off, as a newcomer runs it).
        served = [requests.get(f"{base_url}{settings.STATIC_URL}{path}", timeout=10).status_code
                  for path in ("unwind/unwind.css", "unwind/htmx.min.js")]
        ctx.expect("0 pages", "stylesheet and htmx served", [200, 200], served)
        return ctx.checks, ctx.runs, waiting

    def report(self, checks) -> int:
        width = max(len(c.what) for c in checks) if checks else 10
        self.stdout.write("")
        failed = 0
        for c in checks:
            mark = "ok " if c.ok else "MISMATCH"
            failed += not c.ok
            line = f"  {mark:8s} {c.scenario:14s} {c.what:{width}s}  {c.observed}"
            if not c.ok:
                line += f"   (expected {c.expected})"
            self.stdout.write(self.style.SUCCESS(line) if c.ok else self.style.ERROR(line))
        self.stdout.write("")
        return failed

    def welcome(self, base_url: str, runs: dict, waiting: int) -> None:
        self.stdout.write(self.style.SUCCESS(f"Unwind is serving at {base_url}"))
        people = ", ".join(f"{u} / {p}" for u, _, p in PEOPLE)
        self.stdout.write(f"  log in at {base_url}/accounts/login/  ({people}; admin / admin-demo for /admin/)")
        for name, run_id in runs.items():
            self.stdout.write(f"  run of scenario {name:12s} {base_url}/console/runs/{run_id}/")
        if waiting:
            request = ApprovalRequest.objects.filter(action_id=waiting).first()
            if request:
                self.stdout.write(f"  a charge waits for you in the inbox: {base_url}/approvals/{request.pk}/")
        self.stdout.write(f"  recovery queue: {base_url}/console/recovery/   API docs: {base_url}/api/docs/")
        self.stdout.write("  Ctrl-C stops the web server and the worker.")


def call_command_output(name: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command(name, stdout=out)
    return out.getvalue()


def stop_on_sigterm(signum, frame):
    """SIGTERM (kill, a supervisor, a container stop) ends the demo the way Ctrl-C does, children included."""
    raise KeyboardInterrupt
