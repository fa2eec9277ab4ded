"""The recovery queue: runs that need a person, and what that person decided."""
from django.db import models
from django.db.models import Q


class Reason(models.TextChoices):
    STEP_FAILED = "step_failed", "step failed after its retries"
    COMPENSATION_FAILED = "compensation_failed", "compensation failed"
    VERIFICATION_FAILED = "verification_failed", "verification failed"
    DRIFT = "drift", "target changed since (drift)"
    APPROVAL_REJECTED = "approval_rejected", "approval rejected after the pivot"
    APPROVAL_EXPIRED = "approval_expired", "approval expired after the pivot"
    LEASE_LOST = "lease_lost", "worker lost, outcome unknown"
    OUTCOME_UNKNOWN = "outcome_unknown", "tool kept failing, outcome unknown"
    CANCELLED_AFTER_PIVOT = "cancelled_after_pivot", "cancelled after the pivot"
    IRREVERSIBLE_EFFECTS = "irreversible_effects", "effects that cannot be undone"
    IDLE_AFTER_PIVOT = "idle_after_pivot", "agent went away after the pivot"
    SETTLE_FAILED = "settle_failed", "recording the outcome failed"
    READ_BACK_INCOMPLETE = "read_back_incomplete", "found done, but its record is incomplete"
    CUSTOMER_REQUEST = "customer_request", "the customer asks for a correction"
    TAMPERED = "tampered", "the ledger was edited behind Unwind's back"


class ItemStatus(models.TextChoices):
    OPEN = "open", "open"
    RESOLVED = "resolved", "resolved"


class Resolution(models.TextChoices):
    RESUMED = "resumed", "resumed"
    COMPENSATED = "compensated", "compensated"
    CLOSED = "closed", "closed"


class RecoveryItem(models.Model):
    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="recovery_items")
    run = models.ForeignKey("ledger.Run", on_delete=models.CASCADE, related_name="recovery_items")
    action = models.ForeignKey("ledger.Action", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    reason = models.CharField(max_length=32, choices=Reason.choices)
    risk = models.CharField(max_length=16, default="low")
    tool_name = models.CharField(max_length=120, blank=True)
    detail = models.TextField()
    suggestion = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=ItemStatus.choices, default=ItemStatus.OPEN)
    resolution = models.CharField(max_length=16, choices=Resolution.choices, blank=True)
    resolved_by = models.CharField(max_length=160, blank=True)
    resolution_note = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run"], condition=Q(status="open"), name="one_open_item_per_run"),
        ]
        indexes = [
            models.Index(fields=["tenant", "status", "-created_at"], name="recovery_queue"),
            models.Index(fields=["tenant", "status", "reason"], name="recovery_by_reason"),
        ]
        ordering = ["-created_at"]

    def __str__(self):
        return f"recovery item {self.pk}: run {self.run_id} {self.reason} ({self.status})"


class TrailShareLink(models.Model):
    """A link that lets someone without an account read one run's correction trail, until it expires or is revoked.

    The token is random (`secrets.token_urlsafe(32)`) and only its SHA-256 is stored: the database cannot
    give a link back, and the URL is shown once, to the operator who made it (or emailed to the person the
    run acted for). Nothing in a token names the run, so no link can be derived from a run id.
    """

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("ledger.Run", on_delete=models.CASCADE, related_name="trail_share_links")
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.CharField(max_length=160)
    sent_to = models.CharField(max_length=254, blank=True, help_text="The address the link was emailed to, if any.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.CharField(max_length=160, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["run", "-created_at"], name="trail_links_of_run")]

    def __str__(self):
        return f"trail share link {self.pk} of run {self.run_id}"


class RequestKind(models.TextChoices):
    UNDO = "undo", "undo this"
    OTHER = "other", "something else is wrong"


class CustomerRequest(models.Model):
    """A correction the person a run acted for asked for from its trail's share page (recovery/requests.py), and the
    operator's reply. Only the holder of a live share link can make one; `link` is the link it came through."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("ledger.Run", on_delete=models.CASCADE, related_name="customer_requests")
    action = models.ForeignKey("ledger.Action", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    link = models.ForeignKey(TrailShareLink, on_delete=models.CASCADE, related_name="requests")
    item = models.ForeignKey(RecoveryItem, on_delete=models.SET_NULL, null=True, blank=True, related_name="requests")
    kind = models.CharField(max_length=8, choices=RequestKind.choices)
    text = models.TextField()
    reply = models.TextField(blank=True)
    replied_by = models.CharField(max_length=160, blank=True)
    replied_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["link", "-created_at"], name="requests_of_link"),
                   models.Index(fields=["run", "-created_at"], name="requests_of_run")]
        ordering = ["-created_at", "-pk"]

    def __str__(self):
        return f"customer request {self.pk} on run {self.run_id}"


class KnownCustomerAddress(models.Model):
    """An address the tenant knows as a customer's: one mailbox (`carol@example.com`) or every mailbox at a domain
    (`@example.com`). A held step's notice goes only to a run's `on_behalf_of` that one of these covers
    (recovery/hold_notices.py), never to an address an agent made up. Written by people with the tenant's admin role
    (the Django admin, through recovery/customers.py), each change an event in the audit chain."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    address = models.CharField(max_length=254, help_text="carol@example.com (one mailbox) or @example.com (every "
                                                         "mailbox at that domain; not its subdomains). Stored in "
                                                         "lower case, ASCII only.")
    note = models.CharField(max_length=200, blank=True, help_text="Who this is, for the people who keep the list.")
    created_by = models.CharField(max_length=160)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "address"], name="known_customer_address_once")]
        ordering = ["tenant", "address"]
        verbose_name = "known customer address"
        verbose_name_plural = "known customer addresses"

    def __str__(self):
        return self.address


class HoldNotice(models.Model):
    """What became of the notice for one held step the customer may stop: sent (to whom) or not (why). The sent
    ones are what the per-agent bound counts (UNWIND_HOLD_NOTICES_PER_AGENT within UNWIND_HOLD_NOTICE_WINDOW)."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("ledger.Run", on_delete=models.CASCADE, related_name="hold_notices")
    action = models.ForeignKey("ledger.Action", on_delete=models.CASCADE, related_name="hold_notices")
    agent = models.ForeignKey("ledger.Agent", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    sent = models.BooleanField()
    sent_to = models.CharField(max_length=254, blank=True, help_text="The address it was sent to (a known one).")
    why = models.TextField(help_text="Why it was or was not sent, as the agent and the operators read it.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["agent", "sent", "created_at"], name="hold_notices_of_agent")]

    def __str__(self):
        return f"hold notice for action {self.action_id} ({'sent' if self.sent else 'not sent'})"
