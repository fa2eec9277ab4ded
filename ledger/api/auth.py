"""Who is calling: agents by API key, pipelines by deploy key, people by session or HTTP Basic.

Agents act, people govern. An agent authenticates with `Authorization: Bearer uw_…` and works inside its
own runs: it opens them, proposes, reads and waits, reports its client-executed steps, cancels and completes
them, and reads its tenant's tools (it needs their schemas). It never writes tools or policy, approves or
works the recovery queue; and inside its tenant it sees only its own runs and actions (another agent's
answers 404, like a missing one). Tools and policy are written by a person with the tenant's admin role, or
by a deploy key (`Bearer uwd_…`, for a pipeline that pushes a reviewed policy file), which is accepted on
the tool and policy endpoints only. People use the browsable API with their session, or HTTP Basic from a
script; a person with any role (viewer and up) sees the whole tenant. Another tenant's object is never
distinguished from a missing one: every lookup is filtered by the caller's tenants, so it answers 404.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.core.validators import slug_re
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions

from ledger.api.lockout import LockoutAwareBasicAuthentication
from ledger.errors import NotFound, PermissionDenied, ValidationFailed
from ledger.models import ROLE_ORDER, Agent, DeployKey, Membership, Tenant
from ledger.tenancy import DEPLOY_KEY_PREFIX, agent_authenticate, deploy_key_authenticate


class KeyPrincipal:
    """What `request.user` is for a key (an agent's or a deploy key): authenticated, not a person."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __str__(self):
        return self.get_username()


class AgentPrincipal(KeyPrincipal):
    def __init__(self, agent: Agent):
        self.agent = agent

    def get_username(self) -> str:
        return f"agent:{self.agent.name}"


class DeployPrincipal(KeyPrincipal):
    def __init__(self, deploy_key: DeployKey):
        self.deploy_key = deploy_key

    def get_username(self) -> str:
        return f"deploy:{self.deploy_key.name}"


DEPLOY_KEY_CANNOT_ACT = ("a deploy key governs tools and policy (PUT /api/v1/tools/{name}, POST /api/v1/policy) and "
                         "is accepted nowhere else: agents act with their own key, people with their session or password")


def bearer_token(request) -> str | None:
    """The token of an `Authorization: Bearer …` header, None for another scheme; a malformed one is a 401."""
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    if not token or " " in token:
        raise exceptions.AuthenticationFailed("send the key as: Authorization: Bearer uw_…")
    return token


class AgentKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        token = bearer_token(request)
        if token is None:
            return None
        if token.startswith(DEPLOY_KEY_PREFIX):
            # The tool and policy views authenticate deploy keys before this runs; anywhere else one is refused
            # outright, so a leaked pipeline credential can never open a run, propose, approve or read the ledger.
            raise exceptions.PermissionDenied(DEPLOY_KEY_CANNOT_ACT, code="deploy_key_cannot_act")
        agent = agent_authenticate(token)
        if agent is None:
            raise exceptions.AuthenticationFailed("unknown or revoked API key")
        return AgentPrincipal(agent), agent

    def authenticate_header(self, request):
        return f'{self.keyword} realm="unwind"'


class DeployKeyAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer uwd_…`: listed only by the tool and policy views (see `GOVERNANCE_AUTHENTICATION`)."""

    keyword = "Bearer"

    def authenticate(self, request):
        token = bearer_token(request)
        if token is None or not token.startswith(DEPLOY_KEY_PREFIX):
            return None  # an agent's key: AgentKeyAuthentication, next in the list, decides
        key = deploy_key_authenticate(token)
        if key is None:
            raise exceptions.AuthenticationFailed("unknown or revoked deploy key")
        return DeployPrincipal(key), key

    def authenticate_header(self, request):
        return f'{self.keyword} realm="unwind"'


class AgentKeyScheme(OpenApiAuthenticationExtension):
    target_class = "ledger.api.auth.AgentKeyAuthentication"
    name = "agentKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "uw_<prefix>_<secret>",
                "description": "An agent's API key (manage.py create_agent prints it once)."}


class DeployKeyScheme(OpenApiAuthenticationExtension):
    target_class = "ledger.api.auth.DeployKeyAuthentication"
    name = "deployKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "uwd_<prefix>_<secret>",
                "description": "A deploy key for a pipeline that pushes reviewed tools and policy (manage.py "
                               "create_deploy_key prints it once). Accepted on the tool and policy endpoints only."}


# The tool and policy endpoints: a deploy key first (it is refused by every other view), then the usual callers.
GOVERNANCE_AUTHENTICATION = [DeployKeyAuthentication, AgentKeyAuthentication, authentication.SessionAuthentication,
                             LockoutAwareBasicAuthentication]

# People's endpoints ask for HTTP Basic first, so a 401 there challenges with Basic (curl -u, browsers).
PERSON_FIRST = [LockoutAwareBasicAuthentication, authentication.SessionAuthentication, AgentKeyAuthentication]


# --- the caller and its tenants ------------------------------------------------------------------------

@dataclass(frozen=True)
class Caller:
    agent: Agent | None
    user: object | None
    deploy_key: DeployKey | None = None

    @property
    def actor(self) -> str:
        if self.agent is not None:
            return f"agent:{self.agent.name}"
        if self.deploy_key is not None:
            return f"deploy:{self.deploy_key.name}"
        return f"user:{self.user.get_username()}"

    @property
    def tenant_ids(self) -> list[int]:
        if self.agent is not None:
            return [self.agent.tenant_id]
        if self.deploy_key is not None:
            return [self.deploy_key.tenant_id]
        return list(Membership.objects.filter(user=self.user).values_list("tenant_id", flat=True))

    @property
    def agent_id(self) -> int | None:
        """Whose runs the caller may see: an agent only its own; None for people, who see their whole tenants."""
        return self.agent.pk if self.agent is not None else None


def caller_of(request) -> Caller:
    if isinstance(request.auth, Agent):
        return Caller(agent=request.auth, user=None)
    if isinstance(request.auth, DeployKey):
        return Caller(agent=None, user=None, deploy_key=request.auth)
    return Caller(agent=None, user=request.user)


def tenant_for(request, *, role: str) -> Tenant:
    """The one tenant a request acts in: the agent's or deploy key's, or the person's (`?tenant=<slug>` when
    several). A deploy key stands for its tenant's admins, so it passes any `role`."""
    caller = caller_of(request)
    if caller.agent is not None:
        return caller.agent.tenant
    if caller.deploy_key is not None:
        return caller.deploy_key.tenant
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


def is_person(request) -> bool:
    user = request.user
    return bool(user and user.is_authenticated and not isinstance(user, KeyPrincipal))


def is_member(request) -> bool:
    return is_person(request) and Membership.objects.filter(user=request.user).exists()


class IsPerson(permissions.BasePermission):
    message = "people decide here, not agents: sign in, or use HTTP Basic with your username and password"

    def has_permission(self, request, view):
        return is_person(request)


class IsAgentOrMember(permissions.BasePermission):
    message = "you are not a member of any tenant"

    def has_permission(self, request, view):
        return isinstance(request.auth, Agent) or is_member(request)


class CanReadTools(permissions.BasePermission):
    """The tool list is read by agents (they need the schemas), deploy keys and members."""

    message = "you are not a member of any tenant"

    def has_permission(self, request, view):
        return isinstance(request.auth, (Agent, DeployKey)) or is_member(request)


class AgentsCannotGovern(permissions.BasePermission):
    """An agent's key never writes tools, policy or tenant defaults: its model may be prompt-injected, its key leaked."""

    code = "agents_cannot_govern"
    message = ("agents act, people govern: an agent's key cannot change tools or policy. A person with the tenant's "
               "admin role does (session or HTTP Basic), or a pipeline with a deploy key (manage.py create_deploy_key)")

    def has_permission(self, request, view):
        return not isinstance(request.auth, Agent)


class IsMemberOrDeployKey(permissions.BasePermission):
    message = "you are not a member of any tenant"

    def has_permission(self, request, view):
        return isinstance(request.auth, DeployKey) or is_member(request)


class IsStaff(permissions.BasePermission):
    message = "metrics cover every tenant: they are for staff users"

    def has_permission(self, request, view):
        user = request.user
        return bool(user and user.is_authenticated and getattr(user, "is_staff", False))


def require_role(caller: Caller, tenant_id: int, role: str) -> None:
    """People need `role` in the tenant; an agent acts on its own runs with its key's rights (the selectors
    that found the object already kept it to them)."""
    if caller.agent is not None:
        return
    membership = Membership.objects.filter(user=caller.user, tenant_id=tenant_id).only("role").first()
    have = membership.role if membership else None
    if have is None or ROLE_ORDER[have] < ROLE_ORDER[role]:
        raise PermissionDenied(f"this needs the {role} role in the tenant; you are {have or 'not a member'}")
