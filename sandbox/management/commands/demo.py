"""`manage.py demo`: seed a demo tenant, start the web server and a worker, run the scenarios.

--check runs them and exits non-zero on any mismatch; --serve (what `make demo` runs) keeps serving
until Ctrl-C, which stops every process it started.

The demo starts from a clean database when it uses its own (var/demo.sqlite3, what `make demo` points
DATABASE_URL at), unless --keep; any other database is never removed. The terminal shows the scenarios'
checks and ends with where to click and the logins: the web server and the worker write to var/demo-web.log
and var/demo-worker.log, and the email the demo sends goes to files in var/demo-mail/ and to the console's
outbox page, never to the terminal.

A demo on the demo's own database holds var/demo.lock while it runs (the lock dies with the process), so a second
demo of the same clone knows it is there: it never starts afresh (or re-seeds) that database under it, and on a
busy port it says which demo serves there and suggests a second one with a database of its own, whose env file,
key, logs and mail then go to var/demo-PORT/ instead of the first one's.
"""
import errno
import fcntl
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

import yaml

from approvals.models import ApprovalRequest, Notification
from approvals.services import approval_decide
from ledger.management.commands.worker import stop_group, stop_when_parent_dies
from ledger.models import Agent, Run, Tenant
from ledger.tenancy import agent_create, membership_set, tenant_create
from ledger.policy.versions import tool_upsert, tools_load
from recovery.customers import known_customer_add
from recovery.models import KnownCustomerAddress

TENANT = "demo"
PEOPLE = [  # username, role, password (demo only: printed on the terminal), what to try with it
    ("operator", "operator", "operator-demo", "recovery queue, runs, share a correction trail, the outbox"),
    ("approver", "approver", "approver-demo", "the approvals inbox: a charge waits for a decision"),
    ("viewer", "viewer", "viewer-demo", "reads runs and trails, decides nothing"),
]
ADMIN = ("admin", "superuser", "admin-demo", "/admin/: tools, policy versions, keys")
DEMO_CUSTOMER = "carol@company.com"
VAR = Path(settings.BASE_DIR) / "var"
DEMO_DATABASE = VAR / "demo.sqlite3"
MAIL_DIR = VAR / "demo-mail"
LOCK_FILE = VAR / "demo.lock"


class Files:
    """Where a demo writes what a person and a second terminal read: in var/ (`. var/demo.env`), or, for a second
    demo beside a running one, in var/demo-PORT/ so that the first one's env file, key, logs and mail stay its own."""

    def __init__(self, folder: Path):
        self.folder, self.mail = folder, folder / "demo-mail"
        self.env, self.key = folder / "demo.env", folder / "demo-agent.key"
        self.web_log, self.worker_log = folder / "demo-web.log", folder / "demo-worker.log"

    def shown(self, path: Path) -> str:
        return str(path.relative_to(settings.BASE_DIR))


