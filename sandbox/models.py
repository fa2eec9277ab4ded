"""The sandbox's world: the records of the services agents touch, plus its own bookkeeping.

Every write goes through `sandbox.services` (domain effects) or `sandbox.tools` (the tool gateway that
adds idempotency, fault injection and the call log), never through these models directly.

Every row belongs to a tenant: each tenant has its own world, its own fault rules, keys and call log,
and nothing one tenant does (or injects) is seen by another. Generated record ids (`usr_…`, `ch_…`) are
random and unique across tenants; ticket numbers are chosen by the client, so they are unique per tenant.
"""
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.utils import timezone


def _tenant_field():
    return models.ForeignKey("ledger.Tenant", on_delete=models.CASCADE, related_name="+")


class ToolName(models.TextChoices):
    HR_CREATE_USER = "hr.create_user"
    HR_DELETE_USER = "hr.delete_user"
    LICENSES_PROVISION = "licenses.provision"
    LICENSES_REVOKE = "licenses.revoke"
    EMAIL_SEND = "email.send"
    PAYMENTS_CHARGE = "payments.charge"
    PAYMENTS_REFUND = "payments.refund"
    TRAVEL_BOOK_FLIGHT = "travel.book_flight"
    TRAVEL_CANCEL_FLIGHT = "travel.cancel_flight"
    TRAVEL_RESERVE_HOTEL = "travel.reserve_hotel"
    TRAVEL_CANCEL_HOTEL = "travel.cancel_hotel"
    CRM_CREATE_TICKET = "crm.create_ticket"
    CRM_UPDATE_TICKET = "crm.update_ticket"


class DirectoryUser(models.Model):
    """A person in the HR directory."""

    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    email = models.EmailField()
    name = models.CharField(max_length=200)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"


class LicenseStatus(models.TextChoices):
    ACTIVE = "active"
    REVOKED = "revoked"


class License(models.Model):
    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    # Not a foreign key: a directory user can be deleted while their license lives on, as in real
    # systems, and that leftover is exactly what an unwind has to clean up.
    user_id = models.CharField(max_length=32, db_index=True)
    sku = models.CharField(max_length=100)
    status = models.CharField(max_length=16, choices=LicenseStatus.choices, default=LicenseStatus.ACTIVE)
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(status__in=LicenseStatus.values), name="sandbox_license_status_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.sku}, {self.status})"


class Message(models.Model):
    """An email the outbox sent. The relay does not deduplicate; it only remembers the key it was given."""

    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    to = models.EmailField(db_index=True)
    subject = models.CharField(max_length=300)
    body = models.TextField(blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True, db_index=True)
    sent_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.id} to {self.to}: {self.subject}"


class ChargeStatus(models.TextChoices):
    CAPTURED = "captured"
    REFUNDED = "refunded"


