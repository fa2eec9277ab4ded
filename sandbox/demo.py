"""The demo scenarios (seeds 000, 001, 003, 004), driven as an agent would: the Python client over HTTP.

Each scenario returns a list of Checks: what was expected, what the ledger and the sandbox world
say, and whether they agree. `manage.py demo --check` exits non-zero when any check disagrees.
The last run is left waiting for a person's decision on its charge (`waiting_in_the_inbox`); its agent
waits for that decision in a thread of its own and finishes the run after it, whenever it comes.

The demo reads and steers the demo tenant's sandbox world as its operator (HTTP Basic), and plays the
other systems that change the world behind the agent's back with tool calls signed for the tenant, as
Unwind signs its own.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import json
import re

import requests

from ledger.executors import signing
from sandbox.crawl import login
from unwind_client import ApprovalPending, InFlight, Refused, Rejected, Unwind, UnwindClientError, Unwound


@dataclass
class Check:
    scenario: str
    what: str
    expected: object
    observed: object

    @property
    def ok(self) -> bool:
        return self.expected == self.observed


@dataclass
class Context:
    base_url: str
    key: str  # the demo agent's API key
    client: Unwind
    approve: Callable[[int, bool, str], None]  # (action_id, approve?, reason) as a person would
    tenant: str  # the demo tenant's slug: the sandbox world the scenarios act in
    operator: tuple[str, str]  # (username, password) of the tenant's operator, for the sandbox's controls
    hold: Callable[[str, object], None]  # (tool, hold or None): the tenant's admin writes a tool's hold
    notice_link: Callable[[int], str]  # run id -> the trail link its held-step notice email carries ("" if none)
    checks: list[Check] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)

    def sandbox(self, method: str, path: str, **payload) -> dict:
        """Read or steer the tenant's sandbox world as its operator."""
        response = requests.request(method, f"{self.base_url}/sandbox/{path}", json=payload or None,
                                    auth=self.operator, timeout=10)
        response.raise_for_status()
        return response.json()

    def tool(self, path: str, **payload) -> dict:
        """Call a sandbox tool directly, as another system would, signed for the tenant."""
        url = f"{self.base_url}/sandbox/{path}"
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json",
                   **signing.sign(tenant=self.tenant, method="POST", url=url, body=body)}
        response = requests.post(url, data=body, headers=headers, timeout=10)
        response.raise_for_status()
        return response.json()

    def fault(self, tool: str, **rule) -> None:
        self.sandbox("POST", "faults", tool=tool, **rule)

    def run_status(self, run_id: int, *, settle: bool = True, timeout: float = 20.0) -> str:
        """The run's status once it stops moving (unwinds finish in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.client.get_run(run_id).status
            if not settle or status not in ("unwinding", "running", "awaiting_approval") or time.monotonic() > deadline:
                return status
            time.sleep(0.1)

    def expect(self, scenario: str, what: str, expected, observed) -> None:
        self.checks.append(Check(scenario, what, expected, observed))


def onboarding(ctx: Context) -> None:
    """Seed 001: create user, provision license, the welcome email fails 504 after its retries."""
    s = "1 onboarding"
    ctx.fault("email.send", mode="status", status=504, times=0)
    run = ctx.client.run(goal="Onboard new hire Ashu Kumar (ashu@company.com)", on_behalf_of="hr@company.com",
                              plan=["hr.create_user", "licenses.provision", "email.send"])
    ctx.runs[s] = run.id
    user = run.act("hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"},
                   intent={"goal": "create the HR record", "confidence": 0.97})
    run.act("licenses.provision", {"user_id": user["id"], "sku": "workspace-standard"},
            intent={"goal": "give Ashu a workspace", "confidence": 0.95})
    try:
        run.act("email.send", {"to": "ashu@home.example", "subject": "Welcome to the team", "body": "Hi Ashu!"})
        ctx.expect(s, "welcome email", "fails with 504", "sent")
    except Unwound as unwound:
        ctx.expect(s, "welcome email", "fails with 504", "fails with 504" if unwound.error_class == "http_504" else str(unwound))
    ctx.sandbox("POST", "faults/clear", tool="email.send")
    ctx.expect(s, "run ends", "compensated", ctx.run_status(run.id))
    world = ctx.sandbox("GET", "state")
    ctx.expect(s, "users left in HR", 0, len(world["users"]))
    ctx.expect(s, "active licenses", 0, sum(1 for lic in world["licenses"] if lic["status"] == "active"))
    undo = [a["tool"] for a in ctx.client.get_run(run.id).data["actions"] if a["kind"] == "compensation"]
    ctx.expect(s, "compensations, newest first", ["licenses.revoke", "hr.delete_user"], undo)


def travel(ctx: Context) -> None:
    """Seed 000: flight and hotel (compensatable), the charge (pivot, approved by a person), the confirmation (retriable)."""
    s = "2 travel"
    # A hotel failure unwinds the flight before any charge.
    ctx.fault("travel.reserve_hotel", mode="status", status=409)
    run = ctx.client.run(goal="Trip to Lisbon, 3 nights", on_behalf_of="carol@company.com")
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "TP1351", "date": "2026-12-04"})
    try:
        run.act("travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Avenida", "nights": 3})
    except Unwound:
        pass
    ctx.expect(s, "hotel failure: run ends", "compensated", ctx.run_status(run.id))
    world = ctx.sandbox("GET", "state")
    ctx.expect(s, "hotel failure: flight", ["cancelled"], [f["status"] for f in world["flights"]])
    ctx.expect(s, "hotel failure: charges", 0, len(world["charges"]))

    # The charge before the hotel: the ordering law refuses the hotel.
    run = ctx.client.run(goal="Trip to Porto", on_behalf_of="carol@company.com")
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "TP1942", "date": "2026-12-10"})
    try:
        run.act("payments.charge", {"customer": "cus_carol", "amount_cents": 48000, "currency": "EUR"})
    except ApprovalPending:
        pass
    try:
        run.act("travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Infante", "nights": 2})
        ctx.expect(s, "hotel after the charge", "refused: ordering_violation", "accepted")
    except Refused as refused:
        ctx.expect(s, "hotel after the charge", "refused: ordering_violation", f"refused: {refused.code}")
    run.cancel()
    ctx.expect(s, "refused run, cancelled", "compensated", ctx.run_status(run.id))

    # The happy path with a person approving the charge and a flaky confirmation after the pivot.
    run = ctx.client.run(goal="Trip to Madrid", on_behalf_of="carol@company.com",
                              plan=["travel.book_flight", "travel.reserve_hotel", "payments.charge", "email.send"])
    ctx.runs[s] = run.id
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "IB3117", "date": "2026-12-18"})
    run.act("travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Urban", "nights": 2})
    try:
        run.act("payments.charge", {"customer": "cus_carol", "amount_cents": 61000, "currency": "EUR"},
                intent={"goal": "pay for the Madrid trip", "reasoning": "flight and hotel are booked", "confidence": 0.93})
        ctx.expect(s, "charge", "waits for approval", "ran without approval")
    except ApprovalPending as pending:
        ctx.approve(pending.action_id, True, "")
        charge = pending.wait(timeout=20)
        ctx.expect(s, "charge", "waits for approval", "waits for approval")
        ctx.expect(s, "charge captured after approval", "captured", charge.get("status"))
    ctx.fault("email.send", mode="status", status=503, times=2)
    ctx.hold("email.send", HOLD)  # the confirmation waits 3 s in case someone stops it; nobody does
    run.act("email.send", {"to": "carol@company.com", "subject": "Your Madrid trip", "body": "Booked and paid."})
    detail = ctx.client.get_run(run.id).data
    confirmation = [a for a in detail["actions"] if a["tool"] == "email.send"][0]
    ctx.expect(s, "confirmation after the pivot", "succeeded after 3 attempts",
               f"{confirmation['status']} after {confirmation['attempts']} attempts")
    events = ctx.client.request("GET", f"/api/v1/runs/{run.id}/events?limit=200").json()["results"]
    ctx.expect(s, "confirmation held 3 s, nobody stopped it", True,
               any(e["kind"] == "forward.held" and e["action"] == confirmation["id"] for e in events))
    ctx.expect(s, "no compensation after the pivot", 0, sum(1 for a in detail["actions"] if a["kind"] == "compensation"))
    run.complete()
    ctx.expect(s, "run ends", "completed", ctx.run_status(run.id))
    ctx.hold("email.send", None)
    held_and_stopped(ctx)


HOLD = {"for": "3s", "customer_can_stop": True}


def held_and_stopped(ctx: Context) -> None:
    """The confirmation held for a moment (hold: 3s, customer_can_stop): Carol stops one from her trail page."""
    s = "2 travel"
    ctx.hold("email.send", HOLD)
    run = ctx.client.run(goal="Trip to Seville", on_behalf_of="carol@company.com")
    ctx.runs["2 travel, stopped"] = run.id
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "IB1702", "date": "2027-01-15"})
    run.act("travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Alfonso", "nights": 2})
    try:
        run.act("payments.charge", {"customer": "cus_carol", "amount_cents": 39000, "currency": "EUR"})
    except ApprovalPending as pending:
        ctx.approve(pending.action_id, True, "")
        pending.wait(timeout=20)
    subject = "Your Seville trip"
    try:
        run.act("email.send", {"to": "carol@company.com", "subject": subject, "body": "Booked and paid."}, timeout=0)
        ctx.expect(s, "Seville confirmation", "held", "sent at once")
        return
    except InFlight as held:
        ctx.expect(s, "Seville confirmation", "held", ctx.client.action(held.action_id)["status"])
        link = ctx.notice_link(run.id)
        ctx.expect(s, "Carol is emailed her trail link", True, bool(link))
        page = requests.get(link, timeout=10)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        form = re.search(r'<form method="post" action="([^"]+/stop/\d+/)"', page.text)
        session_cookie = page.cookies
        if token and form:
            requests.post(ctx.base_url + form.group(1), data={"csrfmiddlewaretoken": token.group(1)},
                          cookies=session_cookie, headers={"Referer": link}, timeout=20)
        try:
            held.wait(timeout=20)
            ctx.expect(s, "Carol stops it from her trail page", "stopped by the customer", "sent")
        except Rejected as stopped:
            ctx.expect(s, "Carol stops it from her trail page", "stopped by the customer",
                       f"stopped by the {stopped.action.get('stopped_by')}")
    ctx.expect(s, "Seville run ends without it", "completed", ctx.run_status(run.id))
    sent = ctx.sandbox("GET", "email/messages?to=carol@company.com")["results"]
    ctx.expect(s, "Seville confirmation never sent", 0, sum(1 for m in sent if m["subject"] == subject))
    trail = requests.get(link, timeout=10).text if link else ""
    ctx.expect(s, "her trail says she stopped it", True, "You stopped this step while it was waiting" in trail)
    ctx.hold("email.send", None)


def crm(ctx: Context) -> None:
    """Seed 003: a priority change to the wrong ticket is restored; a drifted ticket is not overwritten."""
    s = "3 crm"
    run = ctx.client.run(goal="Escalate the invoice bug", on_behalf_of="support@company.com")
    run.act("crm.update_ticket", {"ticket_id": "T-204", "priority": "high"},
            intent={"goal": "escalate", "reasoning": "customer is blocked", "confidence": 0.6})
    run.cancel(reason="wrong ticket: the login bug was meant")
    ctx.expect(s, "wrong ticket: run ends", "compensated", ctx.run_status(run.id))
    ticket = ctx.sandbox("GET", "crm/tickets/T-204")
    ctx.expect(s, "T-204 priority restored", "normal", ticket["priority"])

    run = ctx.client.run(goal="Escalate the login bug", on_behalf_of="support@company.com")
    ctx.runs[s] = run.id
    run.act("crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    ctx.tool("crm/tickets/update", ticket_id="T-182", status="pending", note="customer replied", updated_by="dana")
    run.cancel(reason="the agent should not have escalated")
    ctx.expect(s, "drift: run ends", "needs_attention", ctx.run_status(run.id))
    ticket = ctx.sandbox("GET", "crm/tickets/T-182")
    ctx.expect(s, "drift: dana's change kept", ("high", "pending"), (ticket["priority"], ticket["status"]))


def email_correction(ctx: Context) -> None:
    """Seed 004: an email cannot be unsent; its compensation is a correction email."""
    s = "4 email"
    run = ctx.client.run(goal="Tell the customer their export ticket is escalated", on_behalf_of="support@company.com")
    ctx.runs[s] = run.id
    run.act("crm.update_ticket", {"ticket_id": "T-311", "priority": "urgent"})
    run.act("email.send", {"to": "customer@example.com", "subject": "Your ticket T-311 is now urgent",
                           "body": "We escalated your ticket."})
    run.cancel(reason="escalation was not approved by the account manager")
    ctx.expect(s, "run ends", "compensated", ctx.run_status(run.id))
    messages = ctx.sandbox("GET", "email/messages?to=customer@example.com")["results"]
    ctx.expect(s, "emails to the customer", ["Your ticket T-311 is now urgent", "Correction: Your ticket T-311 is now urgent"],
               [m["subject"] for m in sorted(messages, key=lambda m: m["sent_at"])])
    ctx.expect(s, "T-311 priority restored", "low", ctx.sandbox("GET", "crm/tickets/T-311")["priority"])


def charge_rules(ctx: Context) -> None:
    """Issue 28: a rule reads the amount: a small charge runs at once, a large one asks a person, and says why."""
    s = "5 rules"
    run = ctx.client.run(goal="Add a seat to Carol's flight", on_behalf_of="carol@company.com")
    seat = run.act("payments.capture", {"customer": "cus_carol", "amount_cents": 2500, "currency": "EUR"})
    ctx.expect(s, "small charge runs without a person", "captured", seat.get("status"))
    run.complete()
    run = ctx.client.run(goal="Upgrade Carol to business class", on_behalf_of="carol@company.com")
    ctx.runs[s] = run.id
    try:
        run.act("payments.capture", {"customer": "cus_carol", "amount_cents": 48000, "currency": "EUR"})
        ctx.expect(s, "large charge", "waits for approval", "ran without approval")
    except ApprovalPending as pending:
        ctx.expect(s, "large charge", "waits for approval", "waits for approval")
        step = next(a for a in ctx.client.get_run(run.id).data["actions"] if a["id"] == pending.action_id)
        fired = [rule["reason"] for rule in (step["policy_decision"] or {}).get("fired", [])]
        ctx.expect(s, "why a person is asked", ["charges above 100.00 need a person"], fired)
        ctx.approve(pending.action_id, True, "")
        ctx.expect(s, "large charge captured after approval", "captured", pending.wait(timeout=20).get("status"))
    run.complete()
    ctx.expect(s, "run ends", "completed", ctx.run_status(run.id))


@dataclass
class Waiting:
    """The demo's last run, left for a person to decide its charge, and what its agent saw once they had."""

    run_id: int
    action_id: int
    approval_id: int
    finished: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""  # "completed", or why the agent had nothing left to do


