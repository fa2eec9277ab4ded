"""In-process form of the sandbox tools, for Unwind's Python executor.

Each tool is `fn(args, *, idempotency_key, target) -> dict` and goes through the same gateway as the
HTTP views (`sandbox.tools.call_tool`): same validation, idempotency, faults and call log. A refusal or
an injected fault raises `ToolError`, transient exactly when the HTTP status would be retried
(408, 425, 429, 5xx). The readers return a record as JSON, or None when it does not exist; `messages_with_key` lists the
messages sent with a key, for reading back whether a send happened.

Tool arguments name their target (`ticket_id`, `charge_id`, ...); `target` is accepted for the
executor contract and not needed beyond that. `tenant` (the slug Unwind's executor passes) chooses the
tenant's world; a call without one, or for a tenant that does not exist, is refused.

They stay registered whatever `UNWIND_SANDBOX` says, so that a policy naming them loads and reads the
same everywhere; while the sandbox is off every call refuses with a sentence saying so (a permanent
ToolError), and nothing is recorded.

They are registered in Unwind's Python registry (`ledger.policy.registry`): a policy names the tool
"sandbox.crm.update_ticket" and the reader "sandbox.read_ticket", never a module path.
"""
from collections.abc import Callable

from ledger.policy import registry
from django.conf import settings

from ledger.executors.call import ToolError
from ledger.models import Tenant
from sandbox import selectors
from sandbox.models import ToolName
from sandbox.tools import call_tool


def _is_transient(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


def _world(key: str, tenant: str | None) -> Tenant:
    """The tenant whose world a call acts in; refuses (permanently) when the sandbox is off or no tenant is given."""
    if not settings.UNWIND_SANDBOX:
        raise ToolError(f"{key}: the sandbox is off (UNWIND_SANDBOX); its tools cannot be called", transient=False)
    found = Tenant.objects.filter(slug=tenant).first() if isinstance(tenant, str) and tenant else None
    if found is None:
        raise ToolError(f"{key} must be called for a tenant: the executor passes tenant=<slug>, "
                        f"not {tenant!r}", transient=False)
    return found


def _tool_callable(name: ToolName, *, policy_name: str = "") -> Callable[..., dict]:
    """The sandbox tool `name`, registered as sandbox.<its name in the policy> (`policy_name`, else `name`)."""
    key = f"sandbox.{policy_name or name}"

    def call(args: dict, *, idempotency_key: str, target: str | None = None, tenant: str | None = None) -> dict:
        response = call_tool(name, args, tenant=_world(key, tenant), idempotency_key=idempotency_key)
        if response.ok:
            return response.body
        raise ToolError(
            f"{name} answered {response.status}: {response.body['detail']}",
            transient=_is_transient(response.status),
            status=response.status,
            body=response.body,
        )

    call.__name__ = call.__qualname__ = (policy_name or name).replace(".", "_")
    call.__doc__ = f"Call the sandbox tool {name} in-process."
    return registry.tool(key)(call)


hr_create_user = _tool_callable(ToolName.HR_CREATE_USER)
hr_delete_user = _tool_callable(ToolName.HR_DELETE_USER)
licenses_provision = _tool_callable(ToolName.LICENSES_PROVISION)
licenses_revoke = _tool_callable(ToolName.LICENSES_REVOKE)
email_send = _tool_callable(ToolName.EMAIL_SEND)
payments_charge = _tool_callable(ToolName.PAYMENTS_CHARGE)
payments_refund = _tool_callable(ToolName.PAYMENTS_REFUND)
# payments.capture (sandbox/policy.yaml) is the card charge under a policy of its own, whose rules read the amount.
payments_capture = _tool_callable(ToolName.PAYMENTS_CHARGE, policy_name="payments.capture")
travel_book_flight = _tool_callable(ToolName.TRAVEL_BOOK_FLIGHT)
travel_cancel_flight = _tool_callable(ToolName.TRAVEL_CANCEL_FLIGHT)
travel_reserve_hotel = _tool_callable(ToolName.TRAVEL_RESERVE_HOTEL)
travel_cancel_hotel = _tool_callable(ToolName.TRAVEL_CANCEL_HOTEL)
crm_create_ticket = _tool_callable(ToolName.CRM_CREATE_TICKET)
crm_update_ticket = _tool_callable(ToolName.CRM_UPDATE_TICKET)


@registry.reader("sandbox.read_user")
def read_user(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_user", tenant)
    return selectors.record_get("users", target, tenant=world)


@registry.reader("sandbox.read_license")
def read_license(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_license", tenant)
    return selectors.record_get("licenses", target, tenant=world)


@registry.reader("sandbox.read_message")
def read_message(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_message", tenant)
    return selectors.record_get("messages", target, tenant=world)


@registry.reader("sandbox.messages_with_key")
def messages_with_key(target: str, *, tenant: str | None = None) -> dict:
    """Did a send with this Idempotency-Key happen? The same document as
    GET /sandbox/email/messages?idempotency_key=<key>: {"results": [message, ...]}."""
    world = _world("sandbox.messages_with_key", tenant)
    return {"results": selectors.message_list(tenant=world, idempotency_key=target)}


@registry.reader("sandbox.read_charge")
def read_charge(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_charge", tenant)
    return selectors.record_get("charges", target, tenant=world)


@registry.reader("sandbox.read_flight")
def read_flight(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_flight", tenant)
    return selectors.record_get("flights", target, tenant=world)


@registry.reader("sandbox.read_hotel")
def read_hotel(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_hotel", tenant)
    return selectors.record_get("hotels", target, tenant=world)


@registry.reader("sandbox.read_ticket")
def read_ticket(target: str, *, tenant: str | None = None) -> dict | None:
    world = _world("sandbox.read_ticket", tenant)
    return selectors.record_get("tickets", target, tenant=world)
