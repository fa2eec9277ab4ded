"""Issue 39, findings 1 and 7: what an insider with database write access edits in a step's row is refused before
anything is sent, and `verify_audit` names it, however many events were recorded for the step since.

Each test is the attack as the issue ran it: the agent talks to a live Unwind over HTTP, the insider edits rows with
SQL, a person approves over HTTP where the step waits for one, and a real `manage.py worker` (django-q2 cluster and
sweep clock) sends the step, as in production: the live server queues the work instead of running it. One worker is
kept for the module's tests (`Workers`) and started again only for another engine path or after a test that needs
none running. What must hold each time: the step is not sent (the sandbox's call log has no call of its tool), it
fails closed to a person (a recovery item `tampered` naming what differs), and `manage.py verify_audit` fails naming
the check (`sends`, `hold`, `undo` for what a succeeded step's undo is built from; `totals` for the budget reset).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import requests
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone
from django_q.conf import Conf

from approvals.models import ApprovalRequest
from ledger.audit.verify import verify_chain
from ledger.canonical import digest
from ledger.models import Action, AuditEvent, Run
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from sandbox.selectors import call_list
from tests.conftest import POLICY, needs_postgres
from tests.helpers import acme, fault
from tests.test_g05_crash_safety import ROOT, process_env, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(connection.vendor == "sqlite" and ":memory:" in str(connection.settings_dict.get("NAME")),
                       reason="worker processes need a database file or server"),
]

CHARGE = {"customer": "carol", "amount_cents": 4243}
MAIL = {"to": "carol@example.com", "subject": "Your trip", "body": "Booked."}


class Workers:
    """The module's real `manage.py worker`, kept running from one test to the next: its start and its graceful stop
    were 4-5 s of each test's 3-7 (two Django processes, a django-q2 cluster). A test asking for another environment
    (the other engine path) gets a new one; `stop` is for the tests that need none running while they edit. A worker
    that died is an error, never quietly replaced. It logs to a file: a pipe nobody reads would fill and block it."""

    def __init__(self, live_server, log):
        self.live_server, self.log = live_server, log
        self.process: subprocess.Popen | None = None
        self.env: dict = {}

    def ensure(self, **env) -> None:
        self.check()
        if self.process is not None and env == self.env:
            return
        self.stop()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "manage.py", "worker"], cwd=ROOT,
                                            env=process_env(self.live_server, UNWIND_WORKERS="1", **env),
                                            stdout=subprocess.DEVNULL, stderr=log)
        self.env = env

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            code, self.process = self.process.returncode, None
            raise AssertionError(f"the worker exited with {code}: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self.process = None


@pytest.fixture(scope="module")
def workers(live_server, tmp_path_factory):
    pool = Workers(live_server, tmp_path_factory.mktemp("insider") / "worker.log")
    yield pool
    pool.stop()


class Insider:
    """The world as the attack sees it: an agent's and a person's HTTP sessions, SQL, and a running worker."""

    def __init__(self, world, workers: Workers):
        self.world = world
        self.base = world.live_server.url
        self.agent = requests.Session()
        self.agent.headers["Authorization"] = f"Bearer {world.key}"
        self.workers = workers

    def start_worker(self, **env) -> None:
        """A worker on this test's engine path (the one this process runs, unless `env` names one), running from now
        on: the one left by an earlier test when it has the same environment."""
        from django.conf import settings

        env.setdefault("UNWIND_FAST_PATH", "1" if settings.UNWIND_FAST_PATH else "0")
        self.workers.ensure(**env)

    def without_worker(self) -> None:
        """No worker runs until `start_worker`: for the tests whose edits must land before any worker could act."""
        self.workers.stop()

    def open_run(self) -> int:
        answer = self.agent.post(f"{self.base}/api/v1/runs", json={"goal": "insider", "on_behalf_of": "carol@example.com"},
                                 timeout=30)
        assert answer.status_code == 201, answer.text
        return answer.json()["id"]

    def propose(self, run_id: int, tool: str, args: dict) -> dict:
        answer = self.agent.post(f"{self.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args},
                                 timeout=60)
        assert answer.status_code in (200, 201, 202), answer.text
        return answer.json()

    def approve(self, action_id: int, *, who: str = "alice") -> dict:
        """Approve over the approvals API as `who`; returns the preview the person was shown."""
        request = ApprovalRequest.objects.get(action_id=action_id)
        person = (who, f"pw-{who}")
        shown = requests.get(f"{self.base}/api/v1/approvals/{request.pk}", auth=person, timeout=30)
        assert shown.status_code == 200, shown.text
        decided = requests.post(f"{self.base}/api/v1/approvals/{request.pk}/approve", json={"reason": "looks right"},
                                auth=person, timeout=60)
        assert decided.status_code == 200, decided.text
        return shown.json()["preview"]

    @staticmethod
    def sql(statement: str, params: list) -> None:
        with connection.cursor() as cursor:
            cursor.execute(statement, params)


@pytest.fixture
def insider(http_tools, workers, settings, monkeypatch):
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    settings.UNWIND_LEASE_SECONDS = 20  # the claims of the queued work: covers the worker's start
    monkeypatch.setattr(Conf, "SYNC", False)  # the live server queues work for the worker, as in production
    yield Insider(http_tools, workers)
    workers.check()  # it lived through the test


def settled(run_id: int, status: str = "needs_attention", timeout: float = 60) -> Run:
    assert wait_until(lambda: Run.objects.get(pk=run_id).status == status, timeout), Run.objects.get(pk=run_id).status
    return Run.objects.get(pk=run_id)


def calls(tool: str) -> int:
    return call_list(tenant=acme(), tool=tool)["count"]


def verify_audit_fails(check: str) -> str:
    with pytest.raises(CommandError) as failed:
        call_command("verify_audit", "--tenant", "acme")
    assert f"[check: {check}]" in str(failed.value), str(failed.value)
    return str(failed.value)


def refused_as_tampered(action: Action, run: Run, words: str) -> RecoveryItem:
    action.refresh_from_db()
    assert action.status == "failed" and action.error_class == "tampered", (action.status, action.error_class)
    assert list(action.attempt_set.values_list("outcome", flat=True))[-1] == "tampered"
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "tampered" and item.action_id == action.pk and words in item.detail, item.detail
    assert AuditEvent.objects.filter(action_ref=action.pk, kind="tampering.refused").count() == 1
    return item


# --- finding 1: the bytes sent are the bytes proposed and approved -----------------------------------------------

def test_args_edited_while_a_charge_waits_for_approval_are_never_sent(insider):
    """The issue's attack: 4243 proposed, 99999999 written into args_text, the approver shown 4243 approves."""
    run_id = insider.open_run()
    proposed = insider.propose(run_id, "payments.charge", CHARGE)
    assert proposed["status"] == "awaiting_approval", proposed
    insider.sql("UPDATE ledger_action SET args_text = %s WHERE id = %s",
                ['{"customer":"carol","amount_cents":99999999}', proposed["id"]])
    insider.start_worker()
    preview = insider.approve(proposed["id"])
    assert preview["args"]["amount_cents"] == 4243  # what the person saw and approved
    run = settled(run_id)
    item = refused_as_tampered(Action.objects.get(pk=proposed["id"]), run, "args_text was edited")
    assert "payments.charge (step 1) was not sent" in item.detail
    assert calls("payments.charge") == 0
    # The refusal and the approval before it fingerprinted the edited row: only the seal can still say so.
    assert "would send arguments other than those recorded" in verify_audit_fails("sends")


