"""Admin for the gate and the outbox: for reading. State changes go through the services only
(decisions through the approver pages, sends through the worker), so nothing here edits or deletes."""
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from approvals.models import ApprovalDecision, ApprovalLink, ApprovalRequest, Notification, SlackIdentity, SlackMessage
from ledger.admin import ReadOnlyAdmin as LedgerReadOnlyAdmin


class ReadOnlyAdmin(LedgerReadOnlyAdmin):
    note = ""  # approval requests change only through decisions, made on their pages


class DecisionInline(admin.TabularInline):
    model = ApprovalDecision
    fields = ("user", "decision", "reason", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "tool", "risk", "status", "required", "is_compensation", "requested_by",
                    "created_at", "expires_at", "decided_at")
    list_filter = ("status", "risk", "is_compensation", "tenant")
    search_fields = ("requested_by", "action__tool__name", "outcome_reason")
    list_select_related = ("tenant", "action__tool")
    date_hierarchy = "created_at"
    readonly_fields = ("tenant", "run", "action", "is_compensation", "args_hash", "preview", "risk", "requested_by",
                       "required", "status", "expires_at", "created_at", "decided_at", "outcome_reason", "page")
    inlines = [DecisionInline]

    @admin.display(description="tool", ordering="action__tool__name")
    def tool(self, obj):
        return obj.action.tool.name

    @admin.display(description="approver page")
    def page(self, obj):
        url = reverse("approvals:detail", args=[obj.pk])
        return format_html('<a href="{}">{}</a>', url, url)


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ReadOnlyAdmin):
    list_display = ("id", "request", "user", "decision", "reason", "created_at")
    list_filter = ("decision", "request__tenant")
    search_fields = ("user__username", "reason")
    list_select_related = ("request", "user")
    readonly_fields = ("request", "user", "decision", "reason", "created_at")


@admin.register(Notification)
class NotificationAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "kind", "subject", "status", "attempts", "next_attempt_at", "sent_at", "created_at")
    list_filter = ("status", "kind", "tenant")
    search_fields = ("subject", "recipients", "last_error")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"
    readonly_fields = ("tenant", "kind", "recipients", "subject", "body_text", "body_html", "status", "attempts",
                       "next_attempt_at", "lease_expires_at", "last_error", "created_at", "sent_at")


@admin.register(ApprovalLink)
class ApprovalLinkAdmin(ReadOnlyAdmin):
    """Who was sent which link and whether it was used; never the nonce or the token hashes."""

    list_display = ("id", "request", "user", "created_at", "expires_at", "used_at", "used_for")
    list_filter = ("used_for", "tenant")
    search_fields = ("user__username",)
    list_select_related = ("request", "user")
    fields = readonly_fields = ("tenant", "request", "user", "notification", "args_hash", "tool", "created_at",
                                "expires_at", "used_at", "used_for")


@admin.register(SlackIdentity)
class SlackIdentityAdmin(ReadOnlyAdmin):
    note = "Slack users are mapped to people with `manage.py slack_identity` (audited), not here."
    list_display = ("slack_user_id", "user", "tenant", "created_by", "created_at")
    list_filter = ("tenant",)
    search_fields = ("slack_user_id", "user__username")
    list_select_related = ("user", "tenant")
    readonly_fields = ("tenant", "user", "slack_user_id", "created_by", "created_at")


@admin.register(SlackMessage)
class SlackMessageAdmin(ReadOnlyAdmin):
    list_display = ("id", "request", "channel", "ts", "posted_at", "attempts")
    readonly_fields = ("request", "channel", "ts", "posted_at", "attempts", "last_error")
