#!/usr/bin/env python
"""An agent loop that puts every tool call through Unwind, driven by a scripted model, over real HTTP.

There is no model provider here: `ScriptedModel` stands in for one, proposing each task's next tool call
from what it has seen so far. The loop wraps the tools with the Unwind client, so the three tasks show
what happens to a step besides succeeding:

  approval   create a user, provision a license, charge the annual plan: the charge is high risk, a
             person approves it, the charge runs, the run completes.
  rejection  create a user, charge: a person rejects the charge with a reason; the agent gets that
             reason, and Unwind undoes the user it had created.
  unwind     create a user, provision a license, send the welcome email while the email service is
             down: the step fails after its retries, and Unwind revokes the license, then deletes the
             user (newest first).

Set up a server with the sandbox tools, an agent key and two approvers, then run the loop:

  export UNWIND_TASKS_SYNC=1      # background work inline; or run `manage.py worker` alongside
  .venv/bin/python manage.py migrate
  .venv/bin/python manage.py create_tenant demo
  .venv/bin/python manage.py load_tools sandbox/policy.yaml --tenant demo
  KEY=$(.venv/bin/python manage.py create_agent demo booker)
  .venv/bin/python manage.py shell -c "from examples.agent_loop import seed_people; seed_people('demo')"
  UNWIND_SANDBOX=1 .venv/bin/python manage.py runserver 8000 &
  .venv/bin/python examples/agent_loop.py --url http://127.0.0.1:8000 --key "$KEY" \\
      --approver alice:pw-alice --rejecter ben:pw-ben --operator oscar:pw-oscar

With `make demo` serving, a second terminal needs only its people (`. var/demo.env` sets the URL and key):

  . var/demo.env
  .venv/bin/python examples/agent_loop.py --approver approver:approver-demo --rejecter approver:approver-demo \\
      --operator operator:operator-demo

The email outage of the unwind task is a fault injected into the tenant's sandbox world, which only an
operator of the tenant may do: --operator names one (seed_people creates oscar).

Without --approver/--rejecter the loop prints each approval's URL and waits for a person to decide there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from unwind_client import ApprovalPending, Rejected, Unwind, Unwound

SETTLED = {"completed", "compensated", "needs_attention", "closed"}


@dataclass
class Step:
    tool: str
    args: Callable[[dict], dict]  # from the results the model has seen so far
    reasoning: str


@dataclass
class Task:
    name: str
    goal: str
    steps: list[Step]
    expect: str  # how the run should end
    on_behalf_of: str = "carol@company.com"
    verdict: str = "approve"  # what the person does when a step needs approval
    reason: str = ""
    outage: str = ""  # a tool whose service is down during this task

    @property
    def plan(self) -> list[str]:
        return [step.tool for step in self.steps]


TASKS = [
    Task("approval", "Onboard Ashu Kumar on the annual plan", expect="completed", reason="Annual plan, as agreed.", steps=[
        Step("hr.create_user", lambda seen: {"email": "ashu@company.com", "name": "Ashu Kumar"}, "HR ticket 42: new hire"),
        Step("licenses.provision", lambda seen: {"user_id": seen["hr.create_user"]["id"], "sku": "workspace-pro"},
             "new hires get a workspace license"),
        Step("payments.charge", lambda seen: {"customer": "acme-corp", "amount_cents": 120000, "currency": "EUR"},
             "the annual plan is billed up front"),
    ]),
    Task("rejection", "Upgrade Zoë to the paid plan", expect="compensated", verdict="reject",
         reason="Zoë stays on the free plan until procurement signs off.", steps=[
             Step("hr.create_user", lambda seen: {"email": "zoe@company.com", "name": "Zoë Martin"}, "HR ticket 43"),
             Step("payments.charge", lambda seen: {"customer": "acme-corp", "amount_cents": 4900, "currency": "EUR"},
                  "the upgrade is billed monthly"),
         ]),
    Task("unwind", "Welcome Sam Lee", expect="compensated", outage="email.send", steps=[
        Step("hr.create_user", lambda seen: {"email": "sam@company.com", "name": "Sam Lee"}, "HR ticket 44"),
        Step("licenses.provision", lambda seen: {"user_id": seen["hr.create_user"]["id"]}, "new hires get a license"),
        Step("email.send", lambda seen: {"to": "sam@home.example", "subject": "Welcome to Acme",
                                         "body": f"Your login is {seen['hr.create_user']['email']}."},
             "tell Sam how to log in"),
    ]),
]


class ScriptedModel:
    """Stands in for an LLM: proposes the task's next tool call from what it has observed."""

    def __init__(self, task: Task):
        self.remaining = list(task.steps)
        self.seen: dict[str, dict] = {}

    def next_call(self) -> tuple[Step, dict] | None:
        if not self.remaining:
            return None
        step = self.remaining.pop(0)
        return step, step.args(self.seen)

    def observe(self, tool: str, result: dict) -> None:
        self.seen[tool] = result