def test_an_edit_fingerprinted_by_the_next_event_is_still_named_by_verify_audit(insider):
    """Never laundered: the approval's events fingerprint the edited row (no worker runs here, so nothing is sent),
    and the fingerprint check passes again; the seal its proposal recorded does not."""
    insider.without_worker()
    run_id = insider.open_run()
    proposed = insider.propose(run_id, "payments.charge", CHARGE)
    insider.sql("UPDATE ledger_action SET args_text = %s WHERE id = %s",
                ['{"customer":"carol","amount_cents":99999999}', proposed["id"]])
    assert verify_chain(insider.world.acme.pk).check == "fingerprint"  # the edit, before any later event
    insider.approve(proposed["id"])
    assert Action.objects.get(pk=proposed["id"]).status == "running"  # claimed; its task waits for a worker
    report = verify_chain(insider.world.acme.pk)
    assert report.check == "sends" and "would send arguments other than those recorded" in report.problem, report
    assert calls("payments.charge") == 0


def test_args_and_their_hash_edited_together_are_still_refused(insider):
    """An insider who rewrites `args`, `args_hash` and `args_text` consistently (the preview then shows the new
    amount, and the approval is bound to the new hash) still meets the seal the proposal recorded."""
    run_id = insider.open_run()
    proposed = insider.propose(run_id, "payments.charge", CHARGE)
    forged = {"customer": "carol", "amount_cents": 99999999}
    insider.sql("UPDATE ledger_action SET args = %s, args_hash = %s, args_text = %s WHERE id = %s",
                [json.dumps(forged), digest(forged), '{"customer":"carol","amount_cents":99999999}', proposed["id"]])
    ApprovalRequest.objects.filter(action_id=proposed["id"]).update(args_hash=digest(forged))
    insider.start_worker()
    insider.approve(proposed["id"])
    run = settled(run_id)
    refused_as_tampered(Action.objects.get(pk=proposed["id"]), run, "args_text was edited")
    assert calls("payments.charge") == 0
    verify_audit_fails("sends")  # the approval and the refusal fingerprinted both edited rows: the seal says so


