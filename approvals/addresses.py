"""Who an address names, compared the way mail does: a requester cannot approve under another spelling of it.

`Alice <alice@EXAMPLE.com>`, `ALICE@example.com` and `alice@example.com` are one mailbox: the address is parsed
(RFC 5322, `email.utils`), its domain case-folded (domains are case-insensitive), and its local part case-folded too
unless the tenant's defaults say `local_part_case_sensitive: true` (RFC 5321 lets a server tell `Alice` from
`alice`; almost none does, and folding is the side that refuses more self-approvals). A value that is no address (a
username) is compared case-folded likewise.
"""
from __future__ import annotations

from email.utils import getaddresses

from django.core.exceptions import ValidationError
from django.core.validators import validate_email


def mailboxes(value: str, *, local_part_case_sensitive: bool = False) -> set[str]:
    """Every mailbox (or plain name) `value` names, in the form they are compared in. A list of addresses names
    each of them, so that a request for several people cannot be approved by any of them."""
    value = (value or "").strip()
    if not value:
        return set()
    found = set()
    for _, address in getaddresses([value]):
        address = address.strip()
        try:
            validate_email(address)
        except ValidationError:
            continue
        local, _, domain = address.rpartition("@")
        found.add(f"{local if local_part_case_sensitive else local.casefold()}@{domain.casefold()}")
    if not found:  # a username, or text that is no address: itself
        found.add(value if local_part_case_sensitive else value.casefold())
    return found


def names_person(value: str, *, username: str, email: str, local_part_case_sensitive: bool = False) -> bool:
    """Whether `value` (an `on_behalf_of`) names the person with this username or email address."""
    theirs = set()
    for own in (username, email):
        theirs |= mailboxes(own, local_part_case_sensitive=local_part_case_sensitive)
    return bool(mailboxes(value, local_part_case_sensitive=local_part_case_sensitive) & theirs)
