"""The OpenAI Agents SDK adapter: the real SDK's Runner with a scripted Model, against a live server over HTTP.

The sandbox's tools are Unwind's HTTP tools (the product's own policy file); the model reads the adapter's tool
outputs and decides from them (examples/scripted_brain.py), so each test checks what the model saw and what the
sandbox and the ledger show afterwards.
"""
import asyncio
import subprocess
import sys

import pytest
import requests

from examples.openai_agents_agent import ScriptedModel
from examples.scripted_brain import onboarding
from examples.scripted_brain import Plan, Step
from ledger.models import Run, Tool
from ledger.tenancy import deploy_key_create
from tests.conftest import ROOT
from tests.helpers import fault
from tests.test_client import calls, eventually
from unwind_client import Refused, Unwind
from unwind_client.adapters import AgentRun, policy_document, server_tools, twin, unwind_tool

agents = pytest.importorskip("agents")
from agents import Agent, Runner, set_tracing_disabled  # noqa: E402

from unwind_client.openai_agents import function_tools, run_agent  # noqa: E402

TOOLS = ["hr.create_user", "licenses.provision", "email.send", "payments.charge", "crm.update_ticket"]


@pytest.fixture(autouse=True)
def _no_tracing():
    set_tracing_disabled(True)


@pytest.fixture
def unwind(http_tools, settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    return Unwind(http_tools.live_server.url, http_tools.key, backoff=0.01)


@pytest.fixture
def tools(unwind):
    return function_tools(server_tools(unwind, TOOLS))


def agent(plan: Plan, tools) -> Agent:
    return Agent(name="onboarder", instructions="Onboard people.", tools=tools, model=ScriptedModel(plan))


def outputs(result) -> list[dict]:
    """The tool outputs the model was given, parsed."""
    import json

    return [json.loads(item.output) for item in result.new_items if item.type == "tool_call_output_item"]


def forward(run) -> dict:
    return {a["tool"]: a["status"] for a in run.refresh().data["actions"] if a["kind"] == "forward"}


def test_a_multi_step_agent_run_is_one_completed_run(unwind, tools, http_tools):
    plan = onboarding("ashu@company.com", "Ashu Kumar")
    result, agent_run = asyncio.run(run_agent(agent(plan, tools), "Onboard Ashu", unwind=unwind,
                                              on_behalf_of="carol@company.com"))
    assert result.final_output == "Ashu Kumar is onboarded."
    user, license_, email = outputs(result)
    assert user["email"] == "ashu@company.com" and license_["user_id"] == user["id"] and email["message_id"]
    run = agent_run.run.refresh()
    assert run.status == "completed" and run.data["goal"] == "Onboard Ashu"
    assert forward(run) == {"hr.create_user": "succeeded", "licenses.provision": "succeeded", "email.send": "succeeded"}
    assert len(calls(http_tools, "hr.create_user")) == 1


def test_a_failed_step_is_an_error_output_and_the_sandbox_shows_the_earlier_steps_undone(unwind, tools, http_tools):
    fault("email.send", "status", status=504, times=0)
    plan = onboarding("sam@company.com", "Sam Lee")
    result, agent_run = asyncio.run(run_agent(agent(plan, tools), "Welcome Sam", unwind=unwind))
    user, license_, failed = outputs(result)
    assert failed["status"] == "failed" and failed["message"].startswith("error: email.send failed")
    assert failed["error_class"] == "http_504"
    assert result.final_output == failed["message"]  # the model read it and stopped
    assert eventually(lambda: agent_run.run.refresh().status == "compensated")
    assert forward(agent_run.run) == {"hr.create_user": "compensated", "licenses.provision": "compensated",
                                      "email.send": "failed"}
    deleted = calls(http_tools, "hr.delete_user")
    assert [c["args"]["user_id"] for c in deleted] == [user["id"]]
    assert [c["args"]["license_id"] for c in calls(http_tools, "licenses.revoke")] == [license_["id"]]
    gone = requests.get(f"{http_tools.live_server.url}/sandbox/hr/users/{user['id']}", auth=("victor", "pw-victor"),
                        timeout=5)
    assert gone.status_code == 404 or gone.json().get("active") is False


def test_a_call_after_the_unwind_is_not_sent(unwind, tools, http_tools):
    fault("licenses.provision", "status", status=504, times=0)
    plan = Plan([Step("hr_create_user", lambda seen: {"email": "a@company.com", "name": "A"}),
                 Step("licenses_provision", lambda seen: {"user_id": seen["hr_create_user"]["id"]})])
    agent_run = AgentRun(unwind, goal="two steps")
    asyncio.run(Runner.run(agent(plan, tools), "go", context=agent_run))
    [tool] = server_tools(unwind, ["hr.create_user"])
    answer = agent_run.call(tool, {"email": "b@company.com", "name": "B"})
    assert answer.error and answer.kind == "run_over" and "licenses.provision failed" in answer.data["message"]
    assert len(calls(http_tools, "hr.create_user")) == 1


def approve_or_reject(world, action_id: int, person: str, verdict: str, reason: str) -> None:
    approval = requests.get(f"{world.live_server.url}/api/v1/actions/{action_id}",
                            headers={"Authorization": f"Bearer {world.key}"}, timeout=5).json()["approval"]
    decided = requests.post(f"{world.live_server.url}/api/v1/approvals/{approval['id']}/{verdict}",
                            json={"reason": reason}, auth=(person, f"pw-{person}"), timeout=10)
    assert decided.status_code == 200, decided.text


def test_approval_pending_is_an_output_the_model_reads_then_the_same_call_gets_the_result(unwind, tools, http_tools):
    agent_run = AgentRun(unwind, goal="Onboard Zoë on the annual plan")
    first = asyncio.run(Runner.run(agent(onboarding("zoe@company.com", "Zoë", charge=True), tools), "go",
                                   context=agent_run))
    user, pending = outputs(first)
    assert pending["status"] == "pending_approval"
    assert pending["approval_url"].startswith(f"{http_tools.live_server.url}/approvals/")
    assert pending["message"].startswith(f"pending approval at {pending['approval_url']}")
    assert "again later with the same arguments" in pending["message"]
    assert first.final_output == pending["message"]
    assert agent_run.commit().status == "awaiting_approval"  # a step waits for a person: the run stays open
    approve_or_reject(http_tools, pending["action_id"], "alice", "approve", "as agreed")
    second = asyncio.run(Runner.run(agent(onboarding("zoe@company.com", "Zoë", charge=True), tools), "carry on",
                                    context=agent_run))
    again, charge = outputs(second)
    assert again == user and charge["status"] == "captured" and charge["amount_cents"] == 120000
    assert agent_run.commit().status == "completed"
    assert len(calls(http_tools, "hr.create_user")) == 1 and len(calls(http_tools, "payments.charge")) == 1


def test_a_rejection_is_an_output_with_the_reason_and_the_run_unwinds(unwind, tools, http_tools):
    agent_run = AgentRun(unwind, goal="Upgrade Zoë")
    first = asyncio.run(Runner.run(agent(onboarding("zoe@company.com", "Zoë", charge=True), tools), "go",
                                   context=agent_run))
    user, pending = outputs(first)
    approve_or_reject(http_tools, pending["action_id"], "ben", "reject", "not this month")
    second = asyncio.run(Runner.run(agent(onboarding("zoe@company.com", "Zoë", charge=True), tools), "carry on",
                                    context=agent_run))
    [rejected] = outputs(second)  # its first call already learns the run's fate
    assert rejected["status"] == "rejected" and rejected["reason"] == "not this month"
    assert rejected["tool"] == "payments.charge"
    assert rejected["message"].startswith("rejected: not this month.")
    assert second.final_output == rejected["message"]
    assert eventually(lambda: agent_run.run.refresh().status == "compensated")
    assert agent_run.commit().status == "compensated"
    assert [c["args"]["user_id"] for c in calls(http_tools, "hr.delete_user")] == [user["id"]]
    assert calls(http_tools, "payments.charge") == []


def test_a_refusal_is_an_output_and_the_model_tries_other_arguments(unwind, tools, http_tools):
    plan = Plan([Step("crm_update_ticket", lambda seen: {"ticket_id": "T-9999", "priority": "high"},
                      instead=lambda seen: {"ticket_id": "T-204", "priority": "high"})], done="Ticket raised.")
    result, agent_run = asyncio.run(run_agent(agent(plan, tools), "Raise the ticket", unwind=unwind))
    refused, updated = outputs(result)
    assert refused["status"] == "refused" and refused["code"] == "tool_refused"
    assert refused["message"] == f"refused: {refused['reason']}; try other arguments" and "T-9999" in refused["reason"]
    assert updated["priority"] == "high" and result.final_output == "Ticket raised."
    assert agent_run.run.refresh().status == "completed"


def test_an_invalid_call_is_refused_as_an_output_naming_the_field(unwind, tools):
    plan = Plan([Step("hr_create_user", lambda seen: {"email": "not-an-email", "name": "A"})])
    result, agent_run = asyncio.run(run_agent(agent(plan, tools), "typo", unwind=unwind))
    [refused] = outputs(result)
    assert refused["code"] == "validation_error" and refused["field"] == "args.email"
    assert refused["message"].startswith("refused (validation_error):")


def test_an_exception_in_the_agent_rolls_the_run_back(unwind, tools, http_tools):
    class Crash(Plan):
        def next(self, seen):
            if seen:
                raise LookupError("the model lost track")
            return super().next(seen)

    plan = Crash([Step("hr_create_user", lambda seen: {"email": "x@company.com", "name": "X"})])
    model_agent = agent(plan, tools)
    holder = {}

    async def go():
        holder["run"] = AgentRun(unwind, goal="crashes")
        try:
            await Runner.run(model_agent, "go", context=holder["run"])
        except LookupError:
            await asyncio.to_thread(holder["run"].rollback, "LookupError")
            raise

    with pytest.raises(LookupError):
        asyncio.run(go())
    run = holder["run"].run.refresh()
    assert eventually(lambda: run.refresh().status == "compensated") and run.data["cancel_requested_at"]
    assert len(calls(http_tools, "hr.delete_user")) == 1


def test_run_agent_rolls_back_when_runner_raises(unwind, tools, http_tools):
    class Crash(Plan):
        def next(self, seen):
            if seen:
                raise LookupError("the model lost track")
            return super().next(seen)

    plan = Crash([Step("hr_create_user", lambda seen: {"email": "y@company.com", "name": "Y"})])
    with pytest.raises(LookupError):
        asyncio.run(run_agent(agent(plan, tools), "go", unwind=unwind))
    run = Run.objects.get()  # the one run the agent opened: cancelled, its user deleted
    assert run.status == "compensated" and run.cancel_requested_at and run.goal == "go"
    assert len(calls(http_tools, "hr.create_user")) == 1 and len(calls(http_tools, "hr.delete_user")) == 1


def test_a_key_refused_mid_run_raises_instead_of_talking_to_the_model(unwind, tools, http_tools):
    agent_run = AgentRun(unwind, goal="the key is revoked halfway")
    [create] = server_tools(unwind, ["hr.create_user"])
    assert agent_run.call(create, {"email": "a@company.com", "name": "A"}).kind == "ok"
    unwind.session.headers["Authorization"] = "Bearer uw_nope_nope"  # as after the key was revoked
    plan = Plan([Step("hr_create_user", lambda seen: {"email": "b@company.com", "name": "B"})])
    with pytest.raises(agents.exceptions.UserError) as raised:  # the SDK wraps what a tool raises
        asyncio.run(Runner.run(agent(plan, tools), "go", context=agent_run))
    refused = raised.value.__cause__
    assert isinstance(refused, Refused) and (refused.status, refused.code) == (401, "authentication_failed")
    assert plan.turns == []  # the model was never told: a misconfigured agent stops
    assert len(calls(http_tools, "hr.create_user")) == 1


# --- functions the agent runs itself, with their compensations declared beside them -------------------------------

POSTED: list = []
DELETED: list = []


@unwind_tool("chat.delete", description="Delete a chat message.", saga_role="compensatable", risk="low")
async def delete_message(message_id: str) -> dict:  # an async body runs as well as a plain one
    DELETED.append(message_id)
    return {"deleted": message_id}


@unwind_tool("chat.post", compensation=twin(delete_message, message_id="$result.id"), saga_role="compensatable",
             risk="low", timeout=60)
def post_message(channel: str, text: str) -> dict:
    """Post a message to a chat channel."""
    POSTED.append(text)
    if text == "boom":
        raise ConnectionError("chat service down")
    return {"id": f"m-{len(POSTED)}", "channel": channel}


def test_declared_compensations_make_a_policy_a_person_loads_not_the_agent(unwind, http_tools):
    document = policy_document([post_message])
    assert set(document["tools"]) == {"chat.post", "chat.delete"}
    post = document["tools"]["chat.post"]
    assert post["executor"] == "client" and post["description"] == "Post a message to a chat channel."
    assert post["compensation"] == {"strategy": "twin", "tool": "chat.delete", "args": {"message_id": "$result.id"}}
    assert post["args_schema"] == {"type": "object", "additionalProperties": False, "required": ["channel", "text"],
                                   "properties": {"channel": {"type": "string"}, "text": {"type": "string"}}}
    with pytest.raises(Refused) as refused:
        unwind.load_policy(document)  # the agent's own key
    assert (refused.value.status, refused.value.code) == (403, "agents_cannot_govern")
    assert not Tool.objects.filter(name__startswith="chat.").exists()
    _, deploy_key = deploy_key_create(tenant=http_tools.acme, name="ci", actor="test")
    loaded = Unwind(http_tools.live_server.url, deploy_key).load_policy(document)
    assert sorted(loaded["loaded"]) == ["chat.delete", "chat.post"]


def test_client_executed_functions_run_in_the_agent_and_are_undone_by_it(unwind, http_tools):
    _, deploy_key = deploy_key_create(tenant=http_tools.acme, name="ci", actor="test")
    Unwind(http_tools.live_server.url, deploy_key).load_policy(policy_document([post_message]))
    POSTED.clear(), DELETED.clear()
    plan = Plan([Step("chat_post", lambda seen: {"channel": "general", "text": "Welcome Ashu"}),
                 Step("chat_post", lambda seen: {"channel": "general", "text": "Second"}),
                 Step("chat_post", lambda seen: {"channel": "general", "text": "boom"})])
    result, agent_run = asyncio.run(run_agent(agent(plan, function_tools([post_message])), "Announce", unwind=unwind))
    first, second, failed = outputs(result)
    assert (first["id"], second["id"]) == ("m-1", "m-2") and POSTED == ["Welcome Ashu", "Second", "boom"]
    assert failed["status"] == "failed" and "chat service down" in failed["error_message"]
    assert DELETED == ["m-2", "m-1"]  # the adapter ran the compensations Unwind asked for, newest first
    assert agent_run.run.refresh().status == "compensated"


def test_another_tenants_agent_cannot_call_the_tools_through_the_adapter(http_tools, settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    acme = Unwind(http_tools.live_server.url, http_tools.key, backoff=0.01)
    intruder = Unwind(http_tools.live_server.url, http_tools.other_key, backoff=0.01)  # globex's agent
    assert server_tools(intruder) == []  # it lists none of acme's tools
    with pytest.raises(LookupError, match="hr.create_user"):
        server_tools(intruder, ["hr.create_user"])
    plan = Plan([Step("hr_create_user", lambda seen: {"email": "x@company.com", "name": "X"})])
    result, agent_run = asyncio.run(run_agent(agent(plan, function_tools(server_tools(acme, TOOLS))), "go",
                                              unwind=intruder))  # acme's schemas, globex's key
    [refused] = outputs(result)
    assert refused["code"] == "unknown_tool" and refused["message"].startswith("refused (unknown_tool):")
    assert calls(http_tools, "hr.create_user") == []
    assert agent_run.run.refresh().data["actions"] == []


def test_a_tool_that_may_wait_for_a_person_says_so_to_the_model(tools):
    described = {tool.name: tool.description for tool in tools}
    assert described["payments_charge"].endswith("A call may wait for a person's approval.")
    assert "approval" not in described["hr_create_user"]


def test_importing_the_client_needs_neither_framework():
    code = ("import sys; sys.modules['agents'] = sys.modules['langgraph'] = sys.modules['langchain_core'] = None; "
            "import unwind_client, unwind_client.adapters; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
    missing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['agents'] = None; "
                              "import unwind_client.openai_agents"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "pip install 'unwind[openai-agents]'" in missing.stderr



def test_the_example_agent_onboards_unwinds_and_waits_for_approval(http_tools, settings):
    from examples import openai_agents_agent

    settings.UNWIND_THROTTLE_RATE = "100000/min"
    lines = []
    code = openai_agents_agent.main(["--url", http_tools.live_server.url, "--key", http_tools.key,
                                     "--approver", "alice:pw-alice", "--operator", "oscar:pw-oscar"], say=lines.append)
    output = "\n".join(lines)
    assert code == 0, output
    assert "model: Ashu Kumar is onboarded." in output and "model: error: email.send failed" in output
    assert "model: pending approval at " in output and "alice approved" in output
    assert sorted(Run.objects.values_list("status", flat=True)) == ["compensated", "completed", "completed"]