def test_a_charge_moved_past_its_approval_in_the_database_is_never_sent(insider):
    """Its status set to a retry that is due (no args touched): the sweep claims it, and its seal says a person had to
    approve it first; the chain records no approval, so nothing is sent."""
    run_id = insider.open_run()
    proposed = insider.propose(run_id, "payments.charge", CHARGE)
    insider.sql("UPDATE ledger_action SET status = 'retry_scheduled', next_attempt_at = %s WHERE id = %s",
                [timezone.now(), proposed["id"]])
    insider.start_worker()
    run = settled(run_id)
    refused_as_tampered(Action.objects.get(pk=proposed["id"]), run, "needing 1 person's approval")
    assert calls("payments.charge") == 0
    assert "none is recorded in the audit chain" in verify_audit_fails("sends")


def test_a_held_steps_args_edited_during_its_window_are_never_sent(insider):
    insider.without_worker()  # the edit lands inside the 2 s window, however slow this machine is
    tool_upsert(tenant=insider.world.acme, name="email.send", spec=dict(POLICY["tools"]["email.send"], hold="2s"),
                actor="test")
    run_id = insider.open_run()
    held = insider.propose(run_id, "email.send", MAIL)
    assert held["status"] == "held", held
    insider.sql("UPDATE ledger_action SET args_text = %s WHERE id = %s",
                ['{"to":"mallory@evil.example","subject":"Your trip","body":"Booked."}', held["id"]])
    insider.start_worker()  # its sweep releases the step when the window ends, and it sends it
    run = settled(run_id)
    refused_as_tampered(Action.objects.get(pk=held["id"]), run, "args_text was edited")
    assert calls("email.send") == 0
    verify_audit_fails("sends")


