"""The tenant's known customer addresses: the only addresses a held step's notice may go to (recovery/hold_notices.py).

An agent names whom a run acts for (`on_behalf_of`) and can name anyone; the tenant knows its customers. An entry is
one mailbox (`carol@example.com`) or every mailbox at one domain (`@example.com`, not its subdomains). Entries are
written only by people with the tenant's admin role (or a superuser: a deployer), in the Django admin, through
`known_customer_add` and `known_customer_remove`; each is an event in the tenant's audit chain fingerprinting the row,
so a row added or edited in the database behind these services fails `verify_audit` (check `fingerprint`).

Addresses are compared as ASCII, the domain in lower case: an address with other characters (`carol@ｅxample.com`,
a full-width e) is never a known one, and a notice goes to the list's own spelling of a mailbox.
"""
from __future__ import annotations

import re

from django.core.exceptions import ValidationError
from django.core.validators import validate_email

from approvals.services import role_of
from ledger.audit.chain import ledger_transaction
from ledger.errors import PermissionDenied, StateConflict, ValidationFailed
from ledger.models import ROLE_ORDER, Role, Tenant
from recovery.models import KnownCustomerAddress

ADDED, REMOVED = "customer_address.added", "customer_address.removed"
FINGERPRINT_FIELDS = ("address", "note", "created_by")
# RFC 5322's dot-atom: a quoted local part ("a b"@x) is never needed by a customer and only helps a disguise.
LOCAL_PART = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*$")
NOTE_LENGTH = 200


def mailbox(value) -> tuple[str, str] | None:
    """(local part, domain in lower case) of a plain ASCII address, or None for anything else."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value.isascii() or not value.isprintable():
        return None
    try:
        validate_email(value)
    except ValidationError:
        return None
    local, _, domain = value.rpartition("@")
    if not LOCAL_PART.match(local):
        return None
    return local, domain.lower()


def entry_of(value) -> str:
    """The stored form of a list entry: `carol@example.com` or `@example.com`, lower case. ValidationFailed names
    what is wrong with anything else."""
    text = value.strip().lower() if isinstance(value, str) else ""
    if text.startswith("@"):
        found = mailbox("postmaster" + text)
        if found is None:
            raise ValidationFailed(f"{value!r} is not a domain: write @example.com (ASCII; use the xn-- form of an "
                                   "international domain)", field="address")
        return "@" + found[1]
    found = mailbox(text)
    if found is None:
        raise ValidationFailed(f"{value!r} is not an email address: write carol@example.com for one mailbox or "
                               "@example.com for a whole domain (ASCII only)", field="address")
    return f"{found[0]}@{found[1]}"


def may_keep_list(user, tenant_id: int) -> bool:
    """Whether `user` may add to or remove from the tenant's list: its admins, and superusers (deployers)."""
    if not (user.is_active and user.is_authenticated):
        return False
    if user.is_superuser:
        return True
    role = role_of(user, tenant_id)
    return role is not None and ROLE_ORDER[role] >= ROLE_ORDER[Role.ADMIN]


def admin_tenant_ids(user) -> list[int]:
    """The tenants whose list `user` keeps (every tenant for a superuser)."""
    if not (user.is_active and user.is_authenticated):
        return []
    tenants = Tenant.objects.all()
    if not user.is_superuser:
        tenants = tenants.filter(memberships__user=user, memberships__role=Role.ADMIN)
    return list(tenants.values_list("pk", flat=True))


def _require(user, tenant_id: int) -> str:
    if not may_keep_list(user, tenant_id):
        raise PermissionDenied("the list of known customer addresses is kept by the tenant's admins")
    return f"user:{user.get_username()}"


def known_customer_add(*, tenant: Tenant, address: str, note: str = "", user) -> KnownCustomerAddress:
    """Add an address or domain to the tenant's list (its admins only; audited)."""
    actor = _require(user, tenant.pk)
    stored = entry_of(address)
    note = (note or "").strip()
    if len(note) > NOTE_LENGTH or not note.isprintable():
        raise ValidationFailed(f"a note is one line of at most {NOTE_LENGTH} characters", field="note")
    with ledger_transaction(tenant.pk) as audit:
        if KnownCustomerAddress.objects.filter(tenant=tenant, address=stored).exists():
            raise StateConflict(f"{stored} is already on the list")
        entry = KnownCustomerAddress.objects.create(tenant=tenant, address=stored, note=note, created_by=actor)
        audit.record(ADDED, actor=actor, entry=entry.pk, address=stored, note=note, rows=[entry])
    return entry


def known_customer_remove(*, entry: KnownCustomerAddress, user) -> None:
    """Take an address or domain off the tenant's list (its admins only; audited). Notices already sent stay sent."""
    actor = _require(user, entry.tenant_id)
    with ledger_transaction(entry.tenant_id) as audit:
        if KnownCustomerAddress.objects.filter(pk=entry.pk).delete()[0]:
            audit.record(REMOVED, actor=actor, entry=entry.pk, address=entry.address, removed=[entry])


def known_recipient(*, tenant_id: int, address: str) -> tuple[str | None, str]:
    """Where a notice for `address` may go: (the address to send to, "") when the tenant's list covers it, else
    (None, why not). A listed mailbox is written as the list spells it; under a listed domain, as the run names it."""
    found = mailbox(address)
    if found is None:
        return None, (f"the run's on_behalf_of ({address.strip()[:80]!r}) is not a plain ASCII email address"
                      if address.strip() else "the run names no email address for the person it acts for")
    local, domain = found
    entries = dict(KnownCustomerAddress.objects.filter(
        tenant_id=tenant_id, address__in=[f"{local.lower()}@{domain}", f"@{domain}"]).values_list("address", "address"))
    if f"{local.lower()}@{domain}" in entries:
        return entries[f"{local.lower()}@{domain}"], ""
    if f"@{domain}" in entries:
        return f"{local}@{domain}", ""
    return None, (f"{local}@{domain} is not among the tenant's known customer addresses (an admin adds an address or "
                  "its domain in the admin, Known customer addresses; an operator can send the trail's link from the "
                  "run's page)")
