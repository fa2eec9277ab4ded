"""Issue 38, finding 4, item 3: the demo's agent finishes the run it leaves waiting, once a person decides.

`make demo` leaves a €920.00 charge (the pivot of a Berlin trip) for a person to approve or reject. Its agent used
to stop there: after an approval the run stayed running, its trail said "still working", and an hour later the
idle sweep put it in the recovery queue. Now the agent waits for the decision in the background and completes the
run after an approval; after a rejection Unwind unwinds the hotel and the flight by the saga law.

The scenario runs as in the demo (sandbox/demo.py): the agent over the REST API of a live server, the sandbox's
tools over HTTP, the approver on the approval page, the operator sharing the trail, the customer reading it.
"""
import requests
from unwind_client import Unwind

from approvals.models import ApprovalRequest
from ledger.models import Run
from sandbox import demo
from sandbox.crawl import login
from sandbox.selectors import world_state

APPROVER, OPERATOR = ("alice", "pw-alice"), ("oscar", "pw-oscar")


def demo_context(world) -> demo.Context:
    base = world.live_server.url
    return demo.Context(base_url=base, key=world.key, client=Unwind(base, world.key), approve=None, tenant="acme",
                        operator=OPERATOR, hold=None, notice_link=None)


def test_approved_on_its_page_the_waiting_charge_runs_and_the_agent_completes_the_run(http_tools):
    ctx = demo_context(http_tools)
    waiting = demo.waiting_in_the_inbox(ctx)
    assert waiting is not None and not waiting.finished.is_set()  # its agent waits for a person
    assert Run.objects.get(pk=waiting.run_id).status == "awaiting_approval"

    demo.approved_in_the_inbox(ctx, waiting, approver=APPROVER, operator=OPERATOR)  # the demo's --check
    assert [(c.what, c.observed) for c in ctx.checks if not c.ok] == []
    assert [c.what for c in ctx.checks] == [
        "the €920.00 charge waits on its page", "approved on its page", "the agent completes its run", "run ends",
        "charge captured", "her trail says the task is done"]
    assert Run.objects.get(pk=waiting.run_id).status == "completed"
    world = world_state(tenant=http_tools.acme)
    assert [c["amount_cents"] for c in world["charges"]] == [92000]
    assert [h["status"] for h in world["hotels"]] == ["reserved"] and [f["status"] for f in world["flights"]] == ["booked"]


def test_rejected_on_its_page_the_run_unwinds_and_the_agent_stops(http_tools):
    ctx = demo_context(http_tools)
    waiting = demo.waiting_in_the_inbox(ctx)
    person = login(ctx.base_url, *APPROVER)
    page = f"{ctx.base_url}/approvals/{waiting.approval_id}/"
    person.get(page, timeout=10)
    answer = person.post(f"{page}decide/", headers={"Referer": page}, timeout=30, allow_redirects=False, data={
        "csrfmiddlewaretoken": person.cookies["csrftoken"], "decision": "reject", "reason": "too expensive"})
    assert answer.status_code == 302

    assert waiting.finished.wait(timeout=30)
    assert waiting.outcome == "rejected: too expensive; Unwind unwinds the run"
    assert ctx.run_status(waiting.run_id) == "compensated"
    world = world_state(tenant=http_tools.acme)
    assert world["charges"] == []  # the pivot never ran
    assert [h["status"] for h in world["hotels"]] == ["cancelled"]
    assert [f["status"] for f in world["flights"]] == ["cancelled"]
    assert ApprovalRequest.objects.get(pk=waiting.approval_id).status == "rejected"
    headline = requests.get(f"{ctx.base_url}/api/v1/runs/{waiting.run_id}/trail", timeout=10,
                            headers={"Authorization": f"Bearer {http_tools.key}"}).json()["headline"]
    assert headline == "Everything the agent changed has been undone."