def test_a_held_steps_window_cut_short_in_the_database_is_refused_at_release(insider):
    """`next_attempt_at` moved to now: the sweep finds the step due, and its release compares the time with the one
    its hold recorded in the chain. The step is never run; a person is asked."""
    insider.without_worker()  # the edit is seen before the release
    tool_upsert(tenant=insider.world.acme, name="email.send", spec=dict(POLICY["tools"]["email.send"], hold="60s"),
                actor="test")
    run_id = insider.open_run()
    held = insider.propose(run_id, "email.send", MAIL)
    recorded = Action.objects.get(pk=held["id"]).next_attempt_at
    insider.sql("UPDATE ledger_action SET next_attempt_at = %s WHERE id = %s",
                [timezone.now() - timedelta(seconds=1), held["id"]])
    assert verify_chain(insider.world.acme.pk).check == "hold"  # seen before the release too
    insider.start_worker()
    run = settled(run_id, timeout=30)
    assert timezone.now() < recorded  # long before the window the chain recorded would have ended
    action = Action.objects.get(pk=held["id"])
    assert action.status == "skipped" and calls("email.send") == 0
    item = RecoveryItem.objects.get(run=run, status="open")
    assert item.reason == "tampered" and "its time was edited" in item.detail and "was not released" in item.detail
    assert "undo window was recorded to end at" in verify_audit_fails("hold")


def test_an_undos_args_edited_while_it_waits_for_approval_are_never_sent(insider):
    """Compensation args too: the undo is sent with the args its plan resolved and its proposal recorded."""
    spec = dict(POLICY["tools"]["hr.create_user"])
    spec["compensation"] = dict(spec["compensation"], approval="manual")
    tool_upsert(tenant=insider.world.acme, name="hr.create_user", spec=spec, actor="test")
    run_id = insider.open_run()
    created = insider.propose(run_id, "hr.create_user", {"email": "new@example.com", "name": "New"})
    assert created["status"] == "succeeded", created
    insider.start_worker()
    cancelled = insider.agent.post(f"{insider.base}/api/v1/runs/{run_id}/cancel", json={"reason": "changed my mind"},
                                   timeout=60)
    assert cancelled.status_code == 200, cancelled.text
    assert wait_until(lambda: Action.objects.filter(run_id=run_id, kind="compensation",
                                                    status="awaiting_approval").exists(), 60)
    undo = Action.objects.get(run_id=run_id, kind="compensation")
    insider.sql("UPDATE ledger_action SET args_text = %s WHERE id = %s", ['{"user_id":"u-someone-else"}', undo.pk])
    insider.approve(undo.pk, who="oscar")
    run = settled(run_id)
    refused_as_tampered(undo, run, "args_text was edited")
    assert Action.objects.get(pk=created["id"]).status == "compensation_failed"
    assert calls("hr.delete_user") == 0
    verify_audit_fails("sends")


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "python_path"], scope="module")
def test_a_retry_of_a_step_edited_after_its_first_attempt_is_never_sent(insider, settings, fast):
    """The first attempt ran inline in the API request (on PostgreSQL recorded by `unwind_propose`), the tool answered
    503, and its retry waits for the worker. The insider rewrites what the retry will send, and makes it due now."""
    if fast and connection.vendor != "postgresql":
        pytest.skip("the one-call proposal is PostgreSQL's")
    settings.UNWIND_FAST_PATH = fast
    settings.UNWIND_MAX_BACKOFF = 60
    tool_upsert(tenant=insider.world.acme, name="hr.create_user",
                spec=dict(POLICY["tools"]["hr.create_user"], retry={"max_attempts": 3, "backoff": 20}), actor="test")
    fault("hr.create_user", "status", status=503, times=1)
    run_id = insider.open_run()
    first = insider.propose(run_id, "hr.create_user", {"email": "new@example.com", "name": "New"})
    assert first["status"] == "retry_scheduled", first
    sealed = AuditEvent.objects.get(action_ref=first["id"], kind="forward.proposed").data["sends"]
    assert set(sealed) == {"body", "call", "target", "approvals"}
    insider.sql("UPDATE ledger_action SET args_text = %s, next_attempt_at = %s WHERE id = %s",
                ['{"email":"mallory@evil.example","name":"New"}', timezone.now(), first["id"]])
    insider.start_worker(UNWIND_FAST_PATH="1" if fast else "0")
    run = settled(run_id)
    refused_as_tampered(Action.objects.get(pk=first["id"]), run, "args_text was edited")
    assert calls("hr.create_user") == 1  # the first attempt's 503, before the edit; nothing after it
    verify_audit_fails("sends")


