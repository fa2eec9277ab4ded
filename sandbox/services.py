"""The sandbox's domain effects: every write to its world goes through one of these functions.

They know nothing about HTTP, idempotency keys or injected faults; `sandbox.tools` wraps them with that.
Each takes the tenant whose world it changes: a record of another tenant is as missing as one that never
existed.
"""
import datetime
import secrets

from django.db import IntegrityError, models, transaction
from django.db.models import F
from django.utils import timezone

from ledger.models import Tenant
from sandbox.errors import Conflict, NotFound
from sandbox.models import (
    Charge,
    ChargeStatus,
    DirectoryUser,
    Fault,
    FlightBooking,
    FlightStatus,
    HotelReservation,
    HotelStatus,
    IdempotencyRecord,
    License,
    LicenseStatus,
    Message,
    Ticket,
    TicketPriority,
    ToolCall,
)

SEED_TICKETS = (
    ("T-182", "Login page times out", TicketPriority.NORMAL),
    ("T-204", "Invoice PDF missing", TicketPriority.NORMAL),
    ("T-311", "Export to CSV", TicketPriority.LOW),
)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def _transition(model: type[models.Model], pk: str, *, tenant: Tenant, source: str, target: str, stamp: str,
                noun: str):
    """Move one record from `source` to `target` status with a conditional update.

    Returns (record, changed): changed is False when it had already left `source` (a second cancel,
    refund or revoke is a no-op, never a second effect). Raises NotFound for an unknown id.
    """
    records = model.objects.filter(tenant=tenant, pk=pk)
    changed = records.filter(status=source).update(status=target, **{stamp: timezone.now()}) == 1
    record = records.first()
    if record is None:
        raise NotFound(f"{noun} {pk} does not exist")
    return record, changed


def hr_create_user(*, tenant: Tenant, email: str, name: str) -> DirectoryUser:
    return DirectoryUser.objects.create(tenant=tenant, id=_new_id("usr"), email=email, name=name)


def hr_delete_user(*, tenant: Tenant, user_id: str) -> bool:
    deleted, _ = DirectoryUser.objects.filter(tenant=tenant, pk=user_id).delete()
    return deleted > 0


def licenses_provision(*, tenant: Tenant, user_id: str, sku: str) -> License:
    if not DirectoryUser.objects.filter(tenant=tenant, pk=user_id).exists():
        raise NotFound(f"user {user_id} does not exist")
    return License.objects.create(tenant=tenant, id=_new_id("lic"), user_id=user_id, sku=sku)


def licenses_revoke(*, tenant: Tenant, license_id: str) -> tuple[License, bool]:
    return _transition(
        License,
        license_id,
        tenant=tenant,
        source=LicenseStatus.ACTIVE,
        target=LicenseStatus.REVOKED,
        stamp="revoked_at",
        noun="license",
    )


def email_send(*, tenant: Tenant, to: str, subject: str, body: str, idempotency_key: str) -> Message:
    return Message.objects.create(tenant=tenant, id=_new_id("msg"), to=to, subject=subject, body=body,
                                  idempotency_key=idempotency_key)


def payments_charge(*, tenant: Tenant, customer: str, amount_cents: int, currency: str) -> Charge:
    return Charge.objects.create(tenant=tenant, id=_new_id("ch"), customer=customer, amount_cents=amount_cents,
                                 currency=currency)


def payments_refund(*, tenant: Tenant, charge_id: str) -> tuple[Charge, bool]:
    return _transition(
        Charge,
        charge_id,
        tenant=tenant,
        source=ChargeStatus.CAPTURED,
        target=ChargeStatus.REFUNDED,
        stamp="refunded_at",
        noun="charge",
    )


def travel_book_flight(*, tenant: Tenant, passenger: str, flight: str, date: datetime.date) -> FlightBooking:
    return FlightBooking.objects.create(tenant=tenant, id=_new_id("flt"), passenger=passenger, flight=flight,
                                        date=date)


def travel_cancel_flight(*, tenant: Tenant, booking_id: str) -> tuple[FlightBooking, bool]:
    return _transition(
        FlightBooking,
        booking_id,
        tenant=tenant,
        source=FlightStatus.BOOKED,
        target=FlightStatus.CANCELLED,
        stamp="cancelled_at",
        noun="flight booking",
    )


def travel_reserve_hotel(*, tenant: Tenant, guest: str, hotel: str, nights: int) -> HotelReservation:
    return HotelReservation.objects.create(tenant=tenant, id=_new_id("htl"), guest=guest, hotel=hotel, nights=nights)


def travel_cancel_hotel(*, tenant: Tenant, reservation_id: str) -> tuple[HotelReservation, bool]:
    return _transition(
        HotelReservation,
        reservation_id,
        tenant=tenant,
        source=HotelStatus.RESERVED,
        target=HotelStatus.CANCELLED,
        stamp="cancelled_at",
        noun="hotel reservation",
    )


def crm_create_ticket(*, tenant: Tenant, ticket_id: str, subject: str, priority: str, updated_by: str) -> Ticket:
    try:
        with transaction.atomic():
            return Ticket.objects.create(tenant=tenant, number=ticket_id, subject=subject, priority=priority,
                                         updated_by=updated_by)
    except IntegrityError:
        raise Conflict(f"ticket {ticket_id} already exists") from None


def crm_update_ticket(
    *, tenant: Tenant, ticket_id: str, priority: str | None, status: str | None, note: str | None, updated_by: str
) -> Ticket:
    """Apply the given changes; the version moves only when something actually changed."""
    with transaction.atomic():
        ticket = Ticket.objects.select_for_update(no_key=True).filter(tenant=tenant, number=ticket_id).first()
        if ticket is None:
            raise NotFound(f"ticket {ticket_id} does not exist")
        changes: dict = {}
        if priority is not None and priority != ticket.priority:
            changes["priority"] = priority
        if status is not None and status != ticket.status:
            changes["status"] = status
        if note is not None:
            changes["notes"] = [*ticket.notes, note]
        if not changes:
            return ticket
        Ticket.objects.filter(pk=ticket.pk).update(
            **changes, version=F("version") + 1, updated_by=updated_by, updated_at=timezone.now()
        )
        ticket.refresh_from_db()
        return ticket


@transaction.atomic
def sandbox_reset(*, tenant: Tenant) -> None:
    """Empty the tenant's world, forget its keys, faults and calls, and put its seed tickets back.

    Other tenants' worlds are untouched.
    """
    world = (DirectoryUser, License, Message, Charge, FlightBooking, HotelReservation, Ticket)
    for model in (ToolCall, IdempotencyRecord, Fault, *world):
        model.objects.filter(tenant=tenant).delete()
    Ticket.objects.bulk_create(
        Ticket(tenant=tenant, number=ticket_id, subject=subject, priority=priority, updated_by="system")
        for ticket_id, subject, priority in SEED_TICKETS
    )
