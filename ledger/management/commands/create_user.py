import secrets
import sys

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from ledger.errors import UnwindError
from ledger.models import Role, Tenant
from ledger.tenancy import membership_set, user_create

ACTOR = "system:create_user"


class Command(BaseCommand):
    help = ("Create a person with a role in a tenant (viewer, approver, operator, admin). The password comes from "
            "--password-stdin, or is generated and printed once. With --add-role, give an existing person a role in "
            "the tenant instead (replacing the role they had there); their password is left alone.")
    stealth_options = ("stdin",)

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--tenant", required=True, help="the tenant's slug")
        parser.add_argument("--role", required=True, help=f"one of {', '.join(Role.values)}")
        parser.add_argument("--email", default="")
        parser.add_argument("--password-stdin", action="store_true",
                            help="read the password from the first line of standard input")
        parser.add_argument("--add-role", action="store_true",
                            help="the person exists: set their role in the tenant, nothing else")

    def handle(self, *args, username, tenant, role, email, password_stdin, add_role, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"tenant {tenant!r} does not exist (create it with: manage.py create_tenant {tenant})")
        if role not in Role.values:
            raise CommandError(f"role {role!r} is not a role; use one of {', '.join(Role.values)}")
        if add_role:
            return self.add_role(username, tenant_obj, role, password_stdin=password_stdin, email=email)
        if get_user_model().objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} already exists; give them a role in {tenant} with --add-role")
        generated = not password_stdin
        password = secrets.token_urlsafe(18) if generated else self.read_password(options.get("stdin") or sys.stdin)
        try:
            user_create(username=username, email=email, password=password, tenant=tenant_obj, role=role, actor=ACTOR)
        except UnwindError as exc:
            raise CommandError(exc.detail) from None
        self.stderr.write(f"created {username} as {role} in {tenant}")
        if generated:
            self.stderr.write("their password is shown once, pass it on now:")
            self.stdout.write(password)

    def add_role(self, username, tenant, role, *, password_stdin: bool, email: str):
        if password_stdin or email:
            raise CommandError("--add-role changes only the role; it takes no --password-stdin or --email")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"user {username!r} does not exist; create them without --add-role")
        membership_set(tenant=tenant, user=user, role=role, actor=ACTOR)
        self.stderr.write(f"{username} is now {role} in {tenant.slug}")

    @staticmethod
    def read_password(stream) -> str:
        password = stream.readline().rstrip("\r\n")
        if not password:
            raise CommandError("--password-stdin read an empty password")
        return password
