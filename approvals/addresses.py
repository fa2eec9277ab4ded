"""Who an address names, compared the way mail delivers: a requester cannot approve under another spelling of it.

Every spelling that reaches one mailbox is one person (issue 31, finding 4; issue 39, finding 9):
- the text is NFKC-normalised first, so full-width or other compatibility forms (`ａｌｉｃｅ@ｅxample.com`) are the
  letters they stand for;
- the address is parsed (RFC 5322, `email.utils`: `Alice <alice@example.com>`, a list of several, comments, a quoted
  local part);
- the domain loses its trailing dot (`example.com.` is the fully qualified `example.com`) and goes through IDNA
  (UTS #46, the `idna` package): case-folded, mapped and in its ASCII form, so `EXAMPLE.com`, `ｅxample.com`,
  `bücher.example` and `xn--bcher-kva.example` compare as their DNS names do;
- a sub-address is dropped from the local part (`alice+tag@…` is delivered to `alice@…`, RFC 5233) at the first of
  the tenant's `subaddress_separators` ("+" by default; "" keeps the whole local part);
- the local part is case-folded unless the tenant's defaults say `local_part_case_sensitive: true` (RFC 5321 lets a
  server tell `Alice` from `alice`; almost none does, and folding is the side that refuses more self-approvals).
A value that is no address (a username) is itself, NFKC-normalised and case-folded likewise.

Not folded: dots in a local part (Gmail ignores them, RFC 5321 does not) and provider aliases; an approver who is
also the person acted for under such an alias is not recognised.
"""
from __future__ import annotations

import unicodedata
from email.utils import getaddresses

import idna
from django.core.exceptions import ValidationError
from django.core.validators import validate_email

from ledger.models import SUBADDRESS_SEPARATORS_DEFAULT

# Label separators IDNA treats as full stops (UTS #46); NFKC maps only the full-width one.
DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})


def _fold(text: str) -> str:
    return unicodedata.normalize("NFKC", text.casefold())


def _domain(domain: str) -> str | None:
    """A domain in the form mail routes it by: no trailing dot, IDNA (UTS #46) in ASCII; None when it is none."""
    domain = domain.translate(DOTS).strip().rstrip(".")
    if not domain:
        return None
    if domain.startswith("[") and domain.endswith("]"):  # an address literal, [192.0.2.1]
        return domain.casefold()
    try:
        return idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError:  # not a name IDNA takes (an underscore, say): compared case-folded
        return _fold(domain)


def mailbox(address: str, *, local_part_case_sensitive: bool = False,
            subaddress_separators: str = SUBADDRESS_SEPARATORS_DEFAULT) -> str | None:
    """The mailbox one bare address (`local@domain`) reaches, as compared; None if it is none."""
    local, at, domain = unicodedata.normalize("NFKC", address).strip().rpartition("@")
    if not at or not local:
        return None
    domain = _domain(domain)
    if domain is None:
        return None
    if len(local) > 1 and local[0] == local[-1] == '"':
        local = local[1:-1]
    for index, character in enumerate(local):
        if index and character in subaddress_separators:
            local = local[:index]
            break
    try:
        validate_email(f"{local}@{domain}")
    except ValidationError:
        return None
    return f"{local if local_part_case_sensitive else _fold(local)}@{domain}"


def mailboxes(value: str, *, local_part_case_sensitive: bool = False,
              subaddress_separators: str = SUBADDRESS_SEPARATORS_DEFAULT) -> set[str]:
    """Every mailbox (or plain name) `value` names, in the form they are compared in. A list of addresses names
    each of them, so that a request for several people cannot be approved by any of them."""
    value = unicodedata.normalize("NFKC", value or "").strip()
    if not value:
        return set()
    found = set()
    for _, address in getaddresses([value]):
        box = mailbox(address, local_part_case_sensitive=local_part_case_sensitive,
                      subaddress_separators=subaddress_separators)
        if box is not None:
            found.add(box)
    if not found:  # a username, or text that is no address: itself
        found.add(value if local_part_case_sensitive else _fold(value))
    return found


def names_person(value: str, *, username: str, email: str, local_part_case_sensitive: bool = False,
                 subaddress_separators: str = SUBADDRESS_SEPARATORS_DEFAULT) -> bool:
    """Whether `value` (an `on_behalf_of`) names the person with this username or email address, compared on both
    sides alike (an approver whose own address has a sub-address is that mailbox too)."""
    rules = {"local_part_case_sensitive": local_part_case_sensitive, "subaddress_separators": subaddress_separators}
    theirs = set()
    for own in (username, email):
        theirs |= mailboxes(own, **rules)
    return bool(mailboxes(value, **rules) & theirs)
