"""What the top navigation offers a person: only the pages they may open (a link that answers 403 is a dead end)."""
from django.utils.functional import cached_property

from recovery import selectors


class Navigation:
    """Read when a page draws its navigation (an htmx partial does not, and costs no query)."""

    def __init__(self, user):
        self.user = user

    @cached_property
    def access(self) -> selectors.Access:
        return selectors.access_for(self.user)

    @property
    def outbox(self) -> bool:
        return bool(selectors.outbox_tenant_ids(self.access))

    @property
    def erasure(self) -> bool:
        return bool(selectors.erasure_tenant_ids(self.access))

    @property
    def has_role(self) -> bool:
        return bool(self.access.roles)


def navigation(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"nav": Navigation(user)}