@dataclass
class People:
    """Approvers deciding through the approvals API (HTTP Basic), or a human at the printed URL."""

    base_url: str
    approver: tuple[str, str] | None = None
    rejecter: tuple[str, str] | None = None
    operator: tuple[str, str] | None = None  # injects the sandbox outages
    say: Callable[[str], None] = print
    decided: list = field(default_factory=list)

    def decide(self, pending: ApprovalPending, task: Task) -> None:
        person = self.approver if task.verdict == "approve" else self.rejecter
        if person is None:
            self.say(f"    a person must decide at {pending.url}")
            return
        response = requests.post(f"{self.base_url}/api/v1/approvals/{pending.approval_id}/{task.verdict}",
                                 json={"reason": task.reason}, auth=person, timeout=30)
        response.raise_for_status()
        self.decided.append((person[0], task.verdict))
        self.say(f"    {person[0]} {task.verdict}s{': ' + task.reason if task.reason else ''}")


def run_task(unwind: Unwind, task: Task, people: People, say: Callable[[str], None] = print) -> dict:
    say(f"\n[{task.name}] {task.goal}")
    model = ScriptedModel(task)
    intent = {"goal": task.goal, "confidence": 0.9, "model": "scripted"}
    with outage(people.base_url, task.outage, people.operator):
        try:
            with unwind.run(goal=task.goal, on_behalf_of=task.on_behalf_of, plan=task.plan) as run:
                while (call := model.next_call()) is not None:
                    step, args = call
                    say(f"  -> {step.tool} {json.dumps(args, ensure_ascii=False)}")
                    try:
                        result = run.act(step.tool, args, intent={**intent, "reasoning": step.reasoning})
                    except ApprovalPending as pending:
                        say(f"    waits for approval: {pending.url}")
                        people.decide(pending, task)
                        result = pending.wait(timeout=600)
                    say(f"    ok: {json.dumps(result, ensure_ascii=False)[:100]}")
                    model.observe(step.tool, result)
        except Rejected as rejected:
            say(f"    rejected: {rejected.reason}")
        except Unwound as unwound:
            say(f"    failed: {unwound.error}")
    deadline = time.monotonic() + 60
    while run.refresh().status not in SETTLED and time.monotonic() < deadline:
        time.sleep(0.2)
    trail = run.trail()
    say(f"  run {run.id}: {run.status}. {trail['headline']}")
    for statement in trail["statements"]:
        say(f"    - {statement['text']}")
    return {"task": task.name, "run": run.id, "status": run.status, "expected": task.expect, "trail": trail}


class outage:
    """The sandbox's email (or any) service is down for the duration of a task: every call answers 503."""

    def __init__(self, base_url: str, tool: str, operator: tuple[str, str] | None):
        self.base_url, self.tool, self.operator = base_url, tool, operator

    def __enter__(self):
        if self.tool:
            if self.operator is None:
                raise SystemExit(f"an outage of {self.tool} is injected into the sandbox by an operator: "
                                 "pass --operator username:password")
            requests.post(f"{self.base_url}/sandbox/faults", auth=self.operator, timeout=10,
                          json={"tool": self.tool, "mode": "status", "status": 503, "times": 0}).raise_for_status()

    def __exit__(self, *exc):
        if self.tool:
            requests.post(f"{self.base_url}/sandbox/faults/clear", json={"tool": self.tool}, auth=self.operator,
                          timeout=10)
        return False


def seed_people(tenant_slug: str) -> None:
    """Create the approvers alice and ben and the operator oscar (passwords pw-<name>) in a tenant.

    Run inside `manage.py shell`."""
    from django.contrib.auth import get_user_model

    from ledger.models import Tenant
    from ledger.tenancy import membership_set

    tenant = Tenant.objects.get(slug=tenant_slug)
    for name, role in (("alice", "approver"), ("ben", "approver"), ("oscar", "operator")):
        user = get_user_model().objects.filter(username=name).first() or get_user_model().objects.create_user(
            name, f"{name}@example.com", f"pw-{name}")
        membership_set(tenant=tenant, user=user, role=role)


def credentials(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    username, _, password = text.partition(":")
    return username, password


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("UNWIND_URL", "http://127.0.0.1:8000"),
                        help="the Unwind server (default: $UNWIND_URL, which `. var/demo.env` sets)")
    parser.add_argument("--key", default=os.environ.get("UNWIND_AGENT_KEY"),
                        help="the agent's API key (default: $UNWIND_AGENT_KEY; manage.py create_agent prints one)")
    parser.add_argument("--approver", help="username:password of the person who approves")
    parser.add_argument("--rejecter", help="username:password of the person who rejects")
    parser.add_argument("--operator", help="username:password of an operator, who injects the sandbox outages")
    parser.add_argument("--task", choices=[task.name for task in TASKS], action="append",
                        help="run only this task (repeatable)")
    options = parser.parse_args(argv)
    if not options.key:
        parser.error("no agent key: pass --key, or set UNWIND_AGENT_KEY (after make demo: . var/demo.env)")
    unwind = Unwind(options.url, options.key)
    people = People(options.url.rstrip("/"), credentials(options.approver), credentials(options.rejecter),
                    credentials(options.operator), say=say)
    outcomes = [run_task(unwind, task, people, say) for task in TASKS if not options.task or task.name in options.task]
    say("")
    for outcome in outcomes:
        mark = "as expected" if outcome["status"] == outcome["expected"] else f"expected {outcome['expected']}"
        say(f"{outcome['task']:<10} run {outcome['run']:<5} {outcome['status']:<16} {mark}")
    return 0 if all(outcome["status"] == outcome["expected"] for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
