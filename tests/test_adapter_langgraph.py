"""The LangGraph adapter: a real StateGraph with the adapter's ToolNode and a scripted chat model, against a live
server over HTTP with the sandbox's tools. Each test checks the ToolMessages the model read and what the sandbox
and the ledger show afterwards."""
import json

import pytest
import requests

from examples.scripted_brain import Plan, Step, onboarding
from ledger.models import Run
from tests.helpers import fault
from tests.test_adapter_openai_agents import approve_or_reject, forward
from tests.test_client import calls, eventually
from unwind_client import Unwind, UnwindClientError
from unwind_client.adapters import server_tools

pytest.importorskip("langgraph")
from langchain_core.messages import ToolMessage  # noqa: E402

from examples.langgraph_agent import ScriptedChatModel, build_graph  # noqa: E402
from unwind_client.langgraph import UnwindThreads, langchain_tools  # noqa: E402

TOOLS = ["hr.create_user", "licenses.provision", "email.send", "payments.charge", "crm.update_ticket"]


@pytest.fixture
def unwind(http_tools, settings):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    return Unwind(http_tools.live_server.url, http_tools.key, backoff=0.01)


@pytest.fixture
def tools(unwind):
    return server_tools(unwind, TOOLS)


def invoke(plan: Plan, tools, threads: UnwindThreads, config: dict, text: str = "go") -> list[ToolMessage]:
    """Run the graph once; return the ToolMessages the model was given, and the final message in `plan.turns`."""
    state = build_graph(ScriptedChatModel(plan=plan), tools, threads).invoke({"messages": [("user", text)]}, config)
    return [message for message in state["messages"] if isinstance(message, ToolMessage)]


def read(messages: list[ToolMessage]) -> list[dict]:
    return [json.loads(message.content) for message in messages]


def thread(name: str, **configurable) -> dict:
    return {"configurable": {"thread_id": name, **configurable}}


def test_a_multi_step_graph_run_is_the_threads_one_completed_run(unwind, tools, http_tools):
    threads = UnwindThreads(unwind, on_behalf_of="carol@company.com")
    config = thread("onboard-ashu", unwind_goal="Onboard Ashu")
    plan = onboarding("ashu@company.com", "Ashu Kumar")
    with threads.run(config) as agent_run:
        messages = invoke(plan, tools, threads, config)
    user, license_, email = read(messages)
    assert {m.status for m in messages} == {"success"} and [m.name for m in messages] == [
        "hr_create_user", "licenses_provision", "email_send"]
    assert license_["user_id"] == user["id"] and email["message_id"]
    run = agent_run.run.refresh()
    assert run.status == "completed" and run.data["goal"] == "Onboard Ashu"
    assert run.data["on_behalf_of"] == "carol@company.com"
    assert plan.turns == ["Ashu Kumar is onboarded."]
    assert Run.objects.count() == 1  # the thread's calls all went into one run
    with threads.run(config) as next_task:  # the thread's next task opens a run of its own
        invoke(Plan([Step("hr_create_user", lambda seen: {"email": "b@company.com", "name": "B"})]), tools, threads,
               config)
    assert next_task.run.id != agent_run.run.id and next_task.run.refresh().status == "completed"


def test_two_threads_have_two_runs(unwind, tools):
    threads = UnwindThreads(unwind)
    one, two = thread("t-1"), thread("t-2")
    invoke(Plan([Step("hr_create_user", lambda seen: {"email": "a@company.com", "name": "A"})]), tools, threads, one)
    invoke(Plan([Step("hr_create_user", lambda seen: {"email": "b@company.com", "name": "B"})]), tools, threads, two)
    first, second = threads.agent_run(one).run, threads.agent_run(two).run
    assert first.id != second.id and first.data["goal"] == "thread t-1"
    assert [run.status for run in (threads.commit(one), threads.commit(two))] == ["completed", "completed"]


def test_a_failed_step_is_an_error_message_and_the_sandbox_shows_the_earlier_steps_undone(unwind, tools, http_tools):
    fault("email.send", "status", status=504, times=0)
    threads = UnwindThreads(unwind)
    config = thread("welcome-sam")
    plan = onboarding("sam@company.com", "Sam Lee")
    with threads.run(config, goal="Welcome Sam") as agent_run:
        messages = invoke(plan, tools, threads, config)
    assert [m.status for m in messages] == ["success", "success", "error"]
    user, license_, failed = read(messages)
    assert failed["status"] == "failed" and failed["message"].startswith("error: email.send failed")
    assert plan.turns == [failed["message"]]
    assert eventually(lambda: agent_run.run.refresh().status == "compensated")
    assert forward(agent_run.run) == {"hr.create_user": "compensated", "licenses.provision": "compensated",
                                      "email.send": "failed"}
    assert [c["args"]["user_id"] for c in calls(http_tools, "hr.delete_user")] == [user["id"]]
    assert [c["args"]["license_id"] for c in calls(http_tools, "licenses.revoke")] == [license_["id"]]


def test_approval_pending_is_a_message_the_model_reads_and_the_thread_keeps_its_run(unwind, tools, http_tools):
    threads = UnwindThreads(unwind)
    config = thread("zoe")
    with threads.run(config, goal="Onboard Zoë") as agent_run:
        user, pending = read(invoke(onboarding("zoe@company.com", "Zoë", charge=True), tools, threads, config))
    assert pending["status"] == "pending_approval" and pending["message"].startswith("pending approval at ")
    assert pending["approval_url"].startswith(f"{http_tools.live_server.url}/approvals/")
    assert agent_run.run.refresh().status == "awaiting_approval"
    approve_or_reject(http_tools, pending["action_id"], "alice", "approve", "as agreed")
    with threads.run(config) as again:
        assert again is agent_run  # the thread's run stayed open for the decision
        replayed, charge = read(invoke(onboarding("zoe@company.com", "Zoë", charge=True), tools, threads, config))
    assert replayed == user and charge["status"] == "captured"
    assert agent_run.run.refresh().status == "completed"
    assert len(calls(http_tools, "payments.charge")) == 1 and len(calls(http_tools, "hr.create_user")) == 1