def test_a_step_pointed_at_another_target_is_refused(insider):
    """Where the call goes is sealed with what it carries: a target rewritten while it waits is refused too."""
    run_id = insider.open_run()
    ticket = insider.propose(run_id, "crm.update_ticket", {"ticket_id": "T-204", "priority": "low"})
    assert ticket["status"] == "succeeded", ticket
    tool_upsert(tenant=insider.world.acme, name="crm.update_ticket",
                spec=dict(POLICY["tools"]["crm.update_ticket"], approval="manual"), actor="test")
    waiting = insider.propose(run_id, "crm.update_ticket", {"ticket_id": "T-311", "priority": "urgent"})
    assert waiting["status"] == "awaiting_approval", waiting
    insider.sql("UPDATE ledger_action SET target_id = %s WHERE id = %s", ["T-204", waiting["id"]])
    insider.start_worker()
    insider.approve(waiting["id"])
    run = settled(run_id)
    refused_as_tampered(Action.objects.get(pk=waiting["id"]), run, "another target ('T-204')")
    assert calls("crm.update_ticket") == 1  # the first step's; the second never left
    assert "another target" in verify_audit_fails("sends")


# --- an undo's inputs: what a succeeded step's undo is built from is what its success recorded --------------------

def unwind_over_http(insider, run_id: int, *, fast: bool) -> Run:
    insider.start_worker(UNWIND_FAST_PATH="1" if fast else "0")
    cancelled = insider.agent.post(f"{insider.base}/api/v1/runs/{run_id}/cancel", json={"reason": "changed my mind"},
                                   timeout=60)
    assert cancelled.status_code == 200, cancelled.text
    return settled(run_id)


def undo_refused(run_id: int, step_id: int, run: Run) -> RecoveryItem:
    undo = Action.objects.get(run_id=run_id, kind="compensation")
    assert undo.compensates_id == step_id
    item = refused_as_tampered(undo, run, "would be built from a result, compensation plan, arguments or snapshot "
                                          "other than those recorded when the step succeeded")
    assert Action.objects.get(pk=step_id).status == "compensation_failed"
    return item


def one_call_engine(fast: bool, settings) -> None:
    if fast and connection.vendor != "postgresql":
        pytest.skip("the one-call unwind is PostgreSQL's")
    settings.UNWIND_FAST_PATH = fast


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "python_path"], scope="module")
def test_a_succeeded_steps_result_edited_before_its_undo_is_never_sent(insider, settings, fast):
    """The step created a user; the insider rewrites its result to name another. Unwinding it would delete that one:
    the undo is built, and refused before it leaves."""
    one_call_engine(fast, settings)
    run_id = insider.open_run()
    created = insider.propose(run_id, "hr.create_user", {"email": "a@example.com", "name": "A"})
    assert created["status"] == "succeeded", created
    success = AuditEvent.objects.get(action_ref=created["id"], kind="forward.succeeded")
    assert len(success.data["undo"]) == 64  # the undo seal, inside the event's HMAC
    result = dict(Action.objects.get(pk=created["id"]).result, id="usr_someone_else")
    insider.sql("UPDATE ledger_action SET result = %s WHERE id = %s", [json.dumps(result), created["id"]])
    run = unwind_over_http(insider, run_id, fast=fast)
    undo_refused(run_id, created["id"], run)
    assert calls("hr.delete_user") == 0  # neither B nor A: nothing reached the undo's tool
    verify_audit_fails("undo")