def waiting_in_the_inbox(ctx: Context) -> Waiting | None:
    """A charge left for a person to approve or reject in the inbox; its agent waits for them in the background."""
    run = ctx.client.run(goal="Trip to Berlin", on_behalf_of="carol@company.com")
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "LH1169", "date": "2027-01-08"})
    run.act("travel.reserve_hotel", {"guest": "Carol", "hotel": "Hotel Adlon", "nights": 2})
    try:
        run.act("payments.charge", {"customer": "cus_carol", "amount_cents": 92000, "currency": "EUR"},
                intent={"goal": "pay for the Berlin trip", "reasoning": "flight and hotel are booked", "confidence": 0.88})
    except ApprovalPending as pending:
        ctx.runs["7 inbox"] = run.id
        waiting = Waiting(run_id=run.id, action_id=pending.action_id, approval_id=pending.approval_id)
        threading.Thread(target=finish_after_the_decision, args=(Unwind(ctx.base_url, ctx.key), waiting),
                         name="demo-agent", daemon=True).start()
        return waiting
    return None


def finish_after_the_decision(agent: Unwind, waiting: Waiting) -> None:
    """The Berlin run's agent, with a client of its own: it waits as long as it takes for a person to decide its
    charge. Approved, the charge runs and the agent completes the run, so its trail says the task is done. Rejected
    (or expired), Unwind unwinds the hotel and the flight by the saga law, and the agent has nothing left to do.
    A demo stopped meanwhile ends the wait (the server is gone); the run is left as it stands."""
    try:
        agent.settle(agent.wait_for(waiting.action_id, timeout=None), timeout=None)
        agent.get_run(waiting.run_id).complete()
        waiting.outcome = "completed"
    except Rejected as refused:
        waiting.outcome = f"{refused.action.get('status')}: {refused.reason}; Unwind unwinds the run"
    except Unwound as failed:
        waiting.outcome = f"the charge did not go through ({failed.error_class or failed.action.get('status')}); " \
                          f"the run is {failed.run_status}"
    except UnwindClientError as gone:
        waiting.outcome = f"stopped waiting: {gone}"
    finally:
        waiting.finished.set()