class Charge(models.Model):
    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    customer = models.CharField(max_length=200)
    amount_cents = models.BigIntegerField()
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=16, choices=ChargeStatus.choices, default=ChargeStatus.CAPTURED)
    created_at = models.DateTimeField(default=timezone.now)
    refunded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(amount_cents__gt=0), name="sandbox_charge_amount_positive"),
            models.CheckConstraint(condition=Q(status__in=ChargeStatus.values), name="sandbox_charge_status_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.amount_cents / 100:.2f} {self.currency} ({self.status})"


class FlightStatus(models.TextChoices):
    BOOKED = "booked"
    CANCELLED = "cancelled"


class FlightBooking(models.Model):
    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    passenger = models.CharField(max_length=200)
    flight = models.CharField(max_length=20)
    date = models.DateField()
    status = models.CharField(max_length=16, choices=FlightStatus.choices, default=FlightStatus.BOOKED)
    created_at = models.DateTimeField(default=timezone.now)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(status__in=FlightStatus.values), name="sandbox_flight_status_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.flight} {self.date} ({self.status})"


class HotelStatus(models.TextChoices):
    RESERVED = "reserved"
    CANCELLED = "cancelled"


class HotelReservation(models.Model):
    tenant = _tenant_field()
    id = models.CharField(primary_key=True, max_length=32)
    guest = models.CharField(max_length=200)
    hotel = models.CharField(max_length=200)
    nights = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=HotelStatus.choices, default=HotelStatus.RESERVED)
    created_at = models.DateTimeField(default=timezone.now)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(nights__gt=0), name="sandbox_hotel_nights_positive"),
            models.CheckConstraint(condition=Q(status__in=HotelStatus.values), name="sandbox_hotel_status_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.hotel} x{self.nights} ({self.status})"


class TicketPriority(models.TextChoices):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"
    URGENT = "urgent"


class TicketStatus(models.TextChoices):
    OPEN = "open"
    PENDING = "pending"
    CLOSED = "closed"


class Ticket(models.Model):
    """A CRM ticket. Its number ("T-182") is what clients call its id; it is unique within a tenant."""

    tenant = _tenant_field()
    number = models.CharField(max_length=32)
    subject = models.CharField(max_length=300)
    priority = models.CharField(max_length=16, choices=TicketPriority.choices, default=TicketPriority.NORMAL)
    status = models.CharField(max_length=16, choices=TicketStatus.choices, default=TicketStatus.OPEN)
    notes = models.JSONField(default=list, blank=True)
    version = models.PositiveIntegerField(default=1)
    updated_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__in=TicketPriority.values), name="sandbox_ticket_priority_valid"
            ),
            models.CheckConstraint(condition=Q(status__in=TicketStatus.values), name="sandbox_ticket_status_valid"),
            models.UniqueConstraint(fields=["tenant", "number"], name="sandbox_ticket_number_unique_per_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.number} {self.subject} ({self.priority}, {self.status}, v{self.version})"


class IdempotencyRecord(models.Model):
    """The stored answer to the first successful call of a tool with a given Idempotency-Key.

    Written in the same transaction as the effect; the unique constraint decides which of two
    concurrent calls with the same key wins, and the loser replays the winner's answer.
    """

    tenant = _tenant_field()
    tool = models.CharField(max_length=64, choices=ToolName.choices)
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the canonical, validated arguments.")
    status = models.PositiveSmallIntegerField()
    response = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "tool", "key"], name="sandbox_idempotency_tool_key_unique")
        ]

    def __str__(self) -> str:
        return f"{self.tool} {self.key}"


class FaultMode(models.TextChoices):
    STATUS = "status", "answer an error status, apply nothing"
    TIMEOUT = "timeout", "hold the call, then answer 504, apply nothing"
    LATENCY = "latency", "delay, then behave normally"
    ERROR_AFTER_EFFECT = "error_after_effect", "apply the effect, then answer an error status"


class Fault(models.Model):
    """A failure-injection rule for one tool.

    A rule affects the next `times` calls of its tool (None: every call). With `nth` it first lets
    nth - 1 calls of the tool pass (counted in `seen` from the rule's creation), then affects calls from
    the nth on. `hits` counts the calls it affected; a rule with hits == times is spent.
    """

    tenant = _tenant_field()
    tool = models.CharField(max_length=64, choices=ToolName.choices, db_index=True)
    mode = models.CharField(max_length=32, choices=FaultMode.choices)
    status = models.PositiveSmallIntegerField(null=True, blank=True)
    seconds = models.FloatField(null=True, blank=True)
    ms = models.PositiveIntegerField(null=True, blank=True)
    retry_after = models.PositiveIntegerField(null=True, blank=True)
    times = models.PositiveIntegerField(null=True, blank=True)
    nth = models.PositiveIntegerField(null=True, blank=True)
    seen = models.PositiveIntegerField(default=0)
    hits = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(times__isnull=True) | Q(times__gte=1), name="sandbox_fault_times_positive"
            ),
            models.CheckConstraint(condition=Q(nth__isnull=True) | Q(nth__gte=1), name="sandbox_fault_nth_positive"),
        ]

    @property
    def spent(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def __str__(self) -> str:
        return f"{self.tool} {self.mode} ({self.hits}/{self.times or '∞'})"


class ToolCall(models.Model):
    """One call of a sandbox tool, whatever its outcome: the evidence of what happened, and how often."""

    tenant = _tenant_field()
    tool = models.CharField(max_length=64, choices=ToolName.choices, db_index=True)
    idempotency_key = models.CharField(max_length=255, blank=True, db_index=True)
    args = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    status = models.PositiveSmallIntegerField()
    effect_applied = models.BooleanField(default=False)
    replayed = models.BooleanField(default=False)
    fault = models.CharField(max_length=32, blank=True, choices=FaultMode.choices)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.tool} -> {self.status}"
