"""The tenants, people and tools a chaos run works with, built through the real services."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import requests
import yaml
from django.contrib.auth import get_user_model

from ledger.executors import signing
from ledger.models import Tenant
from ledger.tenancy import agent_create, membership_set, tenant_create
from ledger.policy.versions import tools_load

POLICY = Path(__file__).resolve().parent.parent / "sandbox" / "policy.yaml"
TENANT = "chaos"
GATED = "chaos-gated"
PASSWORD = "chaos-pw-not-secret"
OPERATOR = "olga"
GATED_TTL_SECONDS = 4

# Forward tools the sagas call, and the tools that compensate them (the sandbox's policy file).
FORWARD_TOOLS = ["hr.create_user", "licenses.provision", "email.send", "payments.charge", "travel.book_flight",
                 "travel.reserve_hotel", "crm.update_ticket"]
COMPENSATION_TOOLS = ["hr.delete_user", "licenses.revoke", "travel.cancel_flight", "travel.cancel_hotel",
                      "email.send", "crm.update_ticket"]


@dataclass
class Cast:
    """Who acts in a chaos run."""

    tenant: Tenant
    gated: Tenant
    key: str            # the agents' key in `chaos` (charges run without a person: threshold critical)
    gated_key: str      # an agent of `chaos-gated`, where charges wait for a person and approvals expire fast
    operator: str       # username of an operator of both tenants (password PASSWORD)
    approver: str       # username of an approver of both tenants

    @property
    def tenant_ids(self) -> list[int]:
        return [self.tenant.pk, self.gated.pk]


def policy(*, threshold: str, ttl_seconds: int, tool_timeout: float | None = None) -> dict:
    """The sandbox's policy file, with the tenant defaults given (and every tool's timeout, when given:
    a lost worker's lease is the tool's timeout plus a second)."""
    document = yaml.safe_load(POLICY.read_text())
    document["defaults"] = {"approval_threshold": threshold, "approval_ttl": f"{ttl_seconds}s"}
    if tool_timeout is not None:
        for spec in document["tools"].values():
            spec["timeout"] = tool_timeout
    return document


def cast_create(*, tool_timeout: float | None = None) -> Cast:
    """Two tenants with the sandbox policy, an agent each, an operator and an approver."""
    tenant = tenant_create(slug=TENANT, name="Chaos")
    tools_load(tenant=tenant, document=policy(threshold="critical", ttl_seconds=3600, tool_timeout=tool_timeout),
               actor="system:chaos")
    gated = tenant_create(slug=GATED, name="Chaos (gated)")
    tools_load(tenant=gated, document=policy(threshold="high", ttl_seconds=GATED_TTL_SECONDS, tool_timeout=tool_timeout),
               actor="system:chaos")
    _, key = agent_create(tenant=tenant, name="chaos-agent")
    _, gated_key = agent_create(tenant=gated, name="chaos-gated-agent")
    User = get_user_model()
    operator = User.objects.create_user(OPERATOR, "olga@chaos.invalid", PASSWORD)
    approver = User.objects.create_user("abe", "abe@chaos.invalid", PASSWORD)
    membership_set(tenant=tenant, user=operator, role="operator")
    membership_set(tenant=gated, user=operator, role="operator")
    membership_set(tenant=gated, user=approver, role="approver")
    membership_set(tenant=tenant, user=approver, role="approver")  # refunds of charges that landed after a cancel
    from sandbox.services import sandbox_reset

    for world in (tenant, gated):
        sandbox_reset(tenant=world)  # each tenant's sandbox world starts empty, with its seed tickets
    return Cast(tenant=tenant, gated=gated, key=key, gated_key=gated_key, operator=OPERATOR, approver="abe")


def sandbox_control(method: str, base_url: str, path: str, *, tenant: str = TENANT, timeout: float = 10,
                    **kwargs) -> requests.Response:
    """A request to the sandbox's controls (faults, state) as the operator, in the named tenant's world."""
    return requests.request(method, f"{base_url}/sandbox/{path}", params={"tenant": tenant},
                            auth=(OPERATOR, PASSWORD), timeout=timeout, **kwargs)


def sandbox_tool(base_url: str, path: str, payload: dict, *, tenant: str = TENANT,
                 timeout: float = 10) -> requests.Response:
    """A sandbox tool called directly (another system changing the world), signed for the tenant as Unwind signs."""
    import json

    body = json.dumps(payload).encode()
    url = f"{base_url}/sandbox/{path}"
    headers = {"Content-Type": "application/json", **signing.sign(tenant=tenant, method="POST", url=url, body=body)}
    return requests.post(url, data=body, headers=headers, timeout=timeout)