def test_a_rejection_is_a_message_with_the_reason(unwind, tools, http_tools):
    threads = UnwindThreads(unwind)
    config = thread("zoe")
    with threads.run(config, goal="Upgrade Zoë") as agent_run:
        user, pending = read(invoke(onboarding("zoe@company.com", "Zoë", charge=True), tools, threads, config))
    approve_or_reject(http_tools, pending["action_id"], "ben", "reject", "not this month")
    plan = onboarding("zoe@company.com", "Zoë", charge=True)
    with threads.run(config):
        [rejected] = read(invoke(plan, tools, threads, config))
    assert rejected["status"] == "rejected" and rejected["reason"] == "not this month"
    assert plan.turns == [rejected["message"]] and rejected["message"].startswith("rejected: not this month.")
    assert eventually(lambda: agent_run.run.refresh().status == "compensated")
    assert [c["args"]["user_id"] for c in calls(http_tools, "hr.delete_user")] == [user["id"]]


def test_a_refusal_is_a_message_and_the_model_tries_other_arguments(unwind, tools, http_tools):
    threads = UnwindThreads(unwind)
    config = thread("ticket")
    plan = Plan([Step("crm_update_ticket", lambda seen: {"ticket_id": "T-9999", "priority": "high"},
                      instead=lambda seen: {"ticket_id": "T-204", "priority": "high"})], done="Ticket raised.")
    with threads.run(config, goal="Raise the ticket") as agent_run:
        messages = invoke(plan, tools, threads, config)
    refused, updated = read(messages)
    assert messages[0].status == "success"  # a refusal is an answer to act on, not an error of the graph
    assert refused["message"] == f"refused: {refused['reason']}; try other arguments" and "T-9999" in refused["reason"]
    assert updated["priority"] == "high" and plan.turns == ["Ticket raised."]
    assert agent_run.run.refresh().status == "completed"
    ticket = requests.get(f"{http_tools.live_server.url}/sandbox/crm/tickets/T-204", auth=("victor", "pw-victor"),
                          timeout=5).json()
    assert ticket["priority"] == "high"


def test_an_exception_in_the_graph_rolls_the_threads_run_back(unwind, tools, http_tools):
    class Crash(Plan):
        def next(self, seen):
            if seen:
                raise LookupError("the model lost track")
            return super().next(seen)

    threads = UnwindThreads(unwind)
    config = thread("crash")
    with pytest.raises(LookupError), threads.run(config, goal="crashes") as agent_run:
        invoke(Crash([Step("hr_create_user", lambda seen: {"email": "x@company.com", "name": "X"})]), tools, threads,
               config)
    run = agent_run.run.refresh()
    assert run.status == "compensated" and run.data["cancel_requested_at"]
    assert len(calls(http_tools, "hr.delete_user")) == 1


def test_a_graph_without_a_thread_id_is_refused_before_anything_is_done(unwind, tools, http_tools):
    threads = UnwindThreads(unwind)
    [create] = langchain_tools([t for t in tools if t.name == "hr.create_user"], threads)
    with pytest.raises(UnwindClientError, match="thread_id"):
        create.invoke({"email": "x@company.com", "name": "X"}, {"configurable": {}})
    assert Run.objects.count() == 0 and calls(http_tools, "hr.create_user") == []


def test_the_example_graph_onboards_unwinds_and_waits_for_approval(http_tools, settings):
    from examples import langgraph_agent

    settings.UNWIND_THROTTLE_RATE = "100000/min"
    lines = []
    code = langgraph_agent.main(["--url", http_tools.live_server.url, "--key", http_tools.key,
                                 "--approver", "alice:pw-alice", "--operator", "oscar:pw-oscar"], say=lines.append)
    output = "\n".join(lines)
    assert code == 0, output
    assert "model: Ashu Kumar is onboarded." in output and "model: error: email.send failed" in output
    assert "model: pending approval at " in output and "alice approved" in output
    assert dict(Run.objects.values_list("goal", "status")) == {
        "Onboard Ashu Kumar": "completed", "Onboard Sam Lee": "compensated",
        "Onboard Zoë Martin on the annual plan": "completed"}


def test_the_prebuilt_react_agent_with_the_adapters_tool_node_run_asynchronously(unwind, tools, http_tools):
    import asyncio
    import warnings

    from langgraph.prebuilt import create_react_agent

    from unwind_client.langgraph import tool_node

    threads = UnwindThreads(unwind)
    config = thread("react")
    plan = Plan([Step("hr_create_user", lambda seen: {"email": "r@company.com", "name": "R"}),
                 Step("licenses_provision", lambda seen: {"user_id": seen["hr_create_user"]["id"]})], done="ok")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # langgraph 1.x points to langchain's create_agent; the prebuilt one works
        graph = create_react_agent(ScriptedChatModel(plan=plan), tools=tool_node(tools, threads))
    with threads.run(config, goal="react") as agent_run:
        state = asyncio.run(graph.ainvoke({"messages": [("user", "go")]}, config))
    assert state["messages"][-1].content == "ok"
    assert forward(agent_run.run) == {"hr.create_user": "succeeded", "licenses.provision": "succeeded"}
    assert agent_run.run.status == "completed" and len(calls(http_tools, "licenses.provision")) == 1
