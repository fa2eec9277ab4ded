"""Admin for the recovery queue (read-only; items are resolved in the console, through the services), the tenant's
known customer addresses (kept by its admins, through recovery/customers.py) and what became of hold notices."""
from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.urls import reverse
from django.utils.html import format_html

from ledger.admin import ReadOnlyAdmin
from ledger.errors import PermissionDenied, StateConflict, ValidationFailed
from ledger.models import Tenant
from recovery import customers
from recovery.models import HoldNotice, KnownCustomerAddress, RecoveryItem

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


class KnownCustomerAddressForm(forms.ModelForm):
    class Meta:
        model = KnownCustomerAddress
        fields = ("tenant", "address", "note")

    def clean_address(self):
        try:
            return customers.entry_of(self.cleaned_data.get("address"))
        except ValidationFailed as invalid:
            raise forms.ValidationError(invalid.detail) from None


@admin.register(KnownCustomerAddress)
class KnownCustomerAddressAdmin(admin.ModelAdmin):
    """The tenant's known customer addresses, kept by its admins: added and removed through recovery/customers.py
    (audited), never edited (remove an entry and add the right one)."""

    form = KnownCustomerAddressForm
    list_display = ("address", "tenant", "note", "created_by", "created_at")
    list_filter = ("tenant",)
    search_fields = ("address", "note")
    list_select_related = ("tenant",)

    def _keeps_any(self, request) -> bool:
        return bool(customers.admin_tenant_ids(request.user))

    def has_module_permission(self, request):
        return self._keeps_any(request)

    def has_view_permission(self, request, obj=None):
        return self._keeps_any(request) if obj is None else customers.may_keep_list(request.user, obj.tenant_id)

    def has_add_permission(self, request):
        return self._keeps_any(request)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self._keeps_any(request) if obj is None else customers.may_keep_list(request.user, obj.tenant_id)

    def get_queryset(self, request):
        return super().get_queryset(request).filter(tenant_id__in=customers.admin_tenant_ids(request.user))

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "tenant":
            kwargs["queryset"] = Tenant.objects.filter(pk__in=customers.admin_tenant_ids(request.user))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        try:
            saved = customers.known_customer_add(tenant=obj.tenant, address=obj.address, note=obj.note,
                                                 user=request.user)
        except (PermissionDenied, StateConflict) as refused:
            raise DjangoPermissionDenied(refused.detail) from None
        obj.pk, obj.created_by, obj.created_at = saved.pk, saved.created_by, saved.created_at
        obj._state.adding = False

    def delete_model(self, request, obj):
        customers.known_customer_remove(entry=obj, user=request.user)

    def delete_queryset(self, request, queryset):
        for entry in queryset:
            customers.known_customer_remove(entry=entry, user=request.user)


@admin.register(HoldNotice)
class HoldNoticeAdmin(ReadOnlyAdmin):
    note = "What became of each held step's notice to the customer: sent to a known address, or why not."
    list_display = ("id", "tenant", "run_id", "action_id", "agent", "sent", "sent_to", "why", "created_at")
    list_filter = ("sent", "tenant")
    search_fields = ("=run__id", "sent_to", "why")
    list_select_related = ("tenant", "agent")
    date_hierarchy = "created_at"