def test_a_succeeded_steps_compensation_plan_edited_before_its_undo_is_never_sent(insider):
    """The plan's mapping rewritten to a fixed user, and the undo needs a person's approval: while it waits (the
    unwinder's events have fingerprinted the edited step since), `verify_audit` already names the edit; approved, the
    undo is refused before it leaves."""
    spec = dict(POLICY["tools"]["hr.create_user"])
    spec["compensation"] = dict(spec["compensation"], approval="manual")
    tool_upsert(tenant=insider.world.acme, name="hr.create_user", spec=spec, actor="test")
    run_id = insider.open_run()
    created = insider.propose(run_id, "hr.create_user", {"email": "a@example.com", "name": "A"})
    assert created["status"] == "succeeded", created
    step = Action.objects.get(pk=created["id"])
    plan = dict(step.compensation_plan, args={"user_id": "usr_someone_else"})
    insider.sql("UPDATE ledger_action SET compensation_plan = %s WHERE id = %s", [json.dumps(plan), step.pk])
    insider.start_worker()
    cancelled = insider.agent.post(f"{insider.base}/api/v1/runs/{run_id}/cancel", json={"reason": "changed my mind"},
                                   timeout=60)
    assert cancelled.status_code == 200, cancelled.text
    assert wait_until(lambda: Action.objects.filter(run_id=run_id, kind="compensation",
                                                    status="awaiting_approval").exists(), 60)
    assert AuditEvent.objects.filter(action_ref=step.pk, kind="forward.compensating").exists()
    assert "would be built from a result, compensation plan" in verify_audit_fails("undo")
    undo = Action.objects.get(run_id=run_id, kind="compensation")
    insider.approve(undo.pk, who="oscar")
    undo_refused(run_id, step.pk, settled(run_id))
    assert calls("hr.delete_user") == 0
    verify_audit_fails("undo")


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "python_path"], scope="module")
def test_the_args_a_correction_is_built_from_edited_after_the_step_are_never_sent(insider, settings, fast):
    """An email's correction goes to `$args.to`: the insider rewrites the sent email's arguments (the text and the
    object, and their hash, all three) to an outside address, to have Unwind mail it."""
    one_call_engine(fast, settings)
    run_id = insider.open_run()
    mailed = insider.propose(run_id, "email.send", MAIL)
    assert mailed["status"] == "succeeded", mailed
    edited = dict(MAIL, to="mallory@evil.example")
    insider.sql("UPDATE ledger_action SET args = %s, args_text = %s, args_hash = %s WHERE id = %s",
                [json.dumps(edited), json.dumps(edited), digest(edited), mailed["id"]])
    run = unwind_over_http(insider, run_id, fast=fast)
    undo_refused(run_id, mailed["id"], run)
    assert calls("email.send") == 1  # the email itself; no correction, to anyone
    verify_audit_fails("undo")


# --- finding 7: running totals recomputed from the steps ----------------------------------------------------------

@needs_postgres
def test_a_budget_reset_in_the_database_is_named_by_verify_audit(insider):
    """A 3,000 tenant budget, its running total reset to 0 (the issue's UPDATE): the engine reads totals, so the
    agent spends past the budget; `verify_audit` recomputes every total from the steps and names each that differs."""
    spec = dict(POLICY["tools"]["payments.capture"], limits=[{"per": "tenant", "sum": "args.amount_cents", "max": 3000}])
    tool_upsert(tenant=insider.world.acme, name="payments.capture", spec=spec, actor="test")
    capture = {"customer": "carol", "amount_cents": 1200, "currency": "EUR"}
    for _ in range(2):
        assert insider.propose(insider.open_run(), "payments.capture", capture)["status"] == "succeeded"
    over = insider.agent.post(f"{insider.base}/api/v1/runs/{insider.open_run()}/actions",
                              json={"tool": "payments.capture", "args": capture}, timeout=30)
    assert over.status_code == 403 and over.json()["code"] == "policy_denied", over.text
    call_command("verify_audit", "--tenant", "acme")
    insider.sql("UPDATE ledger_limittotal SET value = 0", [])
    assert insider.propose(insider.open_run(), "payments.capture", capture)["status"] == "succeeded"  # 3,600 spent
    problem = verify_audit_fails("totals")
    assert "the sum of amount_cents of payments.capture for the tenant for all time is kept as 1200 but its steps " \
           "add up to 3600" in problem, problem
    assert "running total(s) of the limits differ from the steps" in problem
