"""Tenants, agents (API keys), deploy keys, people and their memberships.

Two kinds of key, told apart by their prefix and never interchangeable: an agent's key (`uw_…`) acts (runs,
proposals, reports); a deploy key (`uwd_…`) governs (tools and policy) for a pipeline that pushes a reviewed
policy file. Both are stored as a SHA-256 hash and found by a short visible prefix.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from django.contrib.auth import get_user_model, password_validation
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from django.utils import timezone

from ledger.db import sql
from ledger.audit.chain import ledger_transaction
from ledger.errors import StateConflict, ValidationFailed
from ledger.models import Agent, AuditHead, DeployKey, Membership, Role, Tenant
from ledger.policy.versions import defaults_record_initial

KEY_PREFIX = "uw_"
DEPLOY_KEY_PREFIX = "uwd_"


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def tenant_create(*, slug: str, name: str = "", actor: str = "system:admin") -> Tenant:
    with transaction.atomic():
        tenant = Tenant(slug=slug, name=name or slug)
        try:
            tenant.full_clean()
        except Exception as exc:  # ValidationError from the model: report which field
            raise ValidationFailed(f"tenant: {exc}") from None
        tenant.save()
        AuditHead.objects.create(tenant=tenant)
        with ledger_transaction(tenant.pk) as audit:
            audit.record("tenant.created", actor=actor, slug=slug)
            defaults_record_initial(tenant=tenant, actor=actor, audit=audit)
    return tenant


def agent_create(*, tenant: Tenant, name: str, actor: str = "system:admin") -> tuple[Agent, str]:
    """Create an agent and return it with its API key. The key is shown this once; only its hash is kept."""
    if not name or len(name) > 100:
        raise ValidationFailed("an agent needs a name of 1 to 100 characters", field="name")
    if Agent.objects.filter(tenant=tenant, name=name).exists():
        raise StateConflict(f"tenant {tenant.slug} already has an agent named {name!r}")
    prefix = secrets.token_hex(6)
    raw = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    with ledger_transaction(tenant.pk) as audit:
        agent = Agent.objects.create(tenant=tenant, name=name, key_prefix=prefix, key_hash=hash_key(raw))
        audit.record("agent.created", actor=actor, agent=agent.pk, name=name, key_prefix=prefix)
    return agent, raw


def agent_person_set(*, agent: Agent, person, actor: str) -> Agent:
    """Map the agent's MCP client to the person who uses it (None: to nobody). The person must be a member of the
    agent's tenant; what it grants is only that an approval they may decide is offered to them in the client, as a
    link to the approval page where they still decide as themselves (mcp_gateway/tasks.py)."""
    if person is not None and not Membership.objects.filter(tenant_id=agent.tenant_id, user=person).exists():
        raise ValidationFailed(f"{person.get_username()} is not a member of {agent.tenant.slug}", field="person")
    with ledger_transaction(agent.tenant_id) as audit:
        Agent.objects.filter(pk=agent.pk).update(person=person)
        audit.record("agent.person_set", actor=actor, agent=agent.pk,
                     person=person.get_username() if person is not None else "")
    agent.refresh_from_db()
    return agent


def agent_revoke(*, agent: Agent, actor: str) -> Agent:
    with ledger_transaction(agent.tenant_id) as audit:
        Agent.objects.filter(pk=agent.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        audit.record("agent.revoked", actor=actor, agent=agent.pk)
    agent.refresh_from_db()
    return agent


def agent_authenticate(raw: str) -> Agent | None:
    """Find the agent for a raw key by its prefix and compare hashes in constant time."""
    if not raw.startswith(KEY_PREFIX) or raw.count("_") < 2:
        return None
    prefix = raw[len(KEY_PREFIX):].split("_", 1)[0]
    agent = sql.get(Agent, key_prefix=prefix)  # every API call starts here: one written-once statement
    if agent is None or agent.revoked_at is not None or not hmac.compare_digest(agent.key_hash, hash_key(raw)):
        return None
    return agent


def deploy_key_create(*, tenant: Tenant, name: str, actor: str = "system:admin") -> tuple[DeployKey, str]:
    """Create a deploy key and return it with its secret token, shown this once; only its hash is kept."""
    if not name or len(name) > 100:
        raise ValidationFailed("a deploy key needs a name of 1 to 100 characters", field="name")
    if DeployKey.objects.filter(tenant=tenant, name=name).exists():
        raise StateConflict(f"tenant {tenant.slug} already has a deploy key named {name!r}")
    prefix = secrets.token_hex(6)
    raw = f"{DEPLOY_KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    with ledger_transaction(tenant.pk) as audit:
        key = DeployKey.objects.create(tenant=tenant, name=name, key_prefix=prefix, key_hash=hash_key(raw))
        audit.record("deploy_key.created", actor=actor, deploy_key=key.pk, name=name, key_prefix=prefix)
    return key, raw


def deploy_key_revoke(*, key: DeployKey, actor: str) -> DeployKey:
    with ledger_transaction(key.tenant_id) as audit:
        if DeployKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()) == 1:
            audit.record("deploy_key.revoked", actor=actor, deploy_key=key.pk, name=key.name)
    key.refresh_from_db()
    return key


def deploy_key_authenticate(raw: str) -> DeployKey | None:
    """Find the live deploy key for a raw token by its prefix and compare hashes in constant time."""
    if not raw.startswith(DEPLOY_KEY_PREFIX) or raw.count("_") < 2:
        return None
    prefix = raw[len(DEPLOY_KEY_PREFIX):].split("_", 1)[0]
    key = DeployKey.objects.filter(key_prefix=prefix).select_related("tenant").first()
    if key is None or key.revoked_at is not None or not hmac.compare_digest(key.key_hash, hash_key(raw)):
        return None
    return key


def membership_set(*, tenant: Tenant, user: AbstractBaseUser, role: str, actor: str = "system:admin") -> Membership:
    if role not in Role.values:
        raise ValidationFailed(f"role must be one of {', '.join(Role.values)}", field="role")
    with ledger_transaction(tenant.pk) as audit:
        membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
        audit.record("membership.set", actor=actor, user=user.get_username(), role=role, rows=[membership])
    return membership


def membership_remove(*, membership: Membership, actor: str) -> None:
    """Take a person's role in a tenant away, in the tenant's audit chain."""
    with ledger_transaction(membership.tenant_id) as audit:
        Membership.objects.filter(pk=membership.pk).delete()
        audit.record("membership.removed", actor=actor, user=membership.user.get_username(), role=membership.role,
                     removed=[membership])


def user_create(*, username: str, email: str, password: str, tenant: Tenant, role: str,
                actor: str = "system:admin") -> AbstractBaseUser:
    """Create a person with a role in `tenant`, in one transaction: no user is left without the role asked for.

    The password must pass the deployment's validators (AUTH_PASSWORD_VALIDATORS), judged against this user.
    """
    User = get_user_model()
    if role not in Role.values:
        raise ValidationFailed(f"role must be one of {', '.join(Role.values)}, not {role!r}", field="role")
    if User.objects.filter(**{User.USERNAME_FIELD: username}).exists():
        raise StateConflict(f"user {username!r} already exists")
    user = User(**{User.USERNAME_FIELD: username}, email=email)
    try:
        user.full_clean(exclude=["password"])
    except DjangoValidationError as exc:
        field = sorted(exc.message_dict)[0]
        raise ValidationFailed(f"{field}: {' '.join(exc.message_dict[field])}", field=field) from None
    try:
        password_validation.validate_password(password, user=user)
    except DjangoValidationError as exc:
        raise ValidationFailed(f"password: {' '.join(exc.messages)}", field="password") from None
    user.set_password(password)
    with transaction.atomic():
        user.save()
        membership_set(tenant=tenant, user=user, role=role, actor=actor)
    return user
