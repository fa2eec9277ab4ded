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

import logging
import threading
import time
from array import array
from bisect import bisect_right, insort
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.validators import slug_re
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from redis.exceptions import RedisError
from rest_framework import authentication, exceptions, permissions, throttling

from ledger.api.lockout import LockoutAwareBasicAuthentication
from ledger.errors import NotFound, PermissionDenied, ValidationFailed
from ledger.models import ROLE_ORDER, Agent, DeployKey, Membership, Tenant
from ledger.tenancy import DEPLOY_KEY_PREFIX, agent_authenticate, deploy_key_authenticate

log = logging.getLogger("unwind.api")


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


# --- throttling ------------------------------------------------------------------------------------------

class CacheOutage:
    """When this process last found the throttle's cache (Redis) not answering, so that it stops asking for a while.

    Only this process's view of its own connection: whether a key is over its rate is never decided from it. While
    it is set, each request skips the cache instead of waiting on a connect that fails (up to the cache's socket
    timeouts, config/settings.py); the first request after `RETRY_AFTER` seconds asks again."""

    RETRY_AFTER = 2.0

    def __init__(self):
        self._lock = threading.Lock()
        self._since: float | None = None
        self._checked = 0.0

    def skipping(self) -> bool:
        with self._lock:
            if self._since is None or time.monotonic() - self._checked >= self.RETRY_AFTER:
                return False
            return True

    def began(self, exc: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            first, self._checked = self._since is None, now
            if first:
                self._since = now
        if first:
            log.warning("the throttle's cache does not answer (%s): agent keys are not throttled until it does; "
                        "/healthz says degraded", exc)

    def ended(self) -> None:
        if self._since is None:  # the usual case, read without the lock: a stale answer only delays the log line
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("the throttle's cache answers again after %.1f s: agent keys are throttled again",
                        time.monotonic() - since)


cache_outage = CacheOutage()


class AgentKeyThrottle(throttling.SimpleRateThrottle):
    """Requests per agent key, at UNWIND_THROTTLE_RATE (e.g. 6000/min). People are not throttled here.

    It fails open: while its cache (Redis, shared by the web processes) does not answer, every request is let
    through unthrottled, and `/healthz` says degraded (the same Redis is the broker). The throttle only shares the
    server fairly: what an agent may do (policy, approvals, the ordering law, a tool's budgets and rate limits) is
    decided from PostgreSQL and holds without it, while refusing every request would leave agents' runs half done
    (issue 39, finding 4: 693 requests answered 500 in a 10 s outage and 7 runs were abandoned with steps done)."""

    scope = "agent"

    def allow_request(self, request, view) -> bool:
        if cache_outage.skipping():
            return True
        try:
            allowed = self._allow(request, view)
        except RedisError as exc:
            cache_outage.began(exc)
            return True
        cache_outage.ended()
        return allowed

    def _allow(self, request, view) -> bool:
        """DRF's sliding log (at most `num_requests` in any `duration` seconds), its history kept as packed doubles,
        oldest first, instead of a pickled list of floats newest first. DRF's list is read and written whole on
        every request: at the bench's 16 agents (1,500 requests a key a minute) that cost 40 µs a request, at 6,000
        (the default rate, reached) 155 µs, and the same bytes travel to Redis and back. Packed, it is a copy of
        bytes each way. The decision is DRF's, request for request; a history in DRF's form (written before this
        change) is read as it stands."""
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        stored = self.cache.get(self.key)
        self.now = self.timer()
        history = array("d")
        if isinstance(stored, bytes):
            history.frombytes(stored)
        elif isinstance(stored, list):
            history.extend(reversed(stored))
        # Keep what is younger than the window, as DRF drops an entry `<= now - duration`.
        history = history[bisect_right(history, self.now - self.duration):]
        self.history = history
        if len(history) >= self.num_requests:
            return self.throttle_failure()
        insort(history, self.now)  # in order even if another process's clock is a little behind
        self.cache.set(self.key, history.tobytes(), self.duration)
        return True

    def wait(self) -> float | None:
        """DRF's `wait`, reading the oldest request at the front of the packed history."""
        history = getattr(self, "history", None)
        remaining = self.duration - (self.now - history[0]) if history else self.duration
        available = self.num_requests - len(history or ()) + 1
        return None if available <= 0 else remaining / float(available)

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
    """People need `role` in the tenant; an agent acts on its own runs with its key's rights (the selectors
    that found the object already kept it to them)."""
    if caller.agent is not None:
        return
    membership = Membership.objects.filter(user=caller.user, tenant_id=tenant_id).only("role").first()
    have = membership.role if membership else None
    if have is None or ROLE_ORDER[have] < ROLE_ORDER[role]:
        raise PermissionDenied(f"this needs the {role} role in the tenant; you are {have or 'not a member'}")
