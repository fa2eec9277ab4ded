"""Small helpers shared by tests: driving runs through the real services."""
from ledger.models import Run
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_open


def open_run(world, goal="test run", **kwargs) -> Run:
    return run_open(tenant=world.acme, agent=world.agent, goal=goal, on_behalf_of="carol@example.com",
                    actor="agent:booker", **kwargs)


def act(run, tool, args, *, key=None, target=None, intent=None):
    """Propose and, when claimed, execute inline, as the API's fast path does. Returns the action."""
    proposal = action_propose(run=run, tool_name=tool, args=args, actor="agent:booker", idempotency_key=key,
                              target=target, intent=intent or {"goal": run.goal, "confidence": 0.9})
    if proposal.claimed:
        execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)
        run.refresh_from_db()
        if run.status == "unwinding":
            execution.unwind(run.pk)
    proposal.action.refresh_from_db()
    run.refresh_from_db()
    return proposal.action


def fault(tool, mode="status", *, tenant="acme", **rule):
    """Inject a sandbox fault for `tenant` (the tests' runs act for acme)."""
    from ledger.models import Tenant
    from sandbox.faults import fault_add

    return fault_add({"tool": tool, "mode": mode, **rule}, tenant=Tenant.objects.get(slug=tenant))


def acme():
    """The tenant the tests' runs act for, whose sandbox world they read."""
    from ledger.models import Tenant

    return Tenant.objects.get(slug="acme")


def signed_post(url: str, payload: dict, *, tenant: str = "acme", headers: dict | None = None):
    """POST to a sandbox tool as Unwind does: the JSON body signed for `tenant` (ledger.executors.signing)."""
    import json

    import requests

    from ledger.executors import signing

    body = json.dumps(payload).encode()
    signed = signing.sign(tenant=tenant, method="POST", url=url, body=body)
    return requests.post(url, data=body, timeout=5,
                         headers={"Content-Type": "application/json", **signed, **(headers or {})})
