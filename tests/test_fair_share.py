"""Fair share of the inline pool: one tenant's slow tools cannot take the pool from the others.

Over real HTTP against a live server, with the real ORM task queue (not run synchronously, so that what is
handed to the worker stays visible in the queue). Tenant acme's share is one thread; its slow tool holds it,
blocked on a gate the test controls. acme's next step is then handed to the worker (202, a queued
execute_action task, the tool not called), while globex's step still runs inline (201, nothing queued).
Nothing here asserts on time: the gate decides when the slow tool finishes.
"""
import threading

import pytest
from django_q.conf import Conf
from django_q.models import OrmQ

from ledger.policy import registry
from ledger import tasks
from ledger.api import inline
from ledger.models import Action
from ledger.policy.versions import tool_upsert
from ledger.models import Tenant
from sandbox.selectors import world_state
from tests.helpers import acme as acme_tenant
from tests.test_governance import Api

GATE = threading.Event()
STARTED = threading.Event()
# The key is also the callable's import path, so the policy names it whichever way in-process tools are found.
GATED = "tests.test_fair_share.gated"


@registry.tool(GATED)
def gated(args: dict, *, idempotency_key: str, target: str | None, tenant: str) -> dict:
    STARTED.set()
    GATE.wait(60)  # bounded: a failing test leaves no thread blocked for long
    return {"done": args.get("n")}


def queued_executions() -> dict[int, tuple]:
    """The execute_action tasks waiting in the ORM broker, by action id."""
    found = {}
    for row in OrmQ.objects.all():
        task = row.task() if callable(row.task) else row.task
        if task.get("func") == "ledger.tasks.execute_action":
            found[task["args"][0]] = tuple(task["args"])
    return found


def eventually(check, what: str, timeout: float = 30.0):
    event = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        event.wait(0.02)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def shared_pool(tools, live_server, transactional_db, settings, monkeypatch):
    """acme and globex (sandbox tools in process) behind a live server; acme also has the gated slow tool."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    settings.UNWIND_INLINE_TENANT_SHARE = 1 / inline.THREADS  # one thread per tenant: the share is easy to fill
    monkeypatch.setattr(Conf, "SYNC", False)  # queue tasks in the ORM broker like production, no worker running
    tool_upsert(tenant=tools.acme, name="reports.slow", actor="test", spec={
        "description": "A slow report.", "executor": {"kind": "python", "path": GATED}, "saga_role": "retriable",
        "action_class": "internal_update", "risk": "low", "approval": "auto", "timeout": 60})
    tools.live_server = live_server
    GATE.clear()
    STARTED.clear()
    yield tools
    GATE.set()
    eventually(lambda: inline.held_by(tools.acme.pk) == 0, "acme's slow step finished")


def open_and_propose(api: Api, tool: str, args: dict):
    run = api.post("/api/v1/runs", {"goal": f"{tool} run"}).json()
    return api.post(f"/api/v1/runs/{run['id']}/actions", {"tool": tool, "args": args})


def test_a_tenant_at_its_share_goes_to_the_worker_while_another_tenant_still_runs_inline(shared_pool, settings):
    world = shared_pool
    assert inline.tenant_cap() == 1
    acme, globex = Api(world, key=world.key), Api(world, key=world.other_key)

    settings.UNWIND_INLINE_WAIT = 0.2  # the slow step answers 202 early and keeps its thread
    slow = open_and_propose(acme, "reports.slow", {"n": 1})
    assert slow.status_code == 202 and slow.json()["status"] == "running", slow.text
    assert STARTED.wait(30) and inline.held_by(world.acme.pk) == 1

    settings.UNWIND_INLINE_WAIT = 30.0  # from here an inline step settles within the request
    queued_before = queued_executions()
    handed = open_and_propose(acme, "hr.create_user", {"email": "a@acme.example", "name": "A"})
    assert handed.status_code == 202 and handed.json()["status"] == "running", handed.text
    handed_id = handed.json()["id"]
    assert handed_id in queued_executions() and handed_id not in queued_before  # the worker's, not the pool's
    # Its claim lasts while it waits in the queue, so the sweep does not take it for a lost call meanwhile.
    handed_action = Action.objects.select_related("tool").get(pk=handed_id)
    lease = (handed_action.lease_expires_at - handed_action.created_at).total_seconds()
    assert lease > handed_action.tool.timeout_seconds + settings.UNWIND_LEASE_SECONDS - 1  # not just the call's time
    assert world_state(tenant=acme_tenant())["users"] == []  # and not called yet

    other = open_and_propose(globex, "hr.create_user", {"email": "g@globex.example", "name": "G"})
    assert other.status_code == 201 and other.json()["status"] == "succeeded", other.text  # inline, in the request
    assert other.json()["id"] not in queued_executions()

    GATE.set()
    eventually(lambda: inline.held_by(world.acme.pk) == 0, "acme's share given back when its slow step ended")
    assert Action.objects.get(pk=slow.json()["id"]).status == "succeeded"
    again = open_and_propose(acme, "hr.create_user", {"email": "b@acme.example", "name": "B"})
    assert again.status_code == 201 and again.json()["status"] == "succeeded"  # inline again

    # The worker runs the handed-over step as it runs any queued one: once, with the claim it was given.
    tasks.execute_action(*queued_executions()[handed_id])
    assert Action.objects.get(pk=handed_id).status == "succeeded"
    assert sorted(u["email"] for u in world_state(tenant=acme_tenant())["users"]) == ["a@acme.example", "b@acme.example"]
    globex = Tenant.objects.get(slug="globex")
    assert [u["email"] for u in world_state(tenant=globex)["users"]] == ["g@globex.example"]


def test_the_default_share_is_half_the_pool(settings):
    settings.UNWIND_INLINE_TENANT_SHARE = 0.5
    assert inline.tenant_cap() == inline.THREADS // 2
    settings.UNWIND_INLINE_TENANT_SHARE = 0.001
    assert inline.tenant_cap() == 1  # a tenant always gets at least one thread


def test_a_slot_is_given_back_when_nothing_was_submitted():
    with inline.tenant_slot(424242) as slot:
        assert slot is not None and inline.held_by(424242) == 1
    assert inline.held_by(424242) == 0
    with pytest.raises(RuntimeError):
        with inline.tenant_slot(424242):
            raise RuntimeError("a refused proposal")
    assert inline.held_by(424242) == 0


@pytest.mark.parametrize("value", ["0", "1.5", "-0.5", "half"])
def test_a_share_outside_the_pool_fails_loudly_at_start(value):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "UNWIND_INLINE_TENANT_SHARE": value, "DJANGO_SETTINGS_MODULE": "config.settings"}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode != 0 and "UNWIND_INLINE_TENANT_SHARE must" in started.stderr
