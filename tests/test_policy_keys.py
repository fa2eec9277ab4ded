"""Issue 32: a tool that can change the world says whether it honours Unwind's idempotency key; `load_tools` warns
when it leaves it implicit (HTTP and in-process tools are then taken to honour it, MCP tools not)."""
from io import StringIO

import yaml
from django.core.management import call_command

from ledger.models import Tool

POLICY = {
    "tools": {
        "crm.note": {"executor": {"kind": "http", "url": "/sandbox/crm/note"}, "saga_role": "retriable"},
        "crm.stated": {"executor": {"kind": "http", "url": "/sandbox/crm/stated"}, "saga_role": "retriable",
                       "idempotency": {"honours_key": False}, "lookup": {"read": "/sandbox/crm/notes?key={key}"}},
        "crm.read": {"executor": {"kind": "http", "url": "/sandbox/crm/read"}, "action_class": "read_only"},
    },
}


def test_load_tools_warns_of_a_world_changing_tool_that_leaves_the_key_implicit(tools, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    out, err = StringIO(), StringIO()
    call_command("load_tools", str(policy), tenant="acme", stdout=out, stderr=err)
    warnings = [line for line in err.getvalue().splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: crm.note can change the world")
    assert "taken as true" in warnings[0]
    assert Tool.objects.get(tenant=tools.acme, name="crm.note", is_current=True).honours_idempotency_key is True
    assert Tool.objects.get(tenant=tools.acme, name="crm.stated", is_current=True).honours_idempotency_key is False


def test_the_sandbox_policy_states_it_for_every_tool(tools):
    from ledger.policy.document import keys_left_implicit
    from tests.conftest import POLICY as SANDBOX

    assert keys_left_implicit(SANDBOX) == []
