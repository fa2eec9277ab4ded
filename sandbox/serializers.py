"""JSON documents for sandbox records.

Every value is JSON-native (timestamps as ISO 8601 strings), so a stored idempotent answer, an HTTP
body and an in-process callable's result are the same document.
"""
import datetime

from sandbox.models import (
    Charge,
    DirectoryUser,
    Fault,
    FlightBooking,
    HotelReservation,
    License,
    Message,
    Ticket,
    ToolCall,
)


def _iso(value: datetime.date | None) -> str | None:
    return value.isoformat() if value is not None else None


def user_json(user: DirectoryUser) -> dict:
    return {
        "id": user.id,
        "email": user.email,
        "name": user.name,
        "active": user.active,
        "created_at": _iso(user.created_at),
    }


def license_json(license: License) -> dict:
    return {
        "id": license.id,
        "user_id": license.user_id,
        "sku": license.sku,
        "status": license.status,
        "created_at": _iso(license.created_at),
        "revoked_at": _iso(license.revoked_at),
    }


def message_json(message: Message) -> dict:
    return {
        "message_id": message.id,
        "to": message.to,
        "subject": message.subject,
        "body": message.body,
        "idempotency_key": message.idempotency_key or None,
        "sent_at": _iso(message.sent_at),
    }


def charge_json(charge: Charge) -> dict:
    return {
        "charge_id": charge.id,
        "customer": charge.customer,
        "amount_cents": charge.amount_cents,
        "currency": charge.currency,
        "status": charge.status,
        "created_at": _iso(charge.created_at),
        "refunded_at": _iso(charge.refunded_at),
    }


def flight_json(booking: FlightBooking) -> dict:
    return {
        "booking_id": booking.id,
        "passenger": booking.passenger,
        "flight": booking.flight,
        "date": _iso(booking.date),
        "status": booking.status,
        "created_at": _iso(booking.created_at),
        "cancelled_at": _iso(booking.cancelled_at),
    }


def hotel_json(reservation: HotelReservation) -> dict:
    return {
        "reservation_id": reservation.id,
        "guest": reservation.guest,
        "hotel": reservation.hotel,
        "nights": reservation.nights,
        "status": reservation.status,
        "created_at": _iso(reservation.created_at),
        "cancelled_at": _iso(reservation.cancelled_at),
    }


def ticket_json(ticket: Ticket) -> dict:
    return {
        "id": ticket.number,
        "subject": ticket.subject,
        "priority": ticket.priority,
        "status": ticket.status,
        "notes": list(ticket.notes),
        "version": ticket.version,
        "updated_by": ticket.updated_by,
        "created_at": _iso(ticket.created_at),
        "updated_at": _iso(ticket.updated_at),
    }


def fault_json(fault: Fault) -> dict:
    return {
        "id": fault.id,
        "tool": fault.tool,
        "mode": fault.mode,
        "status": fault.status,
        "seconds": fault.seconds,
        "ms": fault.ms,
        "retry_after": fault.retry_after,
        "times": fault.times,
        "nth": fault.nth,
        "seen": fault.seen,
        "hits": fault.hits,
        "spent": fault.spent,
        "created_at": _iso(fault.created_at),
    }


def call_json(call: ToolCall) -> dict:
    return {
        "id": call.id,
        "tool": call.tool,
        "idempotency_key": call.idempotency_key or None,
        "args": call.args,
        "status": call.status,
        "effect_applied": call.effect_applied,
        "replayed": call.replayed,
        "fault": call.fault or None,
        "created_at": _iso(call.created_at),
    }
