"""Admin for the recovery queue: read-only; items are resolved in the console, through the services."""
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from ledger.admin import ReadOnlyAdmin
from recovery.models import RecoveryItem

NOTE = "Recovery items are read-only here: resume, compensate or close them in the console (/console/recovery/)."


@admin.register(RecoveryItem)
class RecoveryItemAdmin(ReadOnlyAdmin):
    note = NOTE
    list_display = ("id", "tenant", "run_id", "reason", "risk", "tool_name", "status", "resolution", "resolved_by",
                    "created_at", "console")
    list_filter = ("status", "reason", "risk", "resolution", "tenant")
    search_fields = ("=id", "=run__id", "detail", "tool_name", "resolved_by", "resolution_note")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"
    raw_id_fields = ("run", "action")

    @admin.display(description="console")
    def console(self, obj):
        return format_html('<a href="{}">open</a>', reverse("recovery:item", args=[obj.pk]))