class Command(BaseCommand):
    help = "Run the demo: seed, serve with a worker, run the four scenarios (see README)."

    def add_arguments(self, parser):
        mode = parser.add_mutually_exclusive_group(required=True)
        mode.add_argument("--serve", action="store_true", help="run the scenarios, then keep serving until Ctrl-C")
        mode.add_argument("--check", action="store_true", help="run the scenarios and exit non-zero on any mismatch")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--keep", action="store_true",
                            help=f"keep the demo database ({DEMO_DATABASE.relative_to(settings.BASE_DIR)}) and its "
                                 "runs instead of starting afresh")

    def handle(self, *args, serve=False, check=False, port=8000, keep=False, **options):
        base_url = f"http://127.0.0.1:{port}"
        # Before anything is touched: a second demo must not wipe or re-seed a running one's database under it.
        running = running_demo()
        port_free_or_fail(port, running=running)
        own = uses_demo_database(settings.DATABASES["default"])
        if own and running:
            raise CommandError(demo_running(running, port, what=(
                "starting another on its database would re-seed it under it" if keep else
                "a fresh demo would delete its database and mail under it")))
        VAR.mkdir(exist_ok=True)
        self.lock = hold_demo_lock(base_url, port) if own else None
        self.files = Files(VAR / f"demo-{port}" if running else VAR)
        self.files.folder.mkdir(exist_ok=True)
        self.start_afresh(keep=keep)
        self.say("migrating the database")
        call_command("migrate", verbosity=0, interactive=False)
        key = self.seed()
        write_env_file(self.files, base_url=base_url, key=key, database=settings.DATABASES["default"])
        # The demo is what the sandbox is for: it is on in the processes the demo starts, whatever the shell says.
        # Its email goes to files and the console's outbox, not to the terminal (a shell's EMAIL_BACKEND still wins).
        env = dict(os.environ, UNWIND_BASE_URL=base_url, UNWIND_TOOL_BASE_URL=base_url, UNWIND_TASKS_SYNC="0",
                   UNWIND_SANDBOX="1", PYTHONUNBUFFERED="1")
        env.setdefault("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
        env.setdefault("EMAIL_FILE_PATH", str(self.files.mail))
        logs = f"{self.files.shown(self.files.web_log)} and {self.files.shown(self.files.worker_log)}"
        processes = []
        signal.signal(signal.SIGTERM, stop_on_sigterm)  # `kill` stops the web server and the worker as Ctrl-C does
        try:
            web_log = open(self.files.web_log, "w")
            worker_log = open(self.files.worker_log, "w")
            # Each in a session of its own (Ctrl-C reaches the demo, which stops them in order), and each told to
            # stop should the demo itself die without a word (SIGKILL): no server or worker outlives it.
            processes.append(subprocess.Popen(
                [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                cwd=settings.BASE_DIR, env=env, stdout=web_log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=stop_when_parent_dies))
            processes.append(subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=settings.BASE_DIR, env=env,
                                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=stop_when_parent_dies))
            self.wait_for(base_url, processes, logs=logs)
            # `make demo` leaves the last charge for you to decide; --check decides it as you would.
            checks, runs, waiting = self.scenarios(base_url, key, decide_the_waiting_charge=check)
            checks += self.console_checks(base_url, runs)
            failed = self.report(checks)
            if check:
                verdict = call_command_output("verify_audit")
                self.say(verdict.strip())
                if failed:
                    raise CommandError(f"{failed} check(s) did not match; logs: {logs}")
                self.stdout.write(self.style.SUCCESS(f"all {len(checks)} checks match"))
                return
            self.welcome(base_url, runs, waiting)
            while all(p.poll() is None for p in processes):
                time.sleep(0.5)
            raise CommandError(f"a demo process stopped; see {logs}")
        except KeyboardInterrupt:
            self.say("stopping")
        finally:
            for process in processes:
                stop_group(process, grace=15)

    def say(self, text: str) -> None:
        self.stdout.write(f"[demo] {text}")

    def start_afresh(self, *, keep: bool) -> None:
        """Remove the demo's own database (and the mail it sent) so each demo starts clean; never any other database."""
        database = settings.DATABASES["default"]
        own = demo_database_to_clear(database, keep=keep)
        if own is None:
            where = Path(str(database["NAME"])).name if database["ENGINE"].endswith("sqlite3") else \
                database["ENGINE"].rsplit(".", 1)[-1]
            why = "--keep" if keep else f"only {DEMO_DATABASE.relative_to(settings.BASE_DIR)} is ever removed"
            self.say(f"keeping the database ({where}: {why})")
            return
        connections.close_all()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{own}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(MAIL_DIR, ignore_errors=True)
        self.say(f"starting from a clean demo database ({DEMO_DATABASE.relative_to(settings.BASE_DIR)}; "
                 "KEEP=1 make demo keeps it)")

    def seed(self) -> str:
        tenant = Tenant.objects.filter(slug=TENANT).first() or tenant_create(slug=TENANT, name="Demo Company")
        policy = yaml.safe_load((Path(settings.BASE_DIR) / "sandbox" / "policy.yaml").read_text())
        tools_load(tenant=tenant, document=policy, actor="system:demo")
        User = get_user_model()
        for username, role, password, _ in PEOPLE:
            user = User.objects.filter(username=username).first() or User.objects.create_user(
                username, f"{username}@demo.example", password)
            membership_set(tenant=tenant, user=user, role=role)
        if not User.objects.filter(username=ADMIN[0]).exists():
            User.objects.create_superuser(ADMIN[0], f"{ADMIN[0]}@demo.example", ADMIN[2])
        # Hold notices go only to addresses the tenant knows (recovery/customers.py): Carol is the demo's customer.
        if not KnownCustomerAddress.objects.filter(tenant=tenant, address=DEMO_CUSTOMER).exists():
            known_customer_add(tenant=tenant, address=DEMO_CUSTOMER, note="the demo's customer",
                               user=User.objects.get(username=ADMIN[0]))
        from sandbox.services import sandbox_reset

        sandbox_reset(tenant=tenant)
        name = f"demo-agent-{Agent.objects.filter(tenant=tenant).count() + 1}"
        _, key = agent_create(tenant=tenant, name=name, actor="system:demo")
        # For the curl examples in docs/demo.md: the key is a demo's, on this machine, readable by its owner only.
        self.files.key.unlink(missing_ok=True)
        self.files.key.touch(mode=0o600)
        self.files.key.write_text(key + "\n")
        self.say(f"seeded tenant '{TENANT}' with {len(policy['tools'])} sandbox tools and agent {name} "
                 f"(its key: {self.files.shown(self.files.key)})")
        return key

    def wait_for(self, base_url: str, processes, *, logs: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                raise CommandError(f"the web server or the worker did not start; see {logs}")
            try:
                if requests.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise CommandError(f"{base_url} did not answer within 60 s")

    def scenarios(self, base_url: str, key: str, *, decide_the_waiting_charge: bool):
        from sandbox import demo
        from unwind_client import Unwind

        approver = get_user_model().objects.get(username="approver")

        def decide(action_id: int, approve: bool, reason: str) -> None:
            request = ApprovalRequest.objects.get(action_id=action_id, status="pending")
            approval_decide(request=request, user=approver, approve=approve, reason=reason)

        operator = login_of("operator")
        policy = yaml.safe_load((Path(settings.BASE_DIR) / "sandbox" / "policy.yaml").read_text())

        def hold(tool: str, value) -> None:
            """The tenant's admin writes a new version of the tool's policy, with the hold or without one."""
            spec = {**policy["tools"][tool], **({"hold": value} if value else {})}
            tool_upsert(tenant=Tenant.objects.get(slug=TENANT), name=tool, spec=spec, actor="system:demo")

        def notice_link(run_id: int) -> str:
            """The trail link in the newest held-step notice about the run, on this server."""
            note = (Notification.objects.filter(kind="hold_notice", subject__endswith=f"(reference {run_id})")
                    .order_by("-id").first())
            found = re.search(r"/console/trail/[A-Za-z0-9_-]{43}/", note.body_text) if note else None
            return base_url + found.group(0) if found else ""

        ctx = demo.Context(base_url=base_url, key=key, client=Unwind(base_url, key), approve=decide, tenant=TENANT,
                           operator=operator, hold=hold, notice_link=notice_link)
        for scenario in demo.SCENARIOS:
            self.run_scenario(ctx, scenario)
        waiting = demo.waiting_in_the_inbox(ctx)  # its agent finishes the run once a person decides
        if decide_the_waiting_charge:

            def approved_in_the_inbox(ctx):
                """A person approves the charge left waiting; its agent completes the run."""
                demo.approved_in_the_inbox(ctx, waiting, approver=login_of("approver"), operator=operator)

            self.run_scenario(ctx, approved_in_the_inbox)
        # The pages need their stylesheet and htmx from this very server (DEBUG off, as a newcomer runs it).
        served = [requests.get(f"{base_url}{settings.STATIC_URL}{path}", timeout=10).status_code
                  for path in ("unwind/unwind.css", "unwind/htmx.min.js")]
        ctx.expect("0 pages", "stylesheet and htmx served", [200, 200], served)
        return ctx.checks, ctx.runs, waiting

    def run_scenario(self, ctx, scenario) -> None:
        self.say(f"scenario: {scenario.__doc__.strip().splitlines()[0]}")
        try:
            scenario(ctx)
        except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed check, reported with the rest
            ctx.expect(scenario.__name__, "ran to the end", "yes", f"{exc.__class__.__name__}: {exc}")

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

    def console_checks(self, base_url: str, runs: dict) -> list:
        """What a newcomer reads next: the outbox has the demo's email, a customer's trail shows no internals."""
        from sandbox.demo import Check
        from recovery.trail import trail_link_create

        username, _, password, _ = PEOPLE[0]
        session = requests.Session()
        login = f"{base_url}/accounts/login/"
        session.get(login, timeout=10)
        session.post(login, data={"username": username, "password": password,
                                  "csrfmiddlewaretoken": session.cookies.get("csrftoken", "")},
                     headers={"Referer": login}, timeout=10)
        outbox = session.get(f"{base_url}/console/outbox/", timeout=10)
        checks = [Check("0 pages", "outbox lists the approval email", True,
                        outbox.status_code == 200 and "Approval needed" in outbox.text)]
        run = Run.objects.filter(pk=runs.get("1 onboarding")).first()
        if run is not None:
            _, token = trail_link_create(run=run, user=get_user_model().objects.get(username=username))
            page = requests.get(f"{base_url}/console/trail/{token}/", timeout=10).text
            internals = [word for word in ("email.send", "answered", "/sandbox/", "audit chain", "<a ")
                         if word in page]
            checks.append(Check("0 pages", "customer trail shows no internals", [], internals))
        checks += self.crawl_checks(base_url, start=("/", f"/console/trail/{token}/") if run is not None else ("/",))
        return checks

    def crawl_checks(self, base_url: str, *, start: tuple[str, ...]) -> list:
        """Every page the demo reaches, as each of its people: every link followed, every GET form submitted."""
        from sandbox.crawl import crawl, login
        from sandbox.demo import Check

        checks = []
        for username, role, password, _ in [*PEOPLE, ADMIN]:
            result = crawl(base_url, login(base_url, username, password), start=start)
            checks.append(Check("0 pages", f"as {username}: {len(result.pages)} pages, none broken", [],
                                result.problems[:5]))
        return checks

    def welcome(self, base_url: str, runs: dict, waiting) -> None:
        """The last lines on the terminal: where to click, then who to log in as. Nothing prints after them."""
        line = self.stdout.write
        line("")
        line(self.style.SUCCESS(f"Unwind is serving at {base_url}  (Ctrl-C stops the web server and the worker)"))
        line("")
        line("Where to click:")
        if waiting:
            line(f"  a charge waits for your decision   {base_url}/approvals/{waiting.approval_id}/")
            line("                                     (approve it: the demo's agent completes its run; reject it: "
                 "Unwind undoes the hotel and the flight)")
        line(f"  recovery queue                     {base_url}/console/recovery/")
        for name, run_id in runs.items():
            line(f"  run of scenario {name:18s} {base_url}/console/runs/{run_id}/")
        shown = self.files.shown
        line(f"  email the demo sent (outbox)       {base_url}/console/outbox/   files: {shown(self.files.mail)}/")
        line(f"  API docs                           {base_url}/api/docs/   agent key: {shown(self.files.key)}")
        line(f"  in a second terminal, first        . {shown(self.files.env)}   "
             "(URL, agent key, database for manage.py)")
        line("  inject a fault, watch an unwind    docs/demo.md")
        line(f"  MCP server for agents              {base_url}/mcp   run examples/mcp_session.py; docs/mcp.md")
        line("")
        line(f"Log in at {base_url}/accounts/login/ as:")
        line(f"  {'user':10s} {'password':15s} {'role':10s} what to try")
        for username, role, password, what in [*PEOPLE, ADMIN]:
            line(f"  {username:10s} {password:15s} {role:10s} {what}")


def running_demo() -> str | None:
    """The address of a demo of this clone running on the demo's own database (it holds var/demo.lock), or None."""
    try:
        handle = open(LOCK_FILE)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "an address it did not record"
    return None


def hold_demo_lock(base_url: str, port: int):
    """Take var/demo.lock for as long as this process runs, recording its address; CommandError when a demo that
    started meanwhile holds it."""
    handle = open(LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise CommandError(demo_running(running_demo() or "another address", port,
                                        what="it started just now, on the same database")) from None
    handle.truncate(0)
    handle.write(base_url)
    handle.flush()
    return handle


def demo_running(address: str, port: int, *, what: str) -> str:
    """What a second demo says when this clone's demo runs at `address` on the demo's own database: a second demo
    beside it on `port` (or, when `port` is taken, the next free one) with a database of its own."""
    free = port if can_serve(port) else free_port_after(port)
    return (f"this clone's demo is serving at {address} on {DEMO_DATABASE.relative_to(settings.BASE_DIR)}, and {what}; "
            f"nothing was changed. Use that demo as it is (`. var/demo.env` in another terminal reaches it), or stop "
            f"it (Ctrl-C in its terminal) first; or run a second demo beside it with a database of its own: make demo "
            f"PORT={free} DATABASE_URL=sqlite:///var/demo-{free}.sqlite3")


def free_port_after(port: int) -> int:
    """The first port after `port` that 127.0.0.1 can be served on (`port` + 1 when none of the next 50 is free)."""
    for candidate in range(port + 1, min(port + 51, 65536)):
        if can_serve(candidate):
            return candidate
    return port + 1


def can_serve(port: int) -> bool:
    try:
        bind_probe(port).close()
    except OSError:
        return False
    return True


def bind_probe(port: int) -> socket.socket:
    """A socket bound to 127.0.0.1:`port` as the web server will bind it (OSError when it cannot be)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As the web server will (socketserver's allow_reuse_address): connections of a demo that just stopped, still in
    # TIME_WAIT, do not hold the port; a server listening on it does.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))
    except OSError:
        probe.close()
        raise
    return probe


def port_free_or_fail(port: int, *, running: str | None = None) -> None:
    """CommandError (exit 1, within a second) when 127.0.0.1:`port` cannot be served on, saying what to do: when this
    clone's demo runs (`running`, its address), never a command that would start afresh on its database."""
    try:
        bind_probe(port).close()
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise
        why = "in use" if exc.errno == errno.EADDRINUSE else "not allowed for this user"
        if running:
            raise CommandError(f"port {port} is {why}: " + demo_running(running, port, what=(
                "a fresh demo would delete its database and mail under it"))) from None
        raise CommandError(
            f"port {port} is {why} (another server listens on 127.0.0.1:{port}; no demo of this clone is running); "
            f"nothing was changed. Stop the other one, or start this one on another port: "
            f"make demo PORT={free_port_after(port)}") from None


def database_url(database: dict) -> str:
    """The DATABASE_URL that reaches `database` from any directory (a SQLite file by its absolute path)."""
    if database["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{Path(str(database['NAME'])).resolve()}"
    return os.environ["DATABASE_URL"]


def write_env_file(files: Files, *, base_url: str, key: str, database: dict) -> None:
    """var/demo.env: what a second terminal needs to reach this demo (`. var/demo.env`), readable by its owner only.

    The examples read UNWIND_URL and UNWIND_AGENT_KEY; manage.py reads DATABASE_URL and, as the demo does, runs on
    the public development key (UNWIND_INSECURE_DEV_KEY), never a production setting.
    """
    values = {"UNWIND_URL": base_url, "UNWIND_AGENT_KEY": key, "DATABASE_URL": database_url(database),
              "UNWIND_INSECURE_DEV_KEY": "1", "UNWIND_SANDBOX": "1"}
    files.env.unlink(missing_ok=True)
    files.env.touch(mode=0o600)
    files.env.write_text(f"# Written by the demo; `. {files.shown(files.env)}` in a second terminal reaches it.\n"
                        + "".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items()))


def uses_demo_database(database: dict) -> bool:
    """Whether `database` is the demo's own SQLite file (var/demo.sqlite3)."""
    return database["ENGINE"].endswith("sqlite3") and Path(str(database["NAME"])).resolve() == DEMO_DATABASE.resolve()


def demo_database_to_clear(database: dict, *, keep: bool) -> Path | None:
    """The database file a fresh demo removes: the demo's own SQLite file, unless kept; any other, never."""
    return DEMO_DATABASE if not keep and uses_demo_database(database) else None


def login_of(role: str) -> tuple[str, str]:
    """(username, password) of the demo's person with this role."""
    return next((username, password) for username, their_role, password, _ in PEOPLE if their_role == role)


def call_command_output(name: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command(name, stdout=out)
    return out.getvalue()


def stop_on_sigterm(signum, frame):
    """SIGTERM (kill, a supervisor, a container stop) ends the demo the way Ctrl-C does, children included."""
    raise KeyboardInterrupt