def approved_in_the_inbox(ctx: Context, waiting: Waiting | None, approver: tuple[str, str],
                          operator: tuple[str, str]) -> None:
    """What the README invites (demo --check does it): the approver approves the waiting €920.00 charge on its page,
    the demo's agent completes its run, and the run's correction trail, opened from a share link, says so."""
    s = "7 inbox"
    if waiting is None:
        ctx.expect(s, "a charge waits in the inbox", True, False)
        return
    person = login(ctx.base_url, *approver)
    page = f"{ctx.base_url}/approvals/{waiting.approval_id}/"
    ctx.expect(s, "the €920.00 charge waits on its page", True, "€920.00" in person.get(page, timeout=10).text)
    answer = person.post(f"{page}decide/", data={"csrfmiddlewaretoken": person.cookies.get("csrftoken", ""),
                                                 "decision": "approve"},
                         headers={"Referer": page}, timeout=30, allow_redirects=False)
    ctx.expect(s, "approved on its page", 302, answer.status_code)
    waiting.finished.wait(timeout=30)
    ctx.expect(s, "the agent completes its run", "completed", waiting.outcome or "still waiting after 30 s")
    ctx.expect(s, "run ends", "completed", ctx.run_status(waiting.run_id))
    charge = ctx.client.action(waiting.action_id).get("result") or {}
    ctx.expect(s, "charge captured", "captured", charge.get("status"))
    staff = login(ctx.base_url, *operator)
    run_page = f"{ctx.base_url}/console/runs/{waiting.run_id}/"
    staff.get(run_page, timeout=10)
    shared = staff.post(f"{run_page}trail/links/", data={"csrfmiddlewaretoken": staff.cookies.get("csrftoken", "")},
                        headers={"Referer": run_page}, timeout=10)
    link = re.search(r"https?://[^\s\"<]+/console/trail/[A-Za-z0-9_-]{43}/", shared.text)
    trail = requests.get(link.group(0), timeout=10).text if link else ""
    said = [words for words in ("The agent finished the task", "still working") if words in trail]
    ctx.expect(s, "her trail says the task is done", ["The agent finished the task"], said)


