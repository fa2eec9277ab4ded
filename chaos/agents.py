"""Agents: threads that run mixed sagas through Unwind's HTTP API with the Python client, as real agents do,
misbehaving the way real ones do (duplicate concurrent requests, re-synthesised requests, giving up mid-run),
and recording what they were told so the checks can hold the ledger to it.
"""
from __future__ import annotations

import itertools
import json
import random
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from chaos.world import sandbox_tool
from unwind_client import Unwind
from unwind_client.errors import (
    ApprovalPending,
    InFlight,
    Refused,
    Rejected,
    ReportRequired,
    Unavailable,
    UnwindClientError,
    Unwound,
)

_numbers = itertools.count(1)
SETTLED_BY_CANCEL = {"run_cancelled", "run_not_active"}
# Each run's idle deadline, at its minimum: a run whose agent dies mid-saga is unwound by the worker's sweep a
# minute after its last activity, and the drain waits for that (runner.settled).
IDLE_TIMEOUT = 60


# --- sagas -----------------------------------------------------------------------------------------

def saga_steps(kind: str, n: int, rng: random.Random) -> list[tuple[str, callable]]:
    """The steps of one saga: (tool, args from the results so far)."""
    if kind == "onboarding":
        email = f"user{n}@chaos.invalid"
        return [
            ("hr.create_user", lambda r: {"email": email, "name": f"User {n}"}),
            ("licenses.provision", lambda r: {"user_id": r["hr.create_user"]["id"], "sku": "workspace-standard"}),
            ("email.send", lambda r: {"to": email, "subject": f"Welcome aboard, user {n}", "body": "Your account is ready."}),
        ]
    if kind == "travel":
        return [
            ("travel.book_flight", lambda r: {"passenger": f"Passenger {n}", "flight": f"LH{100 + n % 800}",
                                              "date": "2027-03-01"}),
            ("travel.reserve_hotel", lambda r: {"guest": f"Passenger {n}", "hotel": "Hotel Chaos", "nights": 1 + n % 4}),
            ("payments.charge", lambda r: {"customer": f"cus_{n}", "amount_cents": 10_000 + n, "currency": "EUR"}),
            ("email.send", lambda r: {"to": f"traveller{n}@chaos.invalid", "subject": f"Itinerary {n}",
                                      "body": f"Flight {r['travel.book_flight']['booking_id']}"}),
        ]
    if kind == "crm":
        priority = rng.choice(["high", "urgent"])
        return [
            ("crm.update_ticket", lambda r: {"ticket_id": ticket_id(n), "priority": priority,
                                             "note": f"escalated by chaos agent (run {n})"}),
            ("email.send", lambda r: {"to": f"customer{n}@chaos.invalid", "subject": f"Ticket {ticket_id(n)} escalated",
                                      "body": f"Priority is now {priority}."}),
        ]
    if kind == "email":
        return [("email.send", lambda r: {"to": f"list{n}@chaos.invalid", "subject": f"Digest {n}", "body": "News."})]
    raise ValueError(kind)


SAGAS = {"onboarding": 3, "travel": 3, "crm": 2, "email": 1}  # kind -> weight


def ticket_id(n: int) -> str:
    return f"T-{100000 + n}"


def create_ticket(base_url: str, n: int) -> None:
    """The CRM ticket a crm saga escalates: part of the world, created before the run (not through Unwind)."""
    for attempt in range(20):
        try:
            response = sandbox_tool(base_url, "crm/tickets", {
                "id": ticket_id(n), "subject": f"Customer issue {n}", "priority": "normal", "updated_by": "crm"})
        except requests.RequestException:
            time.sleep(0.2 * (attempt + 1))
            continue
        if response.status_code in (201, 409):
            return
        time.sleep(0.2 * (attempt + 1))
    raise RuntimeError(f"could not create ticket {ticket_id(n)}")


