"""The sandbox in the admin: for looking, not editing. Changes go through the tools, so that every
effect is logged and idempotent; faults can be deleted here to stop an injected failure."""
from django.contrib import admin

from sandbox.models import (
    Charge,
    DirectoryUser,
    Fault,
    FlightBooking,
    HotelReservation,
    IdempotencyRecord,
    License,
    Message,
    Ticket,
    ToolCall,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(DirectoryUser)
class DirectoryUserAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "email", "name", "active", "created_at")
    search_fields = ("id", "email", "name")


@admin.register(License)
class LicenseAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "user_id", "sku", "status", "created_at", "revoked_at")
    list_filter = ("tenant", "status", "sku")
    search_fields = ("id", "user_id")


@admin.register(Message)
class MessageAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "to", "subject", "idempotency_key", "sent_at")
    search_fields = ("id", "to", "subject", "idempotency_key")


@admin.register(Charge)
class ChargeAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "customer", "amount_cents", "currency", "status", "created_at", "refunded_at")
    list_filter = ("tenant", "status", "currency")
    search_fields = ("id", "customer")


@admin.register(FlightBooking)
class FlightBookingAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "passenger", "flight", "date", "status", "created_at")
    list_filter = ("tenant", "status")
    search_fields = ("id", "passenger", "flight")


@admin.register(HotelReservation)
class HotelReservationAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "guest", "hotel", "nights", "status", "created_at")
    list_filter = ("tenant", "status")
    search_fields = ("id", "guest", "hotel")


@admin.register(Ticket)
class TicketAdmin(ReadOnlyAdmin):
    list_display = ("number", "tenant", "subject", "priority", "status", "version", "updated_by", "updated_at")
    list_filter = ("tenant", "priority", "status")
    search_fields = ("number", "subject")


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    list_display = ("tool", "tenant", "key", "status", "created_at")
    list_filter = ("tenant", "tool")
    search_fields = ("key",)


@admin.register(Fault)
class FaultAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "tool", "mode", "status", "seconds", "ms", "times", "nth", "seen", "hits",
                    "created_at")
    list_filter = ("tenant", "tool", "mode")

    def has_delete_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("sandbox.delete_fault")


@admin.register(ToolCall)
class ToolCallAdmin(ReadOnlyAdmin):
    list_display = ("id", "tenant", "tool", "idempotency_key", "status", "effect_applied", "replayed", "fault",
                    "created_at")
    list_filter = ("tenant", "tool", "effect_applied", "replayed", "fault")
    search_fields = ("idempotency_key",)
