"""The tool gateway: one place where a sandbox tool call is validated, faulted, deduplicated and logged.

Both the HTTP views and the in-process callables go through `call_tool`, so a tool behaves the same
whichever way Unwind reaches it. Every call is made in one tenant's world (the HTTP views learn it from
Unwind's signature, the callables from the executor): its faults, keys, records and log row are that
tenant's. A call runs in this order:

0. refuse what cannot even be recorded (an overlong key, NUL characters, NaN, deep nesting);
1. claim a fault rule (if any) and sleep for its delay; `status` and `timeout` rules answer now, with
   nothing applied;
2. validate the arguments (400 names the field);
3. in one transaction: replay the stored answer for a known Idempotency-Key (422 if the arguments
   differ), or apply the effect and store the answer under the key; write the call log row;
4. an `error_after_effect` rule replaces the successful answer with its error status (a call refused
   in step 2 or 3 still spends the rule, and answers with its refusal).

Only successful answers are stored under a key: a refused call changed nothing, so repeating it is
harmless. `email.send` ignores the key on purpose, like a plain SMTP relay.
"""
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction

from ledger.models import Tenant
from sandbox import services
from sandbox.arguments import Arguments, check_json_document
from sandbox.errors import IdempotencyKeyReused, InvalidArgument, SandboxError
from sandbox.faults import fault_claim, fault_error, fault_hold
from sandbox.models import FaultMode, IdempotencyRecord, TicketPriority, TicketStatus, ToolCall, ToolName
from sandbox.serializers import charge_json, flight_json, hotel_json, license_json, message_json, ticket_json, user_json

MAX_KEY_LENGTH = 255
RESERVED_TICKET_IDS = {"update"}  # path segments under /sandbox/crm/tickets/ that are not ticket ids


@dataclass(frozen=True)
class ToolResponse:
    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @classmethod
    def from_error(cls, error: SandboxError) -> "ToolResponse":
        return cls(error.status, error.as_body(), dict(error.headers))


@dataclass(frozen=True)
class Tool:
    name: str
    parse: Callable[[Any], dict[str, Any]]
    apply: Callable[[dict[str, Any], str, Tenant], tuple[int, dict]]
    honours_idempotency_key: bool = True


# Arguments of each tool, validated into the keyword arguments of its service.


def _parse_create_user(raw: Any) -> dict:
    args = Arguments(raw, allowed={"email", "name"})
    return {"email": args.email("email"), "name": args.text("name")}


def _parse_user_id(raw: Any) -> dict:
    return {"user_id": Arguments(raw, allowed={"user_id"}).text("user_id", max_length=32)}


def _parse_provision(raw: Any) -> dict:
    args = Arguments(raw, allowed={"user_id", "sku"})
    return {
        "user_id": args.text("user_id", max_length=32),
        "sku": args.text("sku", default="workspace-standard", max_length=100),
    }


def _parse_license_id(raw: Any) -> dict:
    return {"license_id": Arguments(raw, allowed={"license_id"}).text("license_id", max_length=32)}


def _parse_email(raw: Any) -> dict:
    args = Arguments(raw, allowed={"to", "subject", "body"})
    return {
        "to": args.email("to"),
        "subject": args.text("subject", max_length=300),
        "body": args.text("body", default="", max_length=100_000),
    }


def _parse_charge(raw: Any) -> dict:
    args = Arguments(raw, allowed={"customer", "amount_cents", "currency"})
    currency = args.text("currency", default="EUR", max_length=3)
    if len(currency) != 3 or not currency.isascii() or not currency.isalpha():
        raise InvalidArgument(f"currency must be a three-letter code such as EUR, not {currency!r}")
    return {
        "customer": args.text("customer"),
        "amount_cents": args.integer("amount_cents", minimum=1, maximum=10**12),
        "currency": currency.upper(),
    }


def _parse_charge_id(raw: Any) -> dict:
    return {"charge_id": Arguments(raw, allowed={"charge_id"}).text("charge_id", max_length=32)}


def _parse_book_flight(raw: Any) -> dict:
    args = Arguments(raw, allowed={"passenger", "flight", "date"})
    return {
        "passenger": args.text("passenger"),
        "flight": args.text("flight", max_length=20),
        "date": args.date("date"),
    }