# --- what the agents saw ---------------------------------------------------------------------------

@dataclass
class RunView:
    run_id: int
    saga: str
    agent: str
    actions: set = field(default_factory=set)
    ended: str = ""          # completed, cancelled, step_failed, refused:<code>, …
    anomalies: list = field(default_factory=list)


class Recorder:
    """Thread-safe record of every run and action id an agent was given, latencies and fault counters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs: dict[int, RunView] = {}
        self.latencies_ms: list[float] = []
        self.counters: Counter = Counter()
        self.steps = 0

    def opened(self, run_id: int, saga: str, agent: str) -> RunView:
        view = RunView(run_id, saga, agent)
        with self.lock:
            self.runs[run_id] = view
        return view

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counters[what] += n

    def step(self, latency_ms: float) -> None:
        with self.lock:
            self.latencies_ms.append(latency_ms)
            self.steps += 1

    def active(self) -> list[RunView]:
        with self.lock:
            return [view for view in self.runs.values() if not view.ended]

    def latency(self) -> dict:
        with self.lock:
            values = sorted(self.latencies_ms)
        if not values:
            return {"p50_ms": None, "p99_ms": None, "steps": 0}
        p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
        return {"p50_ms": round(statistics.median(values), 1), "p99_ms": round(p99, 1), "steps": len(values)}


@dataclass
class Knobs:
    """How badly the agents behave (probabilities per run or per step)."""

    abort: float = 0.06            # the agent gives up mid-run and cancels it
    concurrent_duplicate: float = 0.08   # a step is sent three times at once
    reordered_resend: float = 0.10  # a settled step is re-sent with its JSON keys in another order
    explicit_key: float = 0.5       # the step carries an Idempotency-Key (else Unwind derives one)
    step_timeout: float = 90.0      # how long an agent waits for a step before it cancels the run


# --- one agent -------------------------------------------------------------------------------------

class Agent(threading.Thread):
    def __init__(self, name: str, *, base_url: str, key: str, recorder: Recorder, stop: threading.Event,
                 knobs: Knobs, seed: int, max_runs: int | None = None, sagas: dict | None = None):
        super().__init__(name=name, daemon=True)
        self.base_url = base_url
        self.key = key
        self.recorder = recorder
        self.stop_event = stop
        self.knobs = knobs
        self.rng = random.Random(seed)
        self.max_runs = max_runs
        self.sagas = sagas or SAGAS
        self.errors: list[str] = []

    def client(self) -> Unwind:
        return Unwind(self.base_url, self.key, timeout=30, retries=8, backoff=0.2)

    def run(self) -> None:
        done = 0
        while not self.stop_event.is_set() and (self.max_runs is None or done < self.max_runs):
            try:
                self.run_one()
            except Exception as exc:  # noqa: BLE001 - an agent that dies is a finding; record it and go on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.recorder.count("agent_error")
                time.sleep(0.5)
            done += 1

    def run_one(self) -> RunView:
        n = next(_numbers)
        kind = self.rng.choices(list(self.sagas), weights=list(self.sagas.values()))[0]
        client = self.client()
        if kind == "crm":
            create_ticket(self.base_url, n)
        run = self.open(client, kind, n)
        view = self.recorder.opened(run["id"], kind, self.name)
        outcome = self.steps(client, view, saga_steps(kind, n, self.rng), n)
        view.ended = outcome
        return view

    def open(self, client: Unwind, kind: str, n: int) -> dict:
        """Open a run. Opening is not idempotent: when an answer is lost, look for the run before opening
        another, as a careful agent does (the goal names this run uniquely)."""
        goal = f"chaos {kind} #{n}"
        deadline = time.monotonic() + 60
        while True:
            try:
                return client.request("POST", "/api/v1/runs", json={
                    "goal": goal, "on_behalf_of": f"customer{n}@chaos.invalid", "idle_timeout": IDLE_TIMEOUT,
                    "intent": {"saga": kind, "n": n}}, idempotent=False).json()
            except (Unavailable, Refused) as exc:
                if isinstance(exc, Refused) and exc.status < 500 or time.monotonic() > deadline:
                    raise
                self.recorder.count("open_answer_lost")
                time.sleep(0.5)
                try:
                    recent = client.request("GET", "/api/v1/runs", params={"limit": 200}).json()["results"]
                except UnwindClientError:
                    continue
                found = next((run for run in recent if run.get("goal") == goal), None)
                if found is not None:
                    return found

    def steps(self, client: Unwind, view: RunView, steps, n: int) -> str:
        results: dict = {}
        for index, (tool, make) in enumerate(steps):
            if self.rng.random() < self.knobs.abort:
                self.recorder.count("agent_abort")
                return self.cancel(client, view.run_id, "the agent changed its mind")
            body = {"tool": tool, "args": make(results),
                    "intent": {"goal": f"step {index + 1}", "confidence": 0.9, "model": "chaos"}}
            key = f"chaos-{n}-{index}-{tool}" if self.rng.random() < self.knobs.explicit_key else None
            try:
                results[tool] = self.step(client, view, body, key)
            except Unwound:
                return "step_failed"
            except (Rejected, ApprovalPending, ReportRequired) as exc:
                view.anomalies.append(f"{tool}: unexpected {type(exc).__name__} in a tenant without approvals")
                return self.cancel(client, view.run_id, type(exc).__name__)
            except InFlight:
                self.recorder.count("agent_gave_up_waiting")
                return self.cancel(client, view.run_id, "a step did not settle in time")
            except Refused as exc:
                if exc.code in SETTLED_BY_CANCEL:
                    return f"refused:{exc.code}"
                if exc.status >= 500:
                    # The server failed mid-request (a killed process, a dropped connection): the agent
                    # gives up on this run, as a careful agent would.
                    self.recorder.count("agent_saw_5xx")
                    return self.cancel(client, view.run_id, f"server error {exc.status}")
                view.anomalies.append(f"{tool}: refused {exc.status} {exc.code}: {exc.message}")
                return self.cancel(client, view.run_id, f"refused {exc.code}")
            except Unavailable:
                self.recorder.count("agent_saw_unavailable")
                return self.cancel(client, view.run_id, "Unwind unavailable")
        return self.complete(client, view.run_id)

    def step(self, client: Unwind, view: RunView, body: dict, key: str | None):
        started = time.monotonic()
        if self.rng.random() < self.knobs.concurrent_duplicate:
            action = self.concurrent_duplicates(client, view, body, key)
        else:
            action = self.propose(client, view, body, key)
        result = client.settle(action, timeout=self.knobs.step_timeout)
        self.recorder.step((time.monotonic() - started) * 1000)
        if self.rng.random() < self.knobs.reordered_resend:
            self.resend_reordered(view, body, key, action["id"])
        return result

    def propose(self, client: Unwind, view: RunView, body: dict, key: str | None) -> dict:
        headers = {"Idempotency-Key": key} if key else None
        try:
            action = client.request("POST", f"/api/v1/runs/{view.run_id}/actions", json=body, headers=headers).json()
        except InFlight as busy:
            # Our own first attempt got through before its answer was lost: wait for it, do not redo it.
            if busy.action_id is None:
                raise
            action = client.action(busy.action_id)
        view.actions.add(action["id"])
        return action

    def concurrent_duplicates(self, client: Unwind, view: RunView, body: dict, key: str | None) -> dict:
        """The same proposal three times at once, as an agent whose retries overlap: one action, one effect."""
        self.recorder.count("concurrent_duplicate_requests")
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        url = f"{self.base_url}/api/v1/runs/{view.run_id}/actions"

        def send(_):
            try:
                response = requests.post(url, data=json.dumps(body), headers=headers, timeout=60)
            except requests.RequestException:
                return None
            try:
                return response.status_code, response.json()
            except ValueError:
                return response.status_code, {}

        with ThreadPoolExecutor(max_workers=3) as pool:
            answers = [answer for answer in pool.map(send, range(3)) if answer is not None]
        ids = {body_["id"] for status, body_ in answers if status in (200, 201, 202) and "id" in body_}
        ids |= {body_["action_id"] for status, body_ in answers
                if status == 409 and body_.get("code") == "in_flight" and body_.get("action_id")}
        if len(ids) > 1:
            view.anomalies.append(f"{body['tool']}: concurrent duplicates became {len(ids)} actions {sorted(ids)}")
        for status, answer in answers:
            if status in (200, 201, 202) and "id" in answer:
                view.actions.update(ids)
                return answer
        if ids:
            view.actions.update(ids)
            return client.action(min(ids))
        return self.propose(client, view, body, key)  # every copy was lost in transit: an ordinary retry

    def resend_reordered(self, view: RunView, body: dict, key: str | None, action_id: int) -> None:
        """After a restart the agent re-synthesises a step it already did: same content, other key order."""
        self.recorder.count("reordered_resends")
        reordered = {k: (dict(reversed(list(v.items()))) if isinstance(v, dict) else v)
                     for k, v in reversed(list(body.items()))}
        text = json.dumps(reordered, indent=1)  # other whitespace too
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        try:
            response = requests.post(f"{self.base_url}/api/v1/runs/{view.run_id}/actions", data=text,
                                     headers=headers, timeout=60)
        except requests.RequestException:
            return
        if response.status_code >= 500:
            return  # lost to a killed process: nothing was learnt
        answer = response.json() if response.content else {}
        if response.status_code != 200 or answer.get("id") != action_id or response.headers.get("Idempotent-Replayed") != "true":
            view.anomalies.append(f"{body['tool']}: re-ordered resend answered {response.status_code} "
                                  f"action {answer.get('id')} (expected a replay of {action_id})")
            if isinstance(answer.get("id"), int):
                view.actions.add(answer["id"])

    def complete(self, client: Unwind, run_id: int) -> str:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.request("POST", f"/api/v1/runs/{run_id}/complete")
                return "completed"
            except Refused as exc:
                if exc.status == 409 and "still" in exc.message and time.monotonic() < deadline:
                    time.sleep(0.5)  # a step is settling: an answer lost in transit, a late duplicate…
                    continue
                if exc.status == 409:
                    return f"not_completed:{exc.code}"  # cancelled or unwound meanwhile
                if exc.status >= 500 and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def cancel(self, client: Unwind, run_id: int, reason: str) -> str:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.request("POST", f"/api/v1/runs/{run_id}/cancel", json={"reason": reason[:900]})
                return "cancelled"
            except Refused as exc:
                if exc.status == 409:
                    return "cancelled"  # it had already finished
                if exc.status >= 500 and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


class Canceller(threading.Thread):
    """Someone cancels runs while their agents are mid-flow (through the API, as the agent's owner would)."""

    def __init__(self, *, base_url: str, key: str, recorder: Recorder, stop: threading.Event, seed: int,
                 every: tuple[float, float] = (2.0, 5.0)):
        super().__init__(name="canceller", daemon=True)
        self.client = Unwind(base_url, key, timeout=30, retries=6, backoff=0.2)
        self.recorder = recorder
        self.stop_event = stop
        self.rng = random.Random(seed)
        self.every = every

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(*self.every)):
            active = self.recorder.active()
            if not active:
                continue
            view = self.rng.choice(active)
            try:
                self.client.request("POST", f"/api/v1/runs/{view.run_id}/cancel",
                                    json={"reason": "chaos: cancelled mid-flow"})
                self.recorder.count("cancelled_mid_flow")
            except UnwindClientError:
                pass  # it finished first, or the server was down: nothing to count