# --- issue 38: every button obeys the saga law, every sentence matches what happened ------------------------

def half_undone(ctx: Context) -> None:
    """Seed 001 with undoing failing too: Resume is refused (409), the undos are retried instead. The license service
    refuses the revoke (a 409): a person is asked at once. (A 503 would be waited out first, for up to
    UNWIND_RETRY_PATIENCE, as an outage of the undo's tool is.)"""
    s = "6 law"
    ctx.fault("licenses.revoke", mode="status", status=409, times=0)
    ctx.fault("email.send", mode="status", status=504, times=0)
    run = ctx.client.run(goal="Onboard Bea Rossi (bea@company.com)", on_behalf_of="hr@company.com")
    ctx.runs[s] = run.id
    user = run.act("hr.create_user", {"email": "bea@company.com", "name": "Bea Rossi"})
    run.act("licenses.provision", {"user_id": user["id"], "sku": "workspace-standard"})
    try:
        run.act("email.send", {"to": "bea@home.example", "subject": "Welcome", "body": "Hi Bea!"})
    except Unwound:
        pass
    ctx.expect(s, "half-undone run waits for a person", "needs_attention", ctx.run_status(run.id))
    ctx.sandbox("POST", "faults/clear", tool="email.send")
    items = requests.get(f"{ctx.base_url}/api/v1/recovery-items", params={"run": run.id}, auth=ctx.operator,
                         timeout=10).json()["results"]
    item = items[0]["id"] if items else 0
    resumed = requests.post(f"{ctx.base_url}/api/v1/recovery-items/{item}/resume", json={"reason": "try again"},
                            auth=ctx.operator, timeout=20)
    ctx.expect(s, "Resume after undoing began", 409, resumed.status_code)
    detail = requests.get(f"{ctx.base_url}/api/v1/recovery-items/{item}", auth=ctx.operator, timeout=10).json()
    offered = {move["name"]: move for move in detail.get("moves", [])}
    ctx.expect(s, "what the item offers instead", "Retry the failed undos",
               offered.get("compensate", {}).get("label"))
    sent = ctx.sandbox("GET", "email/messages?to=bea@home.example")["results"]
    ctx.expect(s, "no welcome email for the deleted account", 0, len(sent))
    ctx.sandbox("POST", "faults/clear", tool="licenses.revoke")
    requests.post(f"{ctx.base_url}/api/v1/recovery-items/{item}/compensate", json={"reason": "revoke works again"},
                  auth=ctx.operator, timeout=20)
    ctx.expect(s, "retrying the undos settles it", "compensated", ctx.run_status(run.id))


