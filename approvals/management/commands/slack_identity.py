"""`manage.py slack_identity`: say which Unwind person a Slack user is, for deciding from Slack (approvals/slack.py).

Only this command (a deployer's or admin's shell) and the Django admin write the mapping, and each change is
audited: a Slack payload only names the Slack user who clicked, so whoever maps that id decides who they are.
"""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from approvals.models import SlackIdentity
from ledger.audit.chain import ledger_transaction
from ledger.models import Membership, Tenant

ACTOR = "command:slack_identity"


class Command(BaseCommand):
    help = "Map a Slack user id to a person of a tenant (or --remove the mapping); --list shows the tenant's mappings."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--user", help="Unwind username")
        parser.add_argument("--slack-user", help="Slack user id, e.g. U012AB3CD")
        parser.add_argument("--remove", action="store_true", help="remove the mapping of --slack-user")
        parser.add_argument("--list", action="store_true", help="list the tenant's mappings")

    def handle(self, *args, tenant, user=None, slack_user=None, remove=False, list=False, **options):
        tenant_row = Tenant.objects.filter(slug=tenant).first()
        if tenant_row is None:
            raise CommandError(f"tenant {tenant!r} does not exist")
        if list:
            for row in SlackIdentity.objects.filter(tenant=tenant_row).select_related("user").order_by("slack_user_id"):
                self.stdout.write(f"{row.slack_user_id} -> {row.user.get_username()}")
            return
        if not slack_user:
            raise CommandError("--slack-user is required")
        if remove:
            self._remove(tenant_row, slack_user)
        else:
            self._set(tenant_row, slack_user, user)

    def _set(self, tenant: Tenant, slack_user: str, username: str | None) -> None:
        person = get_user_model().objects.filter(username=username).first() if username else None
        if person is None or not Membership.objects.filter(tenant=tenant, user=person).exists():
            raise CommandError(f"{username!r} is not a member of tenant {tenant.slug}")
        try:
            with ledger_transaction(tenant.pk) as audit:
                row = SlackIdentity.objects.create(tenant=tenant, user=person, slack_user_id=slack_user,
                                                   created_by=ACTOR)
                audit.record("slack.identity_set", actor=ACTOR, slack_user=slack_user, user=person.get_username(),
                             identity=row.pk)
        except IntegrityError:
            raise CommandError(f"{slack_user} or {person.get_username()} is already mapped in {tenant.slug}; "
                               "--remove it first") from None
        self.stdout.write(f"ok: Slack user {slack_user} is {person.get_username()} in {tenant.slug}")

    def _remove(self, tenant: Tenant, slack_user: str) -> None:
        with ledger_transaction(tenant.pk) as audit:
            deleted, _ = SlackIdentity.objects.filter(tenant=tenant, slack_user_id=slack_user).delete()
            if deleted:
                audit.record("slack.identity_removed", actor=ACTOR, slack_user=slack_user)
        if not deleted:
            raise CommandError(f"Slack user {slack_user} is not mapped in {tenant.slug}")
        self.stdout.write(f"ok: Slack user {slack_user} removed from {tenant.slug}")
