"""Scripted faults, each with its own expectation, run against the live server and workers before the load.

Each scenario returns {"name", "ok", "detail"}; its runs are checked again, with every other run, at the end.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from django.db import close_old_connections
from django.utils import timezone
from django_q.tasks import async_task, fetch

from chaos.agents import Recorder
from chaos.processes import WebServer, WorkerPool
from chaos.world import GATED_TTL_SECONDS, PASSWORD, Cast, sandbox_control
from ledger.models import Action, Attempt, Run
from ledger.engine.proposal import action_propose
from sandbox.models import Message, ToolCall
from unwind_client import Unwind
from unwind_client.errors import ApprovalPending, Unwound


def wait_until(predicate, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        close_old_connections()
        if predicate():
            return True
        time.sleep(interval)
    return False


def effects_of(action_id: int) -> int:
    action = Action.objects.select_related("tool").get(pk=action_id)
    if action.tool.name == "email.send":
        return Message.objects.filter(idempotency_key=action.tool_key).count()
    return ToolCall.objects.filter(idempotency_key=action.tool_key, effect_applied=True).count()


def run_status(run_id: int) -> str:
    return Run.objects.get(pk=run_id).status


def fault(base_url: str, rule: dict) -> None:
    """A fault in the chaos tenant's sandbox, where the scenarios' runs act."""
    sandbox_control("POST", base_url, "faults", json=rule).raise_for_status()


class Scenarios:
    def __init__(self, *, web: WebServer, workers: WorkerPool, cast: Cast, recorder: Recorder, broker=None,
                 database=None):
        self.broker = broker  # the phase's own Redis (`processes.PrivateRedis`), when Redis is the broker
        self.database = database  # the phase's own PostgreSQL (`processes.PrivatePostgres`), when it has one
        self.web = web
        self.url = web.url
        self.workers = workers
        self.cast = cast
        self.recorder = recorder
        self.agent = Unwind(self.url, cast.key, timeout=30, retries=6, backoff=0.2)

    def all(self) -> list[dict]:
        results = []
        for scenario in (self.concurrent_duplicates_with_one_key, self.reordered_json_resend, self.cancel_mid_flow,
                         self.stale_checkpoint_resumed, self.duplicate_task_delivery,
                         self.approval_expires_while_workers_are_down, self.tool_hang, self.late_answer,
                         self.tool_server_down, self.workers_frozen_past_their_leases, self.broker_lost,
                         self.database_restart, self.database_stall, self.web_frozen_past_its_lease,
                         self.failing_undo):
            started = time.monotonic()
            try:
                ok, detail = scenario()
            except Exception as exc:  # noqa: BLE001 - a scenario that blows up has failed; say how
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            results.append({"name": scenario.__name__, "ok": ok, "detail": detail,
                            "seconds": round(time.monotonic() - started, 1)})
        return results

    # --- helpers ----------------------------------------------------------------------------------

    def open_run(self, goal: str, *, client: Unwind | None = None) -> int:
        run = (client or self.agent).request("POST", "/api/v1/runs", json={"goal": goal, "on_behalf_of": "chaos"},
                                             idempotent=False).json()
        self.recorder.opened(run["id"], "scenario", "scenarios").ended = "scripted"
        return run["id"]

    def seen(self, run_id: int, *action_ids: int) -> None:
        self.recorder.runs[run_id].actions.update(action_ids)

    def post_raw(self, run_id: int, text: str, *, key: str | None = None, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key or self.cast.key}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        return requests.post(f"{self.url}/api/v1/runs/{run_id}/actions", data=text, headers=headers, timeout=60)

    def person(self, username: str) -> requests.Session:
        session = requests.Session()
        session.auth = (username, PASSWORD)
        return session

    def settle(self, action_id: int, timeout: float = 60) -> dict:
        return self.agent.wait_for(action_id, timeout=timeout)

    # --- the scenarios -----------------------------------------------------------------------------

    def concurrent_duplicates_with_one_key(self):
        """Eight identical proposals at once, with one Idempotency-Key, then eight without one: one action each."""
        run_id = self.open_run("concurrent duplicates")
        details = []
        ok = True
        for tool, args, key in [
            ("travel.book_flight", {"passenger": "Dup", "flight": "LH400", "date": "2027-04-01"}, "scenario-dup-flight"),
            ("email.send", {"to": "dup@chaos.invalid", "subject": "Only once", "body": "b"}, None),
        ]:
            text = json.dumps({"tool": tool, "args": args})
            with ThreadPoolExecutor(max_workers=8) as pool:
                answers = list(pool.map(lambda _, text=text, key=key: self.post_raw(run_id, text, key=key), range(8)))
            statuses = sorted(a.status_code for a in answers)
            ids = {a.json().get("id") or a.json().get("action_id") for a in answers if a.status_code in (200, 201, 202, 409)}
            ids.discard(None)
            self.seen(run_id, *ids)
            fresh = sum(1 for s in statuses if s in (201, 202))
            if len(ids) != 1 or fresh != 1 or any(s not in (200, 201, 202, 409) for s in statuses):
                ok = False
                details.append(f"{tool}: answers {statuses} for actions {sorted(ids)}")
                continue
            action_id = ids.pop()
            self.settle(action_id)
            effects = effects_of(action_id)
            details.append(f"{tool}: answers {statuses}, one action, {effects} effect(s)")
            ok = ok and effects == 1
        self.agent.get_run(run_id).complete()
        return ok, "; ".join(details)

    def reordered_json_resend(self):
        """A request re-synthesised after a restart: same content, keys in another order, other whitespace and
        escapes, no Idempotency-Key. Unwind derives the same key: a replay, not a second user."""
        run_id = self.open_run("re-synthesised request")
        first = self.post_raw(run_id, '{"tool": "hr.create_user", "args": {"email": "jurgen@chaos.invalid", "name": "J\u00fcrgen"}}')
        again = self.post_raw(run_id, '{\n  "args": {"name": "J\\u00fcrgen",\n "email": "jurgen@chaos.invalid"},\n  "tool": "hr.create_user"\n}')
        self.seen(run_id, first.json()["id"], again.json().get("id", first.json()["id"]))
        self.settle(first.json()["id"])
        ok = (first.status_code in (201, 202) and again.status_code in (200, 409)
              and again.json().get("id", again.json().get("action_id")) == first.json()["id"])
        if again.status_code == 200:
            ok = ok and again.headers.get("Idempotent-Replayed") == "true"
        effects = effects_of(first.json()["id"])
        self.agent.get_run(run_id).complete()
        return ok and effects == 1, (f"first {first.status_code} action {first.json()['id']}, resend {again.status_code} "
                                     f"action {again.json().get('id', again.json().get('action_id'))}, {effects} effect(s)")

    def cancel_mid_flow(self):
        """The run is cancelled while its hotel booking is in flight; the booking lands after the cancel and is
        compensated with the flight: the run ends compensated, nothing left booked."""
        run_id = self.open_run("cancelled mid-flow")
        run = self.agent.get_run(run_id)
        run.act("travel.book_flight", {"passenger": "Cancel", "flight": "LH401", "date": "2027-04-02"})
        fault(self.url, {"tool": "travel.reserve_hotel", "mode": "latency", "ms": 3000})
        outcome = {}

        def reserve():
            try:
                outcome["result"] = run.act("travel.reserve_hotel", {"guest": "Cancel", "hotel": "H", "nights": 2})
            except Exception as exc:  # noqa: BLE001 - any ending is fine; the ledger and world decide
                outcome["error"] = type(exc).__name__

        thread = threading.Thread(target=reserve)
        thread.start()
        time.sleep(1.0)
        run.cancel("the customer changed their plans")
        thread.join(timeout=120)
        settled = wait_until(lambda: run_status(run_id) == "compensated", 90)
        actions = list(Action.objects.filter(run_id=run_id, kind="forward").values_list("pk", "tool__name", "status"))
        self.seen(run_id, *(pk for pk, _, _ in actions))
        booked = [name for _, name, status in actions if status != "compensated"]
        return settled and not booked, f"run {run_status(run_id)}; forward steps {[(n, s) for _, n, s in actions]}"

    def stale_checkpoint_resumed(self):
        """An agent restarts with stale memory and replays steps it already did (replays, no new effects); its
        email after the pivot fails for good, the run needs attention; an operator resumes it from the
        checkpoint, a second operator resumes the same stale item (409); the agent completes."""
        run_id = self.open_run("stale checkpoint")
        before = self.agent.get_run(run_id)
        flight_args = {"passenger": "Stale", "flight": "LH402", "date": "2027-04-03"}
        hotel_args = {"guest": "Stale", "hotel": "H", "nights": 1}
        before.act("travel.book_flight", flight_args)
        before.act("travel.reserve_hotel", hotel_args)
        # The agent process restarts: a new client, whose memory says the run is at its start.
        restarted = Unwind(self.url, self.cast.key, timeout=30, retries=6, backoff=0.2).get_run(run_id)
        replays = []
        for tool, args in [("travel.book_flight", flight_args), ("travel.reserve_hotel", hotel_args)]:
            answer = self.post_raw(run_id, json.dumps({"args": dict(reversed(list(args.items()))), "tool": tool}))
            replays.append((tool, answer.status_code, answer.headers.get("Idempotent-Replayed")))
            self.seen(run_id, answer.json()["id"])
        restarted.act("payments.charge", {"customer": "cus_stale", "amount_cents": 4200, "currency": "EUR"})
        fault(self.url, {"tool": "email.send", "mode": "status", "status": 503, "times": 4})
        try:
            restarted.act("email.send", {"to": "stale@chaos.invalid", "subject": "Your trip", "body": "b"})
            return False, "the email should have failed after the pivot"
        except Unwound:
            pass
        if not wait_until(lambda: run_status(run_id) == "needs_attention", 30):
            return False, f"run is {run_status(run_id)}, expected needs_attention"
        olga = self.person(self.cast.operator)
        items = olga.get(f"{self.url}/api/v1/recovery-items", params={"run": run_id}, timeout=30).json()["results"]
        item = items[0]["id"]
        first = olga.post(f"{self.url}/api/v1/recovery-items/{item}/resume", json={"reason": "retry the email"}, timeout=60)
        second = olga.post(f"{self.url}/api/v1/recovery-items/{item}/resume", json={"reason": "stale tab"}, timeout=60)
        email = Action.objects.get(run_id=run_id, tool__name="email.send", kind="forward")
        self.seen(run_id, email.pk)
        sent = wait_until(lambda: Action.objects.get(pk=email.pk).status == "succeeded", 60)
        restarted.complete()
        replayed = all(status == 200 and flag == "true" for _, status, flag in replays)
        effects = [effects_of(a) for a in Action.objects.filter(run_id=run_id, kind="forward").values_list("pk", flat=True)]
        ok = replayed and first.status_code == 200 and second.status_code == 409 and sent and effects == [1, 1, 1, 1] \
            and run_status(run_id) == "completed"
        return ok, (f"stale replays {replays}; resume {first.status_code}, stale resume {second.status_code}; "
                    f"email {'sent' if sent else 'not sent'}; effects per step {effects}; run {run_status(run_id)}")

    def duplicate_task_delivery(self):
        """The same execute task delivered twice to the workers (at-least-once delivery), for a tool that honours
        keys and for one that does not (email, behind a slow relay): one effect each."""
        run_id = self.open_run("duplicate delivery")
        run = Run.objects.get(pk=run_id)
        details, ok = [], True
        for tool, args, slow in [
            ("travel.book_flight", {"passenger": "Twice", "flight": "LH403", "date": "2027-04-04"}, False),
            ("email.send", {"to": "twice@chaos.invalid", "subject": "Delivered twice", "body": "b"}, True),
        ]:
            if slow:
                fault(self.url, {"tool": tool, "mode": "latency", "ms": 1500})
            proposal = action_propose(run=run, tool_name=tool, args=args, actor="agent:chaos-agent")
            self.seen(run_id, proposal.action.pk)
            deliveries = [async_task("ledger.tasks.execute_action", proposal.action.pk, proposal.owner,
                                     group="execute_action") for _ in range(2)]
            self.recorder.count("duplicate_delivery")
            # Both deliveries must have run before the world is counted, whichever finished first.
            delivered = wait_until(lambda tasks=deliveries: all(fetch(task) is not None for task in tasks), 60)
            settled = delivered and Action.objects.get(pk=proposal.action.pk).status == "succeeded"
            effects = effects_of(proposal.action.pk)
            details.append(f"{tool}: {'succeeded' if settled else 'not settled'}, {effects} effect(s)")
            ok = ok and settled and effects == 1
        self.agent.get_run(run_id).complete()
        return ok, "; ".join(details)

    def approval_expires_while_workers_are_down(self):
        """A gated charge waits for a person; every worker is killed; the approval expires meanwhile and a late
        approval is refused (409); when the workers come back the expiry unwinds the run: compensated."""
        gated = Unwind(self.url, self.cast.gated_key, timeout=30, retries=6, backoff=0.2)
        run_id = self.open_run("approval expires while workers are down", client=gated)
        run = gated.get_run(run_id)
        run.act("travel.book_flight", {"passenger": "Gated", "flight": "LH404", "date": "2027-04-05"})
        run.act("travel.reserve_hotel", {"guest": "Gated", "hotel": "H", "nights": 3})
        try:
            run.act("payments.charge", {"customer": "cus_gated", "amount_cents": 99_00, "currency": "EUR"})
            return False, "the charge should have waited for approval"
        except ApprovalPending as pending:
            approval_id = pending.approval_id
            self.seen(run_id, pending.action["id"])
        self.workers.kill_all()
        time.sleep(GATED_TTL_SECONDS + 1.5)
        late = self.person(self.cast.approver).post(f"{self.url}/api/v1/approvals/{approval_id}/approve",
                                                    json={"reason": "sorry, late"}, timeout=30)
        waiting = run_status(run_id)
        self.workers.restart_dead()
        settled = wait_until(lambda: run_status(run_id) == "compensated", 90)
        charge = Action.objects.get(run_id=run_id, tool__name="payments.charge")
        ok = late.status_code == 409 and waiting == "awaiting_approval" and settled and charge.status == "expired" \
            and effects_of(charge.pk) == 0
        return ok, (f"late approval {late.status_code}; while down the run was {waiting}; then {run_status(run_id)}; "
                    f"charge {charge.status} with {effects_of(charge.pk)} effect(s)")

    # --- issue 32: faults where a step is sent or not, and must be known to be -----------------------

    def quick_email(self):
        """email.send (which ignores keys) with a 2 s timeout, for the scenarios below; restored by `restore`."""
        from ledger.models import Tool
        from ledger.policy.versions import tool_upsert
        from chaos.world import policy

        spec = dict(policy(threshold="critical", ttl_seconds=3600)["tools"]["email.send"], timeout=2)
        tool_upsert(tenant=self.cast.tenant, name="email.send", spec=spec, actor="system:chaos")
        return Tool.objects.get(tenant=self.cast.tenant, name="email.send", is_current=True)

    def restore_email(self):
        from ledger.policy.versions import tool_upsert
        from chaos.world import policy

        tool_upsert(tenant=self.cast.tenant, name="email.send", actor="system:chaos",
                    spec=policy(threshold="critical", ttl_seconds=3600)["tools"]["email.send"])

    def queued_emails(self, run_id: int, n: int, subject: str) -> list[int]:
        """`n` emails claimed for the workers, as an approval or the sweep queues them (the web is not needed)."""
        run = Run.objects.get(pk=run_id)
        ids = []
        for i in range(n):
            proposal = action_propose(run=run, tool_name="email.send", queued=True, actor="agent:chaos-agent",
                                      args={"to": f"q{i}@chaos.invalid", "subject": f"{subject} {i}", "body": "b"})
            async_task("ledger.tasks.execute_action", proposal.action.pk, proposal.owner, group="execute_action")
            ids.append(proposal.action.pk)
        self.seen(run_id, *ids)
        return ids

    def items_of(self, run_id: int) -> list[str]:
        from recovery.models import RecoveryItem

        return list(RecoveryItem.objects.filter(run_id=run_id).values_list("reason", flat=True))

    def one_each_and_nobody_asked(self, run_id: int, ids: list[int], timeout: float) -> tuple[bool, str]:
        landed = wait_until(lambda: all(Action.objects.get(pk=i).status == "succeeded" for i in ids), timeout)
        effects = [effects_of(i) for i in ids]
        items = self.items_of(run_id)
        statuses = sorted(Action.objects.filter(pk__in=ids).values_list("status", flat=True))
        return landed and effects == [1] * len(ids) and not items, \
            f"steps {statuses}; effects {effects}; recovery items {items or 'none'}"

    def tool_hang(self):
        """The relay holds a call past the tool's timeout and applies nothing: the step is read back once the call
        cannot still arrive, found not done, and sent again under a new attempt: one email, no person."""
        self.quick_email()
        try:
            run_id = self.open_run("tool hang")
            fault(self.url, {"tool": "email.send", "mode": "timeout", "seconds": 3, "times": 1})
            ids = self.queued_emails(run_id, 1, "Hung")
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 60)
            self.agent.get_run(run_id).complete()
            return ok, detail
        finally:
            self.restore_email()

    def late_answer(self):
        """The relay sends the email, but answers after the tool's timeout: the step is read back once the call is
        over, found, and recorded with the message as its result: one email, no person."""
        self.quick_email()
        try:
            run_id = self.open_run("late answer")
            fault(self.url, {"tool": "email.send", "mode": "latency", "ms": 3000, "times": 1})
            ids = self.queued_emails(run_id, 1, "Late")
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 60)
            result = Action.objects.get(pk=ids[0]).result or {}
            ok = ok and "message_id" in result
            self.agent.get_run(run_id).complete()
            return ok, f"{detail}; result {'is the message' if 'message_id' in result else result}"
        finally:
            self.restore_email()

    def tool_server_down(self):
        """The tool server (here the web process, which serves the sandbox) is down for 6 s while the workers call
        it: every attempt is refused, known not sent, retried, and the step fails as not carried out; the run
        unwinds. Nobody is asked, nothing is sent."""
        run_id = self.open_run("tool server down")
        self.web.stop()
        try:
            ids = self.queued_emails(run_id, 2, "Refused")
            time.sleep(6)
        finally:
            self.web.start()
        settled = wait_until(lambda: run_status(run_id) in ("compensated", "needs_attention"), 90)
        classes = sorted(set(Attempt.objects.filter(action_id__in=ids).values_list("error_class", flat=True)))
        statuses = sorted(Action.objects.filter(pk__in=ids).values_list("status", flat=True))
        effects = [effects_of(i) for i in ids]
        items = self.items_of(run_id)
        # Every call was refused (not_sent); a step retried after the first one failed and the run stopped is not
        # tried again ("permanent": not tried again, the run stopped). Nothing is "may have acted" (transient).
        ok = settled and run_status(run_id) == "compensated" and statuses == ["failed", "failed"] \
            and effects == [0, 0] and not items and "not_sent" in classes and set(classes) <= {"not_sent", "permanent"}
        return ok, (f"run {run_status(run_id)}; steps {statuses}; error classes {classes}; effects {effects}; "
                    f"recovery items {items or 'none'}")

    def workers_frozen_past_their_leases(self):
        """Every worker is frozen (SIGSTOP) with emails queued for it, past their leases, then thawed: the sweep
        finds the claims never sent and sends them; a thawed worker that held one may not send it any more. One
        email each, no person."""
        self.quick_email()
        try:
            run_id = self.open_run("workers frozen past their leases")
            self.workers.freeze_all()
            try:
                ids = self.queued_emails(run_id, 3, "Frozen")
                until = max(Action.objects.filter(pk__in=ids).values_list("lease_expires_at", flat=True))
                time.sleep(max(0.0, (until - timezone.now()).total_seconds()) + 2)
            finally:
                self.workers.thaw_all()
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 90)
            self.agent.get_run(run_id).complete()
            return ok, detail
        finally:
            self.restore_email()

    def broker_lost(self):
        """Redis, the broker, is stopped for 5 s while steps are claimed and queued, then started again empty: the
        tasks were never delivered, so the sweep finds the claims never sent and sends them. One email each, no
        person. (The ORM broker is the database: nothing to lose apart from it.)"""
        if self.broker is None:
            return True, "not run: the ORM broker lives in the database"
        self.quick_email()
        try:
            run_id = self.open_run("broker lost")
            self.broker.stop()
            try:
                ids = []
                for i in range(3):
                    try:
                        ids += self.queued_emails(run_id, 1, f"Brokerless {i}")
                    except Exception:  # noqa: BLE001 - the enqueue fails with the broker gone; the claim is committed
                        ids.append(Action.objects.filter(run_id=run_id).order_by("-seq").values_list("pk", flat=True)[0])
                self.seen(run_id, *ids)
                time.sleep(5)
            finally:
                self.broker.start()
                self.workers.restart_dead()  # a cluster that lost its broker may have exited
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 90)
            self.agent.get_run(run_id).complete()
            return ok, detail
        finally:
            self.restore_email()

    def emails_in_flight_through(self, name: str, fault_of_the_database) -> tuple[bool, str]:
        """Three emails in flight at a slow relay (1.5 s) when `fault_of_the_database()` strikes: their outcomes
        are recorded once the database is back (read back where the recording was lost). One email each, no
        person, nothing left running."""
        from django.db import connections

        if self.database is None:
            return True, "not run: the phase's database is a shared server (CHAOS_DATABASE_URL=private runs it)"
        self.quick_email()
        try:
            run_id = self.open_run(name)
            fault(self.url, {"tool": "email.send", "mode": "latency", "ms": 1500, "times": 3})
            ids = self.queued_emails(run_id, 3, name)
            time.sleep(0.7)  # the workers have them at the relay
            connections.close_all()
            fault_of_the_database()
            connections.close_all()
            self.workers.restart_dead()  # a cluster that lost its database may have exited
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 120)
            self.agent.get_run(run_id).complete()
            return ok, detail
        finally:
            self.workers.restart_dead()
            self.restore_email()

    def database_restart(self):
        """PostgreSQL restarted (fast: every connection cut) while emails are at the relay."""
        return self.emails_in_flight_through("database restart", lambda: self.database.restart())

    def database_stall(self):
        """PostgreSQL frozen (SIGSTOP of the server and its backends) for 12 s, past the queued leases' start,
        while emails are at the relay; then it answers again."""
        def stall():
            self.database.freeze()
            try:
                time.sleep(12)
            finally:
                self.database.thaw()

        return self.emails_in_flight_through("database stall", stall)

    def web_frozen_past_its_lease(self):
        """The web processes are frozen (SIGSTOP) while their inline call of an email is at the relay, past the
        step's lease: the sweep takes the step over, knows it was sent, waits until the call cannot still arrive,
        reads it back and finds it. When the web thaws, its own recording finds the step already settled, or settles
        it first. One email, no person.

        Here the relay is the sandbox inside the same web processes, so it is frozen too; the freeze ends 0.8 s
        after the lease, well inside the 5 s (twice the tool's timeout, plus 1 s) Unwind waits before reading back.
        A tool that acts later than that after receiving a call breaks the tool contract (docs/tools.md): frozen 6 s,
        this scenario once sent the email twice."""
        from chaos.processes import signal_all
        import signal as signals

        self.quick_email()
        try:
            run_id = self.open_run("web frozen past its lease")
            fault(self.url, {"tool": "email.send", "mode": "latency", "ms": 800, "times": 1})
            text = json.dumps({"tool": "email.send", "args": {"to": "frozen-web@chaos.invalid", "subject": "Frozen web",
                                                              "body": "b"}})
            answer = {}
            request = threading.Thread(target=lambda: answer.update(response=self.post_raw(run_id, text)))
            request.start()
            leased = wait_until(lambda: Action.objects.filter(run_id=run_id, kind="forward").exists(), 10, 0.05)
            time.sleep(0.3)  # the inline call is at the relay
            frozen = [self.web.child.process.pid, *self.web.worker_pids()]
            signal_all(frozen, signals.SIGSTOP)
            try:
                until = Action.objects.get(run_id=run_id, kind="forward").lease_expires_at if leased else timezone.now()
                time.sleep(max(0.0, (until - timezone.now()).total_seconds()) + 0.8)  # past the inline lease
            finally:
                signal_all(frozen, signals.SIGCONT)
            request.join(timeout=90)
            ids = list(Action.objects.filter(run_id=run_id, kind="forward").values_list("pk", flat=True))
            self.seen(run_id, *ids)
            ok, detail = self.one_each_and_nobody_asked(run_id, ids, 90)
            ok = ok and len(ids) == 1
            self.agent.get_run(run_id).complete()
            return ok, detail
        finally:
            self.restore_email()

    def failing_undo(self):
        """The flight's undo refuses every time (400): the run is cancelled, the undo fails once for good (a refusal
        is not retried), and a person is told which undo failed; the flight stands, booked once."""
        from recovery.models import RecoveryItem

        run_id = self.open_run("failing undo")
        run = self.agent.get_run(run_id)
        run.act("travel.book_flight", {"passenger": "Undo", "flight": "LH405", "date": "2027-04-06"})
        flight_id = Action.objects.get(run_id=run_id, tool__name="travel.book_flight").pk
        self.seen(run_id, flight_id)
        fault(self.url, {"tool": "travel.cancel_flight", "mode": "status", "status": 400, "times": 1})
        run.cancel("the customer changed their plans")
        settled = wait_until(lambda: run_status(run_id) == "needs_attention", 60)
        item = RecoveryItem.objects.filter(run_id=run_id, status="open").first()
        flight = Action.objects.get(pk=flight_id)
        undo_calls = sum(ToolCall.objects.filter(idempotency_key=undo.tool_key).count()
                         for undo in Action.objects.filter(compensates=flight))
        ok = settled and item is not None and item.reason == "compensation_failed" and "(step 1)" in item.detail \
            and flight.status == "compensation_failed" and effects_of(flight.pk) == 1 and undo_calls == 1
        return ok, (f"run {run_status(run_id)}; item {item.reason if item else 'none'}; flight {flight.status} with "
                    f"{effects_of(flight.pk)} effect(s); undo calls {undo_calls}")
