"""Who is calling: agents by API key, people by session or HTTP Basic, each scoped to their tenants.

Agents authenticate with `Authorization: Bearer uw_…` (hashed at rest, found by prefix). People use
the browsable API with their session, or HTTP Basic from a script. Agents request, people decide:
approval and recovery endpoints refuse agent keys (`IsPerson`), and the agent's own workflow
endpoints refuse people (`IsAgent`). Another tenant's object is never distinguished from a missing
one: every lookup is filtered by the caller's tenants, so it answers 404.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.validators import slug_re
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions, throttling

from ledger.api.lockout import LockoutAwareBasicAuthentication
from ledger.errors import NotFound, PermissionDenied, ValidationFailed
from ledger.models import ROLE_ORDER, Agent, Membership, Tenant
from ledger.services.tenancy import agent_authenticate


class AgentPrincipal:
    """What `request.user` is for an agent: authenticated, not a person."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, agent: Agent):
        self.agent = agent

    def get_username(self) -> str:
        return f"agent:{self.agent.name}"

    def __str__(self):
        return self.get_username()


class AgentKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        token = token.strip()
        if not token or " " in token:
            raise exceptions.AuthenticationFailed("send the key as: Authorization: Bearer uw_…")
        agent = agent_authenticate(token)
        if agent is None:
            raise exceptions.AuthenticationFailed("unknown or revoked API key")
        return AgentPrincipal(agent), agent

    def authenticate_header(self, request):
        return f'{self.keyword} realm="unwind"'


class AgentKeyScheme(OpenApiAuthenticationExtension):
    target_class = "ledger.api.auth.AgentKeyAuthentication"
    name = "agentKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "uw_<prefix>_<secret>",
                "description": "An agent's API key (manage.py create_agent prints it once)."}


# People's endpoints ask for HTTP Basic first, so a 401 there challenges with Basic (curl -u, browsers).
PERSON_FIRST = [LockoutAwareBasicAuthentication, authentication.SessionAuthentication, AgentKeyAuthentication]


# --- the caller and its tenants ------------------------------------------------------------------------

@dataclass(frozen=True)
class Caller:
    agent: Agent | None
    user: object | None

    @property
    def actor(self) -> str:
        return f"agent:{self.agent.name}" if self.agent else f"user:{self.user.get_username()}"

    @property
    def tenant_ids(self) -> list[int]:
        if self.agent is not None:
            return [self.agent.tenant_id]
        return list(Membership.objects.filter(user=self.user).values_list("tenant_id", flat=True))


def caller_of(request) -> Caller:
    if isinstance(request.auth, Agent):
        return Caller(agent=request.auth, user=None)
    return Caller(agent=None, user=request.user)


def tenant_for(request, *, role: str) -> Tenant:
    """The one tenant a request acts in: the agent's, or the person's (`?tenant=<slug>` when several)."""
    caller = caller_of(request)
    if caller.agent is not None:
        return caller.agent.tenant
    memberships = Membership.objects.filter(user=caller.user).select_related("tenant")
    slug = request.query_params.get("tenant")
    if slug:
        if not slug_re.fullmatch(slug):
            raise ValidationFailed("tenant must be a tenant's slug (letters, digits, - and _)", field="tenant")
        membership = memberships.filter(tenant__slug=slug).first()
        if membership is None:
            raise NotFound(f"you are not a member of a tenant {slug!r}", field="tenant")
    else:
        found = list(memberships[:2])
        if len(found) != 1:
            raise ValidationFailed("you belong to several tenants; say which one with ?tenant=<slug>"
                                   if found else "you are not a member of any tenant", field="tenant")
        membership = found[0]
    if ROLE_ORDER[membership.role] < ROLE_ORDER[role]:
        raise PermissionDenied(f"this needs the {role} role in {membership.tenant.slug}; you are {membership.role}")
    return membership.tenant


# --- permissions -----------------------------------------------------------------------------------------

class IsAgent(permissions.BasePermission):
    message = "this is an agent's endpoint: authenticate with Authorization: Bearer <API key>"

    def has_permission(self, request, view):
        return isinstance(request.auth, Agent)


class IsPerson(permissions.BasePermission):
    message = "people decide here, not agents: sign in, or use HTTP Basic with your username and password"

    def has_permission(self, request, view):
        user = request.user
        return bool(user and user.is_authenticated and not isinstance(user, AgentPrincipal))


class IsAgentOrMember(permissions.BasePermission):
    message = "you are not a member of any tenant"

    def has_permission(self, request, view):
        if isinstance(request.auth, Agent):
            return True
        user = request.user
        return bool(user and user.is_authenticated and Membership.objects.filter(user=user).exists())


class IsStaff(permissions.BasePermission):
    message = "metrics cover every tenant: they are for staff users"

    def has_permission(self, request, view):
        user = request.user
        return bool(user and user.is_authenticated and getattr(user, "is_staff", False))


# --- throttling ------------------------------------------------------------------------------------------

class AgentKeyThrottle(throttling.SimpleRateThrottle):
    """Requests per agent key, at UNWIND_THROTTLE_RATE (e.g. 6000/min). People are not throttled here."""

    scope = "agent"

    def get_rate(self) -> str:
        rate = settings.UNWIND_THROTTLE_RATE
        number, _, period = rate.partition("/")
        if not number.strip().isdigit() or period.strip()[:1] not in ("s", "m", "h", "d"):
            raise ImproperlyConfigured(f"UNWIND_THROTTLE_RATE must look like 6000/min or 20/s, not {rate!r}.")
        return f"{int(number)}/{period.strip()}"

    def get_cache_key(self, request, view):
        if not isinstance(request.auth, Agent):
            return None
        return self.cache_format % {"scope": self.scope, "ident": request.auth.key_prefix}


def require_role(caller: Caller, tenant_id: int, role: str) -> None:
    """People need `role` in the tenant; an agent acts in its own tenant with its key's rights."""
    if caller.agent is not None:
        return
    membership = Membership.objects.filter(user=caller.user, tenant_id=tenant_id).only("role").first()
    have = membership.role if membership else None
    if have is None or ROLE_ORDER[have] < ROLE_ORDER[role]:
        raise PermissionDenied(f"this needs the {role} role in the tenant; you are {have or 'not a member'}")