def stop_says_what_it_undoes(ctx: Context) -> None:
    """Carol's Stop on a held email before the pivot: the page says it also cancels the flight, then that she
    decided."""
    s = "6 law"
    ctx.hold("email.send", HOLD)
    run = ctx.client.run(goal="Flight to Porto", on_behalf_of="carol@company.com")
    run.act("travel.book_flight", {"passenger": "Carol", "flight": "TP1947", "date": "2027-02-03"})
    try:
        run.act("email.send", {"to": "carol@company.com", "subject": "Your Porto flight", "body": "Booked."},
                timeout=0)
        ctx.expect(s, "Porto confirmation", "held", "sent at once")
        return
    except InFlight as held:
        link = ctx.notice_link(run.id)
        page = requests.get(link, timeout=10) if link else None
        said = "Stopping it also undoes what was done before it: we booked flight TP1947 on 2027-02-03 for Carol."
        ctx.expect(s, "the Stop button says it also cancels the flight", True, bool(page) and said in page.text)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text) if page else None
        form = re.search(r'<form method="post" action="([^"]+/stop/\d+/)"', page.text) if page else None
        if token and form:
            requests.post(ctx.base_url + form.group(1), data={"csrfmiddlewaretoken": token.group(1)},
                          cookies=page.cookies, headers={"Referer": link}, timeout=20)
        try:
            held.wait(timeout=20)
        except Rejected:
            pass
    finally:
        ctx.hold("email.send", None)
    ctx.expect(s, "the flight is cancelled with it", "compensated", ctx.run_status(run.id))
    trail = requests.get(link, timeout=10).text if link else ""
    ctx.expect(s, "her trail says she decided", True,
               "you stopped a later step before it was taken" in trail and "No person needed" not in trail)


def the_law_on_every_button(ctx: Context) -> None:
    """A refused Resume, and a Stop that says what else it undoes (issue 38)."""
    half_undone(ctx)
    stop_says_what_it_undoes(ctx)


SCENARIOS = [onboarding, travel, crm, email_correction, charge_rules, the_law_on_every_button]
