"""Issue 28 through the MCP gateway: the answer says in words why a step waits for a person, and a call the policy
refuses is a tool error naming the policy's text, with nothing reaching the tool.

The sandbox's `payments.capture` (sandbox/policy.yaml): a rule asks a person above 100.00, another refuses
anything but EUR. Each call runs in a session of its own (a capture is its run's pivot)."""
from __future__ import annotations

from ledger.models import Action
from tests.api_support import effects
from tests.test_mcp_gateway import call, gateway, session  # noqa: F401 - the fixture

pytest_plugins = ["tests.api_fixtures"]


def capture(gateway, **args):  # noqa: F811 - the fixture
    async def script(mcp):
        return await call(mcp, "payments.capture", {"customer": "cus_1", **args})

    return session(gateway.url, gateway.world.key, script)


def test_the_mcp_answer_says_why_a_person_is_asked(gateway):  # noqa: F811
    is_error, small, _ = capture(gateway, amount_cents=2500, currency="EUR")
    assert not is_error and small["status"] == "succeeded" and "why" not in small, small
    is_error, large, text = capture(gateway, amount_cents=48000, currency="EUR")
    assert not is_error and large["pending"] is True, large
    assert large["why"] == "needs a person: charges above 100.00 need a person — amount_cents is €480.00", large
    assert f"waiting for a person's approval ({large['why']})" in large["message"]
    assert len(effects("payments.charge")) == 1  # the small one only: the large one waits


def test_a_policy_refusal_is_a_tool_error_with_the_policys_text(gateway):  # noqa: F811
    is_error, refused, _ = capture(gateway, amount_cents=2500, currency="USD")
    assert is_error and refused["code"] == "policy_denied", refused
    assert refused["reason"] == "extras are charged in EUR only" and refused["message"].startswith(
        "extras are charged in EUR only. Nothing was done")
    step = Action.objects.get(pk=refused["action_id"])
    assert (step.status, step.error_class) == ("failed", "refused")
    assert effects("payments.charge") == []
