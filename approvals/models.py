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
    # Not sent on purpose: the request it asks someone to decide no longer waited when it was due to leave.
    WITHHELD = "withheld", "withheld"


class Notification(models.Model):
    """Outbox row: written in the transaction of the change it announces, sent after commit by a worker."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=40)
    request = models.ForeignKey(
        ApprovalRequest, on_delete=models.CASCADE, null=True, blank=True, related_name="notifications",
        help_text="The approval request this message asks someone to decide (an approval email, a digest entry): "
                  "it is checked as the message leaves, and withheld once the request no longer waits.")
    recipients = models.JSONField(default=list)
    subject = models.CharField(max_length=250)
    body_text = models.TextField()
    body_html = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=NotificationStatus.choices, default=NotificationStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, help_text="Why the last try failed, or why the message was withheld.")
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="outbox_due")]
        ordering = ["-created_at"]


class ApprovalLink(models.Model):
    """One approver's approve and reject links for one request, sent in that person's email.

    A link decides once, for that person only, on exactly the args hash and policy version it was made for,
    before it expires; using either of the pair uses both. Its tokens are HMACs of `nonce` keyed with the
    server's SECRET_KEY (approvals/link_service.py) and only their SHA-256 is stored: neither the database nor
    the outbox row (which holds a placeholder, filled in when the mail leaves) can give a working link back.
    """

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="links")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="approval_links")
    notification = models.ForeignKey(Notification, on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
                                     help_text="The email that carries this link; only it may fill the link in.")
    nonce = models.CharField(max_length=64)
    approve_hash = models.CharField(max_length=64, unique=True)
    reject_hash = models.CharField(max_length=64, unique=True)
    args_hash = models.CharField(max_length=64)
    tool = models.ForeignKey("ledger.Tool", on_delete=models.PROTECT, null=True, related_name="+",
                             help_text="The tool version (policy) the link was made under.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_for = models.CharField(max_length=8, blank=True, choices=Decision.choices)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["request", "user"], name="one_link_pair_per_approver")]

    def __str__(self):
        return f"approval link {self.pk} of request {self.request_id} for user {self.user_id}"


class SlackIdentity(models.Model):
    """Who a Slack user is in Unwind, for deciding from a Slack message. Set by an admin
    (`manage.py slack_identity`), never from a Slack payload: Slack only says which Slack user clicked."""

    tenant = models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="slack_identities")
    slack_user_id = models.CharField(max_length=32)
    created_by = models.CharField(max_length=160)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "Slack identity"
        verbose_name_plural = "Slack identities"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "slack_user_id"], name="one_person_per_slack_user"),
            models.UniqueConstraint(fields=["tenant", "user"], name="one_slack_user_per_person"),
        ]

    def __str__(self):
        return f"slack {self.slack_user_id} is user {self.user_id} in tenant {self.tenant_id}"


class SlackMessage(models.Model):
    """The Slack message that announced a request: where to post it (until posted) and where to update it."""

    request = models.OneToOneField(ApprovalRequest, on_delete=models.CASCADE, related_name="slack_message")
    channel = models.CharField(max_length=64)
    ts = models.CharField(max_length=32, blank=True)
    posted_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    class Meta:
        indexes = [models.Index(fields=["posted_at", "next_attempt_at"], name="slack_outbox_due")]
