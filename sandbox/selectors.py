"""Reads of one tenant's sandbox world, as JSON documents."""
from collections.abc import Callable

from django.db import models
from django.db.models import Count, Q

from ledger.models import Tenant
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
from sandbox.serializers import (
    call_json,
    charge_json,
    fault_json,
    flight_json,
    hotel_json,
    license_json,
    message_json,
    ticket_json,
    user_json,
)

# kind -> (model, serializer, order of a listing, the field a record's id is looked up by)
KINDS: dict[str, tuple[type[models.Model], Callable[..., dict], str, str]] = {
    "users": (DirectoryUser, user_json, "created_at", "pk"),
    "licenses": (License, license_json, "created_at", "pk"),
    "messages": (Message, message_json, "sent_at", "pk"),
    "charges": (Charge, charge_json, "created_at", "pk"),
    "flights": (FlightBooking, flight_json, "created_at", "pk"),
    "hotels": (HotelReservation, hotel_json, "created_at", "pk"),
    "tickets": (Ticket, ticket_json, "number", "number"),
    "faults": (Fault, fault_json, "id", "pk"),
}
DEFAULT_CALLS_LIMIT = 1000


def record_get(kind: str, record_id: str, *, tenant: Tenant) -> dict | None:
    """One record of `kind` in the tenant's world as JSON, or None when it does not exist there."""
    model, serialize, _, id_field = KINDS[kind]
    record = model.objects.filter(tenant=tenant, **{id_field: record_id}).first()
    return serialize(record) if record is not None else None


def record_list(kind: str, *, tenant: Tenant) -> list[dict]:
    model, serialize, order, _ = KINDS[kind]
    return [serialize(record) for record in model.objects.filter(tenant=tenant).order_by(order, "pk")]


def message_list(*, tenant: Tenant, to: str | None = None, idempotency_key: str | None = None) -> list[dict]:
    """Sent messages, optionally only those to one address or sent with one Idempotency-Key.

    An empty key matches nothing: a message sent without a key is no evidence for any key.
    """
    messages = Message.objects.filter(tenant=tenant)
    if to is not None:
        messages = messages.filter(to__iexact=to)
    if idempotency_key is not None:
        messages = messages.filter(idempotency_key=idempotency_key) if idempotency_key else messages.none()
    return [message_json(message) for message in messages.order_by("sent_at", "pk")]


def call_counts(*, tenant: Tenant) -> dict[str, dict[str, int]]:
    """Per tool: how many calls, how many applied an effect, how many replayed a stored answer."""
    rows = (
        ToolCall.objects.filter(tenant=tenant)
        .values("tool")
        .annotate(
            calls=Count("id"),
            effects=Count("id", filter=Q(effect_applied=True)),
            replays=Count("id", filter=Q(replayed=True)),
        )
        .order_by("tool")
    )
    return {row["tool"]: {"calls": row["calls"], "effects": row["effects"], "replays": row["replays"]} for row in rows}


def call_list(
    *, tenant: Tenant, tool: str | None = None, idempotency_key: str | None = None, limit: int = DEFAULT_CALLS_LIMIT
) -> dict:
    """The most recent `limit` calls matching the filters, oldest first, and how many match in all."""
    calls = ToolCall.objects.filter(tenant=tenant)
    if tool:
        calls = calls.filter(tool=tool)
    if idempotency_key:
        calls = calls.filter(idempotency_key=idempotency_key)
    recent = list(calls.order_by("-id")[:limit])
    return {"count": calls.count(), "results": [call_json(call) for call in reversed(recent)]}


def world_state(*, tenant: Tenant) -> dict:
    """Everything the tenant's sandbox world holds, in one document."""
    state = {kind: record_list(kind, tenant=tenant) for kind in KINDS}
    state["call_counts"] = call_counts(tenant=tenant)
    return state