def _parse_booking_id(raw: Any) -> dict:
    return {"booking_id": Arguments(raw, allowed={"booking_id"}).text("booking_id", max_length=32)}


def _parse_reserve_hotel(raw: Any) -> dict:
    args = Arguments(raw, allowed={"guest", "hotel", "nights"})
    return {
        "guest": args.text("guest"),
        "hotel": args.text("hotel"),
        "nights": args.integer("nights", minimum=1, maximum=365),
    }


def _parse_reservation_id(raw: Any) -> dict:
    return {"reservation_id": Arguments(raw, allowed={"reservation_id"}).text("reservation_id", max_length=32)}


def _parse_create_ticket(raw: Any) -> dict:
    args = Arguments(raw, allowed={"id", "subject", "priority", "updated_by"})
    ticket_id = args.text("id", max_length=32)
    if ticket_id in RESERVED_TICKET_IDS or "/" in ticket_id:
        raise InvalidArgument(f"{ticket_id!r} cannot be a ticket id")
    return {
        "ticket_id": ticket_id,
        "subject": args.text("subject", max_length=300),
        "priority": args.choice("priority", TicketPriority.values, default=TicketPriority.NORMAL),
        "updated_by": args.text("updated_by", default="agent"),
    }


def _parse_update_ticket(raw: Any) -> dict:
    args = Arguments(raw, allowed={"ticket_id", "priority", "status", "note", "updated_by"})
    update = {
        "ticket_id": args.text("ticket_id", max_length=32),
        "priority": args.choice("priority", TicketPriority.values, default=None),
        "status": args.choice("status", TicketStatus.values, default=None),
        "note": args.text("note", default=None, max_length=2000),
        "updated_by": args.text("updated_by", default="agent"),
    }
    if update["priority"] is None and update["status"] is None and update["note"] is None:
        raise InvalidArgument("nothing to change: give priority, status or note")
    return update


# What each tool does, and the answer it gives.


