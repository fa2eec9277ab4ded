"""Approval gates and the email outbox."""
from django.conf import settings
from django.db import models
from django.db.models import Q


class ApprovalStatus(models.TextChoices):
    PENDING = "pending", "pending"
    APPROVED = "approved", "approved"
    REJECTED = "rejected", "rejected"
    EXPIRED = "expired", "expired"
    WITHDRAWN = "withdrawn", "withdrawn"
    VOIDED = "voided", "voided"


class ApprovalRequest(models.Model):
    """A gate in front of one action or compensation, bound to the exact args hash it shows and to the version of
    the tool's policy it was requested under (`tool`): a new version while it waits voids it."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="approval_requests")
    run = models.ForeignKey("ledger.Run", on_delete=models.CASCADE, related_name="approval_requests")
    action = models.ForeignKey("ledger.Action", on_delete=models.CASCADE, related_name="approval_requests")
    is_compensation = models.BooleanField(default=False)
    args_hash = models.CharField(max_length=64)
    tool = models.ForeignKey("ledger.Tool", on_delete=models.PROTECT, null=True, related_name="+",
                             help_text="The tool version (policy) the request was made under.")
    preview = models.JSONField(default=dict)
    risk = models.CharField(max_length=16)
    requested_by = models.CharField(max_length=160)
    required = models.PositiveSmallIntegerField(default=1)
    status = models.CharField(max_length=16, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    outcome_reason = models.TextField(blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["action"], condition=Q(status="pending"), name="one_pending_request_per_action"),
        ]
        indexes = [
            models.Index(fields=["tenant", "status", "-created_at"], name="approval_inbox"),
            models.Index(fields=["status", "expires_at"], name="approval_expiry"),
        ]
        ordering = ["-created_at"]

    def __str__(self):
        return f"approval {self.pk} for action {self.action_id} ({self.status})"


class Decision(models.TextChoices):
    APPROVE = "approve", "approve"
    REJECT = "reject", "reject"


class ApprovalDecision(models.Model):
    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="decisions")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="approval_decisions")
    decision = models.CharField(max_length=8, choices=Decision.choices)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["request", "user"], name="one_decision_per_person")]
        ordering = ["created_at"]


class NotificationStatus(models.TextChoices):
    PENDING = "pending", "pending"
    SENDING = "sending", "sending"
    SENT = "sent", "sent"
    FAILED = "failed", "failed"


class Notification(models.Model):
    """Outbox row: written in the transaction of the change it announces, sent after commit by a worker."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=40)
    recipients = models.JSONField(default=list)
    subject = models.CharField(max_length=250)
    body_text = models.TextField()
    body_html = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=NotificationStatus.choices, default=NotificationStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="outbox_due")]
        ordering = ["-created_at"]
