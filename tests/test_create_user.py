"""`manage.py create_user USER --tenant T --role R` (issue 14, finding 4.5): a person with a role, from the shell."""
import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from ledger.models import AuditEvent, Membership

User = get_user_model()


def create_user(*args, stdin: str | None = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    extra = {"stdin": io.StringIO(stdin)} if stdin is not None else {}
    call_command("create_user", *args, stdout=out, stderr=err, **extra)
    return out.getvalue(), err.getvalue()


def test_it_creates_a_person_with_a_generated_password_shown_once(world):
    out, err = create_user("priya", "--tenant", "acme", "--role", "approver", "--email", "priya@example.com")
    password = out.strip()
    assert len(password) >= 20 and "\n" not in password and password not in err
    priya = User.objects.get(username="priya")
    assert priya.email == "priya@example.com" and priya.check_password(password)
    assert Membership.objects.get(user=priya).role == "approver" and priya.memberships.get().tenant == world.acme
    event = AuditEvent.objects.filter(tenant=world.acme, kind="membership.set").latest("seq")
    assert event.actor == "system:create_user" and event.data["user"] == "priya" and event.data["role"] == "approver"
    assert password not in str(event.data)


def test_it_reads_the_password_from_stdin_and_prints_nothing_secret(world):
    out, _ = create_user("omar", "--tenant", "acme", "--role", "operator", "--password-stdin",
                         stdin="correct horse battery staple\n")
    assert out == ""
    assert User.objects.get(username="omar").check_password("correct horse battery staple")


@pytest.mark.parametrize("password, says", [
    ("short1", "too short"), ("password123456", "too common"), ("48213957261849", "entirely numeric"),
    ("nadia-example-com", "too similar"),
])
def test_the_password_validators_apply_and_nothing_is_created(world, password, says):
    with pytest.raises(CommandError, match=says):
        create_user("nadia", "--tenant", "acme", "--role", "viewer", "--email", "nadia@example.com",
                    "--password-stdin", stdin=password + "\n")
    assert not User.objects.filter(username="nadia").exists()


def test_an_empty_stdin_password_is_refused(world):
    with pytest.raises(CommandError, match="empty password"):
        create_user("nadia", "--tenant", "acme", "--role", "viewer", "--password-stdin", stdin="")
    assert not User.objects.filter(username="nadia").exists()


def test_unknown_tenant_role_and_bad_email_are_clear_errors(world):
    with pytest.raises(CommandError, match="tenant 'nowhere' does not exist"):
        create_user("nadia", "--tenant", "nowhere", "--role", "viewer")
    with pytest.raises(CommandError, match="role 'owner' is not a role; use one of viewer, approver, operator, admin"):
        create_user("nadia", "--tenant", "acme", "--role", "owner")
    with pytest.raises(CommandError, match="email: Enter a valid email address"):
        create_user("nadia", "--tenant", "acme", "--role", "viewer", "--email", "not-an-email")
    assert not User.objects.filter(username="nadia").exists()


def test_an_existing_user_is_refused_and_keeps_their_password(world):
    with pytest.raises(CommandError, match="user 'alice' already exists; give them a role in globex with --add-role"):
        create_user("alice", "--tenant", "globex", "--role", "admin")
    alice = User.objects.get(username="alice")
    assert alice.check_password("pw-alice")
    assert list(alice.memberships.values_list("tenant__slug", "role")) == [("acme", "approver")]


def test_add_role_gives_an_existing_person_a_role_in_another_tenant(world):
    out, err = create_user("alice", "--tenant", "globex", "--role", "viewer", "--add-role")
    assert out == "" and "alice is now viewer in globex" in err
    alice = User.objects.get(username="alice")
    assert alice.check_password("pw-alice")
    assert sorted(alice.memberships.values_list("tenant__slug", "role")) == [("acme", "approver"), ("globex", "viewer")]


def test_add_role_needs_an_existing_person_and_changes_only_the_role(world):
    with pytest.raises(CommandError, match="user 'ghost' does not exist"):
        create_user("ghost", "--tenant", "acme", "--role", "viewer", "--add-role")
    with pytest.raises(CommandError, match="takes no --password-stdin or --email"):
        create_user("alice", "--tenant", "acme", "--role", "admin", "--add-role", "--password-stdin", stdin="x\n")
    assert Membership.objects.get(user__username="alice").role == "approver"