def _create_user(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, user_json(services.hr_create_user(tenant=tenant, **args))


def _delete_user(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 200, {"deleted": services.hr_delete_user(tenant=tenant, **args), "id": args["user_id"]}


def _provision(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, license_json(services.licenses_provision(tenant=tenant, **args))


def _revoke(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    license, revoked = services.licenses_revoke(tenant=tenant, **args)
    return 200, {"revoked": revoked, **license_json(license)}


def _send_email(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, message_json(services.email_send(tenant=tenant, **args, idempotency_key=key))


def _charge(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, charge_json(services.payments_charge(tenant=tenant, **args))


def _refund(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    charge, refunded = services.payments_refund(tenant=tenant, **args)
    return 200, {"refunded": refunded, **charge_json(charge)}


def _book_flight(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, flight_json(services.travel_book_flight(tenant=tenant, **args))


def _cancel_flight(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    booking, cancelled = services.travel_cancel_flight(tenant=tenant, **args)
    return 200, {"cancelled": cancelled, **flight_json(booking)}


def _reserve_hotel(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, hotel_json(services.travel_reserve_hotel(tenant=tenant, **args))


def _cancel_hotel(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    reservation, cancelled = services.travel_cancel_hotel(tenant=tenant, **args)
    return 200, {"cancelled": cancelled, **hotel_json(reservation)}


def _create_ticket(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 201, ticket_json(services.crm_create_ticket(tenant=tenant, **args))


def _update_ticket(args: dict, key: str, tenant: Tenant) -> tuple[int, dict]:
    return 200, ticket_json(services.crm_update_ticket(tenant=tenant, **args))


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool(ToolName.HR_CREATE_USER, _parse_create_user, _create_user),
        Tool(ToolName.HR_DELETE_USER, _parse_user_id, _delete_user),
        Tool(ToolName.LICENSES_PROVISION, _parse_provision, _provision),
        Tool(ToolName.LICENSES_REVOKE, _parse_license_id, _revoke),
        Tool(ToolName.EMAIL_SEND, _parse_email, _send_email, honours_idempotency_key=False),
        Tool(ToolName.PAYMENTS_CHARGE, _parse_charge, _charge),
        Tool(ToolName.PAYMENTS_REFUND, _parse_charge_id, _refund),
        Tool(ToolName.TRAVEL_BOOK_FLIGHT, _parse_book_flight, _book_flight),
        Tool(ToolName.TRAVEL_CANCEL_FLIGHT, _parse_booking_id, _cancel_flight),
        Tool(ToolName.TRAVEL_RESERVE_HOTEL, _parse_reserve_hotel, _reserve_hotel),
        Tool(ToolName.TRAVEL_CANCEL_HOTEL, _parse_reservation_id, _cancel_hotel),
        Tool(ToolName.CRM_CREATE_TICKET, _parse_create_ticket, _create_ticket),
        Tool(ToolName.CRM_UPDATE_TICKET, _parse_update_ticket, _update_ticket),
    )
}


class _KeyTaken(Exception):
    """A concurrent call stored its answer under the same key first."""


def call_tool(name: str, raw_args: Any, *, tenant: Tenant, idempotency_key: str | None) -> ToolResponse:
    """Run one call of the tool `name` in the tenant's world and return its answer; every call leaves a row in
    the tenant's call log."""
    tool = TOOLS[name]
    key = (idempotency_key or "").strip()
    try:
        _check_envelope(raw_args, key)
    except InvalidArgument as error:
        # What was sent cannot be stored as it is: the log keeps the refusal without it.
        ToolCall.objects.create(tenant=tenant, tool=name, status=error.status)
        return ToolResponse.from_error(error)
    fault = injected = None

    def log(status: int, *, effect_applied: bool = False, replayed: bool = False) -> None:
        ToolCall.objects.create(
            tenant=tenant,
            tool=name,
            idempotency_key=key,
            args=raw_args,
            status=status,
            effect_applied=effect_applied,
            replayed=replayed,
            fault=fault.mode if fault is not None else "",
        )

    try:
        fault = fault_claim(tenant=tenant, tool=name)
        if fault is not None:
            fault_hold(fault)
            injected = fault_error(fault)
            if injected is not None and fault.mode != FaultMode.ERROR_AFTER_EFFECT:
                raise injected
        args = tool.parse(raw_args)
        status, body = _run(tool, args, key, tenant=tenant, log=log,
                            answer_status=injected.status if injected else None)
    except SandboxError as error:
        log(error.status)
        return ToolResponse.from_error(error)
    return ToolResponse.from_error(injected) if injected is not None else ToolResponse(status, body)


def _check_envelope(raw_args: Any, key: str) -> None:
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidArgument(f"the Idempotency-Key must be at most {MAX_KEY_LENGTH} characters")
    if not key.isprintable():
        raise InvalidArgument("the Idempotency-Key must not contain control characters")
    check_json_document(raw_args)


def _run(tool: Tool, args: dict, key: str, *, tenant: Tenant, log: Callable[..., None], answer_status: int | None):
    """Replay the stored answer or apply the effect, and log the call, in one transaction."""
    fingerprint = _fingerprint(args) if key and tool.honours_idempotency_key else None
    # Each pass either returns or lost a race to a call that has committed its answer, which the
    # next pass replays; the loop cannot spin.
    while True:
        try:
            with transaction.atomic():
                record = _stored_answer(tenant, tool.name, key) if fingerprint else None
                if record is not None:
                    if record.fingerprint != fingerprint:
                        raise IdempotencyKeyReused(
                            f"the Idempotency-Key {key!r} was already used for {tool.name} with other arguments"
                        )
                    log(answer_status or record.status, replayed=True)
                    return record.status, record.response
                status, body = tool.apply(args, key, tenant)
                if fingerprint:
                    _store_answer(tenant, tool.name, key, fingerprint, status, body)
                log(answer_status or status, effect_applied=True)
                return status, body
        except _KeyTaken:
            continue


def _stored_answer(tenant: Tenant, tool: str, key: str) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.filter(tenant=tenant, tool=tool, key=key).first()


def _store_answer(tenant: Tenant, tool: str, key: str, fingerprint: str, status: int, body: dict) -> None:
    try:
        with transaction.atomic():
            IdempotencyRecord.objects.create(tenant=tenant, tool=tool, key=key, fingerprint=fingerprint, status=status,
                                             response=body)
    except IntegrityError:
        raise _KeyTaken from None


def _fingerprint(args: dict) -> str:
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder)
    return hashlib.sha256(canonical.encode()).hexdigest()
