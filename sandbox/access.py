"""Who may touch the sandbox, and in which tenant's world.

The sandbox is opt-in (`UNWIND_SANDBOX`); when it is off every sandbox URL answers 404 and the
in-process tools refuse. When it is on, each request acts in exactly one tenant's world:

- a **tool call** (POST of a tool) is Unwind calling on a tenant's behalf: it must carry Unwind's
  signature (`ledger.executors.signing`), which names the tenant. Unsigned, forged or stale → 401, nothing recorded.
- a **record reader** (GET of one record, or of the message and ticket listings) is read by Unwind
  (signed, for snapshots and lookups) or by a person who is a member of the tenant.
- the **world's controls** (state, call log, faults, reset) are for people only: a logged-in user
  (session or HTTP Basic) who is a member of the tenant, `?tenant=<slug>` when they belong to several.
  Reading needs the viewer role; changing (faults, reset) needs the operator role, since it decides
  what every agent of the tenant will see fail. Anonymous → 401; a tenant the user is not a member of
  → 404, as if it did not exist.
"""
from __future__ import annotations

import base64
import binascii

from django.conf import settings
from django.contrib.auth import authenticate
from django.core.validators import slug_re
from django.http import HttpRequest
from django.middleware.csrf import CsrfViewMiddleware

from ledger.executors import signing
from ledger.models import ROLE_ORDER, Membership, Role, Tenant
from sandbox.errors import Forbidden, InvalidArgument, NotAuthenticated, NotFound, SandboxError

BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="unwind sandbox"'}


class SandboxOff(NotFound):
    def __init__(self):
        super().__init__("there is no sandbox here: it is off (UNWIND_SANDBOX)")


def require_sandbox_on() -> None:
    if not settings.UNWIND_SANDBOX:
        raise SandboxOff()


def signed_tenant(request: HttpRequest) -> Tenant | None:
    """The tenant Unwind signed this request for, or None when it is unsigned, forged, stale or for no tenant."""
    slug = signing.verify(headers=request.headers, method=request.method, path=request.get_full_path(),
                          body=request.body)
    return Tenant.objects.filter(slug=slug).first() if slug else None


def tool_caller_tenant(request: HttpRequest) -> Tenant:
    tenant = signed_tenant(request)
    if tenant is None:
        raise NotAuthenticated("sandbox tools are called by Unwind: the request must carry a valid Unwind-Signature "
                               "for its tenant (see ledger/executors/signing.py)")
    return tenant


def person_tenant(request: HttpRequest, *, role: str) -> Tenant:
    """The tenant a logged-in person acts in, with at least `role` there."""
    user = _person(request)
    memberships = Membership.objects.filter(user=user).select_related("tenant")
    slug = request.GET.get("tenant")
    if slug:
        if not slug_re.fullmatch(slug):
            raise InvalidArgument("tenant must be a tenant's slug (letters, digits, - and _)")
        membership = memberships.filter(tenant__slug=slug).first()
        if membership is None:
            raise NotFound(f"you are not a member of a tenant {slug!r}")
    else:
        found = list(memberships[:2])
        if len(found) != 1:
            raise (InvalidArgument("you belong to several tenants; say which one with ?tenant=<slug>") if found
                   else NotFound("you are not a member of any tenant"))
        membership = found[0]
    if ROLE_ORDER[membership.role] < ROLE_ORDER[role]:
        raise Forbidden(f"this needs the {role} role in {membership.tenant.slug}; you are {membership.role}")
    return membership.tenant


def reader_tenant(request: HttpRequest) -> Tenant:
    """Record readers: Unwind's signed read for a tenant, or a person who can view that tenant."""
    return signed_tenant(request) or person_tenant(request, role=Role.VIEWER)


def _person(request: HttpRequest):
    """The user behind the session or HTTP Basic credentials; a session's unsafe request must pass CSRF."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "basic":
        try:
            username, sep, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            username, sep, password = "", "", ""
        user = authenticate(request, username=username, password=password) if sep else None
        if user is None or not user.is_active:
            raise NotAuthenticated("wrong username or password", headers=BASIC_CHALLENGE)
        return user
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise NotAuthenticated("log in, or send HTTP Basic credentials of a member of the tenant",
                               headers=BASIC_CHALLENGE)
    # A logged-in browser sends its session cookie with any site's form: unsafe requests need the CSRF token.
    if request.method not in ("GET", "HEAD", "OPTIONS", "TRACE"):
        refusal = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
        if refusal is not None:
            raise SandboxError("the CSRF token is missing or wrong", status=403, code="csrf_failed")
    return user
