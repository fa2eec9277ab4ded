"""Issue 27: the two paths held to one behaviour.

On PostgreSQL each plain transaction of a step is one call of a PL/pgSQL function (ledger/engine/fastpath.py); SQLite and
every fallback take the Python path (ledger/engine/*, ledger/db/sql.py, ledger/engine/transitions.py). Every scenario the
engine supports runs here twice in one test database, once with the fast path and once with UNWIND_FAST_PATH off,
each from the same sandbox world, and the ledgers the two leave are compared row by row and value by value: runs,
actions, attempts, checkpoints, recovery items, approval requests and the audit events, in order. Only what must
differ between any two runs is normalised (see `Normaliser`); the answers the agent saw are compared too (each
step's answer or refusal, and each run as GET /api/v1/runs/<id> shows it).

`test_a_rule_changed_only_in_the_sql_is_caught` proves the comparison's power: it installs, inside its own
transaction, a function with one changed line and asserts the comparison reports the difference.
"""
from __future__ import annotations

import datetime
import re
import time
import weakref
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from approvals.models import ApprovalDecision, ApprovalRequest
from approvals.services import approval_decide, approvals_expire
from ledger.audit.chain import ledger_transaction
from ledger.engine import fastpath, outcome_plans, plans, plpgsql, runsteps, unwind_plans, unwinding
from ledger.audit.verify import verify_chain
from ledger.errors import UnwindError
from ledger.executors.call import ToolError
from ledger.models import Action, Attempt, AuditEvent, AuditHead, Checkpoint, Run, Tenant
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.attempts import mark_sent
from ledger.engine.runs import completion, run_cancel, run_complete, run_expire_idle
from ledger.engine.sweep import sweep
from ledger.policy.versions import tenant_defaults_set, tool_upsert
from recovery.models import RecoveryItem
from sandbox import callables
from sandbox import services as sandbox
from sandbox.services import sandbox_reset
from tests.conftest import in_process_policy
from tests.helpers import act, fault, open_run

pytestmark = pytest.mark.skipif(
    not django_settings.DATABASES["default"]["ENGINE"].endswith("postgresql"),
    reason="compares the PostgreSQL functions' path with the Python path: PostgreSQL only "
           "(run with DATABASE_URL=postgres://…); SQLite has only the Python path")

FLIGHT = {"passenger": "P", "flight": "LH1", "date": "2026-12-01"}
HOTEL = {"guest": "G", "hotel": "H", "nights": 1}
USER = {"email": "ann@company.com", "name": "Ann"}
MAIL = {"to": "ann@home.example", "subject": "Welcome", "body": "Hi"}


# --- what the agent sees -------------------------------------------------------------------------------------------

def answer_of(proposal) -> dict:
    action = Action.objects.get(pk=proposal.action.pk)
    return {"action": action.pk, "seq": action.seq, "replayed": proposal.replayed,
            "matched_by": getattr(proposal, "matched_by", None), "claimed": proposal.claimed,
            "status": action.status, "result": action.result, "error_class": action.error_class}


def step(run, tool, args, **kwargs) -> dict:
    """`act` as the API answers it: the action's final state, or the refusal (status, code, sentence, extras)."""
    try:
        action = act(run, tool, args, **kwargs)
    except UnwindError as refused:
        return refusal(refused)
    return {"action": action.pk, "seq": action.seq, "status": action.status, "result": action.result,
            "attempts": action.attempts, "error_class": action.error_class, "run": run.status}


def refusal(error: UnwindError) -> dict:
    return {"refused": type(error).__name__, "http": error.status, "code": getattr(error, "code", None),
            "detail": error.detail, "extra": getattr(error, "extra", None)}


def own_key() -> str:
    """An explicit idempotency key: unique per tenant and agent for good, so each path sends its own."""
    return f"k-{PATH[0]}-1"


PATH = ["fastpath"]  # the path the scenario runs on (set by `Phase`)


def run_answer(run: Run) -> dict:
    run = Run.objects.get(pk=run.pk)
    return {"run": run.pk, "status": run.status, "pivot": run.pivot_committed}


# --- the scenarios: each builds its state through the services, as the other tests do --------------------------------

def ok_saga(world, commit):
    run = open_run(world, goal="onboard")
    user = step(run, "hr.create_user", USER)
    lic = step(run, "licenses.provision", {"user_id": user["result"]["id"]})
    done = run_complete(run=run, actor="agent:booker")
    return [user, lic, run_answer(done)]


def failing_saga(world, commit):
    run = open_run(world, goal="onboard and fail")
    user = step(run, "hr.create_user", USER)
    lic = step(run, "licenses.provision", {"user_id": user["result"]["id"]})
    fault("email.send", "status", status=422)  # email.send: on_refusal unwind, newest first
    mail = step(run, "email.send", MAIL)
    return [user, lic, mail, run_answer(run)]


def retried_step(world, commit):
    run = open_run(world, goal="retry")
    fault("email.send", "status", status=503, times=1)  # transient once, then the call succeeds
    mail = step(run, "email.send", MAIL)
    return [mail, run_answer(run)]


def _gated_charge(world):
    run = open_run(world, goal="charge")
    flight = step(run, "travel.book_flight", FLIGHT)
    charge = step(run, "payments.charge", {"customer": "cus_1", "amount_cents": 5000})
    return run, [flight, charge], ApprovalRequest.objects.get(action_id=charge["action"])


def approved(world, commit):
    run, answers, request = _gated_charge(world)
    with commit():
        approval_decide(request=request, user=world.alice, approve=True)
    return [*answers, run_answer(run)]


def rejected(world, commit):
    run, answers, request = _gated_charge(world)
    with commit():
        approval_decide(request=request, user=world.alice, approve=False, reason="Amount looks wrong")
    return [*answers, run_answer(run)]


def expired(world, commit):
    run, answers, request = _gated_charge(world)
    with commit():
        count = approvals_expire(now=timezone.now() + timedelta(hours=2))
    return [*answers, count, run_answer(run)]


def cancel_before(world, commit):
    run = open_run(world, goal="cancel")
    user = step(run, "hr.create_user", USER)
    run_cancel(run=run, actor="agent:booker", reason="user changed their mind")
    after = step(run, "travel.reserve_hotel", HOTEL)  # refused: the run is cancelled
    return [user, after, run_answer(run)]


def cancel_during(world, commit):
    run = open_run(world, goal="cancel in flight")
    user = step(run, "hr.create_user", USER)
    in_flight = action_propose(run=run, tool_name="travel.book_flight", args=FLIGHT, actor="agent:booker")
    run_cancel(run=run, actor="agent:booker")
    waiting = run_answer(run)
    execution.execute(in_flight.action.pk, owner=in_flight.owner)
    execution.unwind(run.pk)
    return [user, answer_of(in_flight), waiting, run_answer(run)]


def drift(world, commit):
    run = open_run(world, goal="escalate")
    change = step(run, "crm.update_ticket", {"ticket_id": "T-182", "priority": "high"})
    sandbox.crm_update_ticket(tenant=world.acme, ticket_id="T-182", status="pending", priority=None,
                              note="customer replied", updated_by="dana")
    run_cancel(run=run, actor="agent:booker")
    return [change, run_answer(run)]


def _short_lease(world, name, **overrides):
    spec = dict(in_process_policy()["tools"][name], timeout=0.2, **overrides)
    tool_upsert(tenant=world.acme, name=name, spec=spec, actor="test")


def _wait_for_lease(action_id):
    lease = Action.objects.get(pk=action_id).lease_expires_at
    time.sleep(max(0.0, lease.timestamp() - time.time()) + 0.05)


def lost_unknown(world, commit):
    """Sent, the worker lost, and nothing can read the outcome back: a person is asked."""
    run = open_run(world, goal="unknown")
    sent = action_propose(run=run, tool_name="email.send", args=MAIL, actor="agent:booker")
    assert mark_sent(sent.action, sent.owner)
    _wait_for_lease(sent.action.pk)
    with commit():
        sweep()
    return [answer_of(sent), run_answer(run)]


def lost_read_back(world, commit):
    """The worker called the tool and died before recording: the sweep sends it again with the same key."""
    run = open_run(world, goal="read back")
    proposal = action_propose(run=run, tool_name="hr.create_user", args=USER, actor="agent:booker")
    callables.hr_create_user(USER, idempotency_key=proposal.action.tool_key, tenant="acme")
    _wait_for_lease(proposal.action.pk)
    with commit():
        sweep()
    return [answer_of(proposal), run_answer(run)]


def _incomplete_undo(world):
    spec = in_process_policy()["tools"]["email.send"]
    spec["compensation"]["args"]["subject"] = {"$concat": ["Correction: ", "$result.thread"]}
    tool_upsert(tenant=world.acme, name="email.send", spec=spec, actor="test")


def completed_undo(world, commit):
    """Found done by its lookup, but the undo's subject names what the record lacks: a person completes the undo
    and the run is compensated with it (issue 32)."""
    from recovery.services import recovery_complete_undo

    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(world, goal="completed undo")
    sent = step(run, "email.send", MAIL)
    args = {"to": MAIL["to"], "subject": "Correction: welcome",
            "body": f"Please disregard our earlier message \"{MAIL['subject']}\": it was sent in error and has been "
                    f"withdrawn."}
    with commit():
        recovery_complete_undo(item=RecoveryItem.objects.get(run=run), user=world.oscar, args=args, then="compensate",
                               reason="the outbox shows it")
    return [sent, run_answer(run)]


def idle_unwind(world, commit):
    run = open_run(world, goal="walked away")
    user = step(run, "hr.create_user", USER)
    past = timezone.now() - timedelta(seconds=7200)
    Run.objects.filter(pk=run.pk).update(updated_at=past, idle_deadline=past)
    Action.objects.filter(run=run).update(updated_at=past)
    with commit():
        expired_now = run_expire_idle(run_id=run.pk)
    return [user, expired_now, run_answer(run)]


def ordering_refusals(world, commit):
    run = open_run(world, goal="ordering")
    flight = step(run, "travel.book_flight", FLIGHT)
    charge = step(run, "payments.charge", {"customer": "c", "amount_cents": 100})
    hotel = step(run, "travel.reserve_hotel", HOTEL)  # compensatable after the pivot
    again = step(run, "payments.charge", {"customer": "c", "amount_cents": 200})  # a second pivot
    mail = step(run, "email.send", MAIL)
    late = step(run, "payments.charge", {"customer": "c", "amount_cents": 300})  # a pivot after a retriable step
    return [flight, charge, hotel, again, mail, late, run_answer(run)]


def replay_by_key(world, commit):
    run = open_run(world, goal="replay by key")
    answers = []
    for _ in range(2):
        proposal = action_propose(run=run, tool_name="hr.create_user", args=USER, actor="agent:booker",
                                  idempotency_key=own_key())
        if proposal.claimed:
            execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True)
        answers.append(answer_of(proposal))
    return [*answers, run_answer(run)]


def replay_by_content(world, commit):
    run = open_run(world, goal="replay by content")
    answers = []
    for args in (HOTEL, {"nights": 1.0, "hotel": "H", "guest": "G"}):  # the same content, written again
        proposal = action_propose(run=run, tool_name="travel.reserve_hotel", args=args, actor="agent:booker")
        if proposal.claimed:
            execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True)
        answers.append(answer_of(proposal))
    return [*answers, run_answer(run)]


def key_mismatch(world, commit):
    run = open_run(world, goal="mismatch")
    first = step(run, "hr.create_user", USER, key=own_key())
    other = step(run, "hr.create_user", {"email": "bob@company.com", "name": "Bob"}, key=own_key())
    assert other["http"] == 422
    return [first, other, run_answer(run)]


def _held(action_id: int) -> None:
    """Wait until the held step's window has ended."""
    until = Action.objects.get(pk=action_id).next_attempt_at
    time.sleep(max(0.0, (until - timezone.now()).total_seconds()) + 0.05)


def held_released(world, commit):
    """A held step (issue 29) runs when its window ends: released by the sweep, executed by the engine."""
    run = open_run(world, goal="held, then run")
    user = step(run, "hr.create_user", USER)
    flight = step(run, "travel.book_flight", FLIGHT)  # held
    _held(flight["action"])
    with commit():
        sweep()
    done = run_complete(run=run, actor="agent:booker")
    return [user, flight, answer_of_action(flight["action"]), run_answer(done)]


def held_stopped(world, commit):
    """A held step stopped before its window ends: never run, the earlier steps compensated newest-first."""
    from ledger.engine import holds

    run = open_run(world, goal="held, then stopped")
    user = step(run, "hr.create_user", USER)
    hotel = step(run, "travel.reserve_hotel", HOTEL)
    flight = step(run, "travel.book_flight", FLIGHT)  # held
    with commit():
        holds.action_stop(action_id=flight["action"], actor="user:oscar", by="operator", reason="wrong date")
    return [user, hotel, flight, answer_of_action(flight["action"]), run_answer(run)]


def answer_of_action(action_id: int) -> dict:
    action = Action.objects.get(pk=action_id)
    return {"action": action.pk, "status": action.status, "attempts": action.attempts, "result": action.result,
            "stopped_by": action.stopped_by}


def _held_flight(world):
    tool_upsert(tenant=world.acme, name="travel.book_flight",
                spec=dict(in_process_policy()["tools"]["travel.book_flight"], hold="1s"), actor="test")


def ruled(world, commit):
    """Issue 28: a tool with rules and a limit (decided by the Python path on both: the one-call proposal hands such
    tools over) beside a plain step (the one call on the fast path): allowed, refused by a rule, asked of two people
    by a rule, refused by the limit, and a replay of the allowed one."""
    run = open_run(world, goal="rules")
    user = step(run, "hr.create_user", USER)
    inside = step(run, "email.send", {**MAIL, "to": "ann@company.com"})
    spam = step(run, "email.send", {**MAIL, "subject": "spam"})
    outside = step(run, "email.send", MAIL)
    over = step(run, "email.send", {**MAIL, "to": "bob@company.com"})
    again = step(run, "email.send", {**MAIL, "to": "ann@company.com"})
    assert spam["code"] == over["code"] == "policy_denied" and outside["status"] == "awaiting_approval"
    return [user, inside, spam, outside, over, again, run_answer(run)]


def _rules(world):
    spec = dict(in_process_policy()["tools"]["email.send"], rules=[
        {"when": "args.subject == 'spam'", "deny": "no spam"},
        {"when": "!args.to.endsWith('@company.com')", "approvals_required": 2, "reason": "mail outside the company"}],
        limits=[{"per": "run", "count": 2}])
    tool_upsert(tenant=world.acme, name="email.send", spec=spec, actor="test")


def budget(world, commit):
    """Issue 28: a sum limit within a window and a count limit, with a rule that reads the run's step count, on a
    tool the one-call proposal now takes: the first reservation, the second exactly at the budget's edge (both
    counted under the call's locks on the fast path), the third over it (refused by the Python path on both)."""
    run = open_run(world, goal="budget")
    first = step(run, "travel.reserve_hotel", {**HOTEL, "nights": 1})
    edge = step(run, "travel.reserve_hotel", {**HOTEL, "hotel": "H2", "nights": 2})
    over = step(run, "travel.reserve_hotel", {**HOTEL, "hotel": "H3", "nights": 1})
    return [first, edge, over, run_answer(run), list(Action.objects.filter(run=run).order_by("seq").values_list(
        "policy_decision", flat=True))]


def _budget(world):
    spec = dict(in_process_policy()["tools"]["travel.reserve_hotel"], rules=[
        {"when": "run.steps > 20", "deny": "a run books at most 20 steps"}],
        limits=[{"per": "run", "sum": "args.nights", "max": 3, "window": "1h"}, {"per": "run", "count": 5}])
    tool_upsert(tenant=world.acme, name="travel.reserve_hotel", spec=spec, actor="test")


def _no_gate(world):
    tenant_defaults_set(tenant=world.acme, values={"approval_threshold": "critical"}, actor="user:ada")


def _lost_tools(world):
    _short_lease(world, "hr.create_user")
    spec = dict(in_process_policy()["tools"]["email.send"], timeout=0.2)
    spec.pop("lookup")  # nothing can read its outcome back
    tool_upsert(tenant=world.acme, name="email.send", spec=spec, actor="test")


# Each scenario, what it needs first, and the functions its fast run must call (else it would compare the Python path
# with itself): every function but open_run, propose and outcome (a success), which every scenario calls. A step's
# failure is the same call (`unwind_outcome`): the failure plans' own comparison is below.
OPEN = {"unwind_open_run", "unwind_propose", "unwind_outcome"}
READERS = {"unwind_limits_used"}  # both paths count limits with it on PostgreSQL (it writes only totals, marks)
UNDO = OPEN | {"unwind_compensated"}
SCENARIOS = {
    "ok": (ok_saga, None, OPEN | {"unwind_complete"}),
    "failing": (failing_saga, None, UNDO),
    "retried": (retried_step, _no_gate, OPEN),
    "approved": (approved, None, OPEN), "rejected": (rejected, None, UNDO), "expired": (expired, None, UNDO),
    "cancel_before": (cancel_before, None, UNDO), "cancel_during": (cancel_during, None, UNDO),
    "drift": (drift, None, UNDO),
    "lost_unknown": (lost_unknown, _lost_tools, {"unwind_open_run", "unwind_propose"}),
    "lost_read_back": (lost_read_back, _lost_tools, OPEN),
    "idle": (idle_unwind, None, UNDO), "ordering": (ordering_refusals, _no_gate, OPEN),
    "replay_key": (replay_by_key, None, OPEN), "replay_content": (replay_by_content, None, OPEN),
    "key_mismatch": (key_mismatch, None, OPEN),
    "held_released": (held_released, _held_flight, OPEN | {"unwind_complete"}),
    "held_stopped": (held_stopped, _held_flight, UNDO),
    "completed_undo": (completed_undo, _incomplete_undo, {"unwind_open_run", "unwind_propose", "unwind_compensated"}),
    "rules": (ruled, _rules, OPEN),
    "budget": (budget, _budget, OPEN),
}


# --- running a scenario on each path, and what it left ---------------------------------------------------------------

class Phase:
    """One path's run of a scenario: the answers, the ledger rows it added, and the functions it called."""

    def __init__(self, world, settings, scenario, fast: bool, commit):
        settings.UNWIND_FAST_PATH = fast
        PATH[0] = "fastpath" if fast else "python"
        sandbox_reset(tenant=world.acme)  # each path starts from the same world (its ids are drawn anew)
        last_run = Run.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        last_event = AuditEvent.objects.filter(tenant=world.acme).order_by("-seq").values_list("seq", flat=True)
        last_event = last_event.first() or 0
        with CaptureQueriesContext(connection) as queries:
            self.answers = scenario(world, commit)
        self.called = [q["sql"] for q in queries.captured_queries if "public.unwind_" in q["sql"]]
        self.runs = list(Run.objects.filter(tenant=world.acme, pk__gt=last_run).order_by("pk"))
        self.events = list(AuditEvent.objects.filter(tenant=world.acme, seq__gt=last_event).order_by("seq"))
        self.answers.append([api_view(run) for run in self.runs])


def api_view(run: Run) -> dict:
    """The run as the API shows it to its agent (GET /api/v1/runs/<id>: its steps, checkpoints and links)."""
    from rest_framework.request import Request
    from rest_framework.test import APIRequestFactory

    from ledger.api.runs import run_response

    body = run_response(Request(APIRequestFactory().get(f"/api/v1/runs/{run.pk}")), run).data
    return {"run_id": body.pop("id"), **body}  # (the normaliser names each nested "id" by the list it is in)


def rows(model, queryset) -> list[dict]:
    return [{f.attname: getattr(obj, f.attname) for f in model._meta.concrete_fields} for obj in queryset]


def ledger(phase: Phase) -> dict:
    runs = [r.pk for r in phase.runs]
    actions = Action.objects.filter(run_id__in=runs).order_by("run_id", "seq", "pk")
    return {
        "runs": rows(Run, Run.objects.filter(pk__in=runs).order_by("pk")),
        "actions": rows(Action, actions),
        "attempts": rows(Attempt, Attempt.objects.filter(action__run_id__in=runs).order_by("action__seq", "number")),
        "checkpoints": rows(Checkpoint, Checkpoint.objects.filter(run_id__in=runs).order_by("pk")),
        "recovery": rows(RecoveryItem, RecoveryItem.objects.filter(run_id__in=runs).order_by("pk")),
        "approvals": rows(ApprovalRequest, ApprovalRequest.objects.filter(run_id__in=runs).order_by("pk")),
        "decisions": rows(ApprovalDecision, ApprovalDecision.objects.filter(request__run_id__in=runs).order_by("pk")),
        "events": rows(AuditEvent, phase.events),
        "answers": phase.answers,
    }


class Normaliser:
    """What must differ between two runs of one scenario, written the same way for both; everything else is compared
    as stored.

    - Row ids (runs, actions, attempts, checkpoints, recovery items, approval requests, audit events): drawn from
      sequences, and the fast path draws them ahead (fastpath._next_*), so two runs never share them. Each becomes
      its kind and its rank in the phase (R0, A1…), wherever a field, an event's data, a checkpoint's state, an
      answer, a link (`/api/v1/runs/12`, `/approvals/3/`) or a sentence ("run 12 was cancelled") names it, so a row
      that points at the wrong one still differs.
    - Times (created, updated, finished, sent, leases, deadlines, event times): taken from the clock.
    - The audit chain's seq, prev_hash and hash, the events' `run_state`/`action_state` fingerprints and the seals of
      the events that make a step (`sends`: digests over its key and arguments, which name the run and sandbox records)
      and of those after which its undo is what it is (`undo`: a digest over its result, key and arguments too):
      positions in the tenant's chain and digests over the ids and times above. The events' order and every other
      datum are compared; `verify_chain` checks both chains (each step against its seals too).
    - Derived idempotency keys (`uw-…`) and the keys sent to tools: a digest over the run's id. Explicit keys are
      unique per tenant and agent for good, so each path sends its own (`k-fastpath-1`, `k-python-1`).
    - `args_hash` and `content_key`: digests over arguments that may hold a sandbox record id (below); each is
      checked against the Python rule's own digest of the stored arguments and then written as that rule's name.
    - The fingerprints of the rows an event touched (`rows`: `{"recoveryitem:12": digest}`): digests over the ids and
      times above (the rows themselves are compared in their own tables).
    - Lease owners and the worker names on attempts: a random token per claim and per process; a run's
      `fingerprint_key` (ledger/audit/subjects.py): random per run.
    - Attempt latencies: measured.
    - The sandbox's record ids (`usr_1a2b…`): random per record.
    """

    KINDS = {"runs": "R", "actions": "A", "attempts": "T", "checkpoints": "C", "recovery": "I", "approvals": "Q",
             "decisions": "D", "events": "E"}
    MODELS = {"run": "R", "action": "A", "attempt": "T", "checkpoint": "C", "recoveryitem": "I",
              "approvalrequest": "Q", "approvaldecision": "D"}
    FIELDS = {"run_id": "R", "run": "R", "run_ref": "R", "action_id": "A", "action": "A", "action_ref": "A",
              "compensates_id": "A", "compensates": "A", "repeat_of_id": "A", "repeat_of": "A", "compensation": "A", "for_action": "A",
              "checkpoint_id": "C", "checkpoint": "C", "item_id": "I", "item": "I", "request_id": "Q", "decision_id": "D",
              "request": "Q"}
    CLOCK = {"prev_hash", "hash", "run_state", "action_state", "sends", "undo", "lease_owner", "latency_ms",
             "reclaimed_from", "fingerprint_key"}
    TIME = re.compile(r"\d{4}-\d\d-\d\d[T ][\d:.]+(\+00:00|Z)?")
    RECORD = re.compile(r"\b([a-z]{2,5})_[0-9a-f]{8,}\b")
    KEY = re.compile(r"\buw-[0-9a-f]{16,}\b")
    OWN_KEY = re.compile(r"\bk-(fastpath|python)-")
    WORKER = re.compile(r":[0-9a-f]{8}(?=#|$)")
    NAMED = re.compile(r"\b(run|action) (\d+)\b")  # "run 12 was cancelled" (a "step 3" is its seq, compared as is)
    NAMED_KINDS = {"run": "R", "action": "A"}
    REFUSED_KEY = re.compile(r"^refused-[0-9a-f]{12}:")  # a policy refusal keeps no key (ledger/engine/decision.py `bind`)
    LISTS = {"actions": "A", "checkpoints": "C", "approval": "Q", "steps": "A", "compensations": "A"}  # API bodies
    URL = re.compile(r"/(runs|actions|approvals)/(\d+)\b")  # the API's and the pages' links
    PAGES = {"runs": "R", "actions": "A", "approvals": "Q"}
    KEYED = re.compile(r"^((?:[a-z_]+\.)?)([a-z]+):(\d+)$")

    def __init__(self, data: dict):
        self.ids: dict[tuple[str, int], str] = {}
        for table, kind in self.KINDS.items():
            for rank, row in enumerate(data[table]):
                self.ids[(kind, row["id"])] = f"{kind}{rank}"

    def name(self, kind: str, value):
        if isinstance(value, int) and not isinstance(value, bool):
            return self.ids.get((kind, value), f"{kind}?{value}")  # an id from outside the phase stays visible
        if isinstance(value, list):
            return [self.name(kind, v) for v in value]
        return self(value)  # a link or a sentence under an id's name

    def __call__(self, value, key: str = ""):
        if key in self.FIELDS:
            return self.name(self.FIELDS[key], value)
        if key.endswith("_ids"):  # a checkpoint's completed/pending/awaiting steps, a decision's actions
            return self.name("A", value)
        if key in self.CLOCK:
            return "…" if value not in (None, "") else value
        if isinstance(value, (datetime.datetime, datetime.date)):
            return "TIME"
        if isinstance(value, dict):
            return {self.key(k): "…" if self.KEYED.match(str(k)) else
                    self.name(self.LISTS[key], v) if k == "id" and key in self.LISTS else self(v, k)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v, key) for v in value]
        if isinstance(value, str):
            value = self.OWN_KEY.sub("k-PATH-", self.KEY.sub("uw-KEY", self.TIME.sub("TIME", value)))
            if key == "worker":
                value = self.WORKER.sub(":TOKEN", value)
            value = self.URL.sub(lambda m: f"/{m[1]}/{self.name(self.PAGES[m[1]], int(m[2]))}", value)
            value = self.NAMED.sub(lambda m: f"{m[1]} {self.name(self.NAMED_KINDS[m[1]], int(m[2]))}", value)
            value = self.REFUSED_KEY.sub("refused-TOKEN:", value)
            return self.RECORD.sub(r"\1_ID", value)
        return value

    def key(self, key):
        """Keys that name a row (an event's `rows`: `recoveryitem:12`)."""
        found = self.KEYED.match(key) if isinstance(key, str) else None
        if found and found[2] in self.MODELS:
            return f"{found[1]}{found[2]}:{self.name(self.MODELS[found[2]], int(found[3]))}"
        return key

    def row(self, table: str, row: dict) -> dict:
        out = {}
        for field, value in row.items():
            if field == "id":
                out[field] = self.name(self.KINDS[table], value)
            elif table == "events" and field == "seq":  # the chain's position (a step's seq is compared)
                out[field] = "…"
            elif table == "actions" and field in ("args_hash", "content_key"):
                out[field] = self.digest(row, field)
            else:
                out[field] = self(value, field)
        return out

    @staticmethod
    def digest(row: dict, field: str) -> str:
        from ledger.canonical import digest
        from ledger.models import Tool
        from ledger.engine.proposal import content_key_of, target_of

        if field == "args_hash":
            expected = digest(row["args"])
        elif row["kind"] != "forward" or not row[field]:
            return row[field]
        else:  # the target as proposed (a target named by the result is filled in later)
            tool = Tool.objects.get(pk=row["tool_id"])
            expected = content_key_of(tool=tool, target_id=target_of(tool, row["args"], None), args=row["args"])
        return f"{field} of the args" if row[field] == expected else row[field]

    def ledger(self, data: dict) -> dict:
        return {table: self(rows_, "") if table == "answers" else [self.row(table, r) for r in rows_]
                for table, rows_ in data.items()}


def normalised(phase: Phase) -> dict:
    data = ledger(phase)
    return Normaliser(data).ledger(data)


def differences(fast: dict, slow: dict, path: str = "") -> list[str]:
    """Every place the two ledgers differ, as `path: fast != slow` (all of them, not the first)."""
    if isinstance(fast, dict) and isinstance(slow, dict):
        found = []
        for key in sorted(set(fast) | set(slow), key=str):
            if key not in fast or key not in slow:
                found.append(f"{path}.{key}: only in {'fast' if key in fast else 'python'}")
            else:
                found += differences(fast[key], slow[key], f"{path}.{key}")
        return found
    if isinstance(fast, list) and isinstance(slow, list):
        found = [f"{path}: {len(fast)} rows != {len(slow)} rows"] if len(fast) != len(slow) else []
        for i, (a, b) in enumerate(zip(fast, slow)):
            found += differences(a, b, f"{path}[{i}]")
        return found
    return [] if fast == slow else [f"{path}: {fast!r} != {slow!r}"]


def both_paths(world, settings, name: str, commit) -> tuple[Phase, Phase]:
    scenario, setup, _ = SCENARIOS[name]
    if setup:
        setup(world)
    fast = Phase(world, settings, scenario, True, commit)
    slow = Phase(world, settings, scenario, False, commit)
    return fast, slow


@pytest.fixture
def commit(django_capture_on_commit_callbacks):
    """The on-commit work (the unwinder, the executor after an approval) run as the worker would, at once."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_both_paths_leave_the_same_ledger(tools, settings, commit, name):
    fast, slow = both_paths(tools, settings, name, commit)
    called = {function for sql in fast.called for function in re.findall(r"public\.(unwind_[a-z_]+)\(", sql)}
    # The functions wrote the fast run; none the other, which only counts limits with the same statement.
    assert called - READERS == SCENARIOS[name][2]
    assert {function for sql in slow.called for function in re.findall(r"public\.(unwind_[a-z_]+)\(", sql)} <= READERS
    assert fast.runs and len(fast.runs) == len(slow.runs)
    found = differences(normalised(fast), normalised(slow))
    assert not found, "\n".join(found)
    assert verify_chain(tools.acme.pk).ok


# --- the suite's power: a rule changed in one path only fails it -------------------------------------------------------

def _install_changed(function: str, line: str, changed: str, monkeypatch) -> None:
    """Replace `function` in this test's transaction with its current definition (read from the database, wherever
    its text lives) with one line changed, and let the fast path trust it, as it would once the changed SQL were
    deployed with its fingerprint: the Python path is left as it is. The test's rollback restores the function."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_functiondef(%s::regproc)", [f"public.{function}"])
        (definition,) = cursor.fetchone()
        assert definition.count(line) == 1, f"{function} no longer says {line!r}: pick another line to change"
        cursor.execute(definition.replace(line, changed))
        cursor.execute(fastpath.TRUST)
        fingerprint = cursor.fetchone()[0]
    monkeypatch.setattr(plpgsql, "expected_fingerprint", lambda: fingerprint)
    monkeypatch.setattr(fastpath, "_trusted", weakref.WeakKeyDictionary())  # checked again, against the new text


@pytest.mark.parametrize("function, line, changed, name, where", [
    # The attempt a success ends: the SQL clears its error like the Python path; here it writes one.
    ("unwind_outcome", "error_class = f.error_class", "error_class = 'x'", "ok",
     ".attempts[0].error_class: 'x' != ''"),
    # The completion's run, moved as the plan says: here the call forgets when it finished.
    ("unwind_complete", "finished_at = n.finished_at", "finished_at = NULL", "ok",
     ".runs[0].finished_at: None != 'TIME'"),
    # A limit's room, handed to the call: here it never refuses, and the third reservation goes over the budget.
    ("unwind_propose", "IF v_used[i] > (p_limits->(i - 1)->>'room')::numeric THEN", "IF false THEN", "budget",
     ".actions[2].policy_decision.denied: only in python"),
], ids=["outcome-attempt-error", "complete-run-finished", "propose-limit-room"])
def test_a_rule_changed_only_in_the_sql_is_caught(tools, settings, commit, monkeypatch, function, line, changed,
                                                  name, where):
    before = fastpath._altered
    _install_changed(function, line, changed, monkeypatch)
    fast, slow = both_paths(tools, settings, name, commit)
    assert any(f"{function}(" in sql for sql in fast.called)  # the changed function did run
    assert not fastpath._altered and not before
    found = differences(normalised(fast), normalised(slow))
    assert found and any(where in difference for difference in found), found


# --- one plan, two writers: a decision written alike by PostgreSQL's function and by the Python writer ---------------

class _Undone(Exception):
    """Raised to roll back what a writer wrote, once read, so that the other writer starts from the same rows."""


def written_by(write, plan) -> dict:
    """What `write(plan)` answers and leaves, read inside a savepoint that is then rolled back: the answer, the run, its
    actions and their attempts, its checkpoints, the tenant's chain head and the events after it, every column as
    stored (their hashes too: the function's HMAC must be the Python writer's)."""
    tenant_id, run_id = plan.run.tenant_id, plan.run.pk
    before = AuditHead.objects.get(pk=tenant_id).seq
    seen = {}
    try:
        with transaction.atomic():
            answer = write(plan)
            seen = {"answer": answer if isinstance(answer, str) else rows(Run, [answer]),
                    "run": rows(Run, Run.objects.filter(pk=run_id)),
                    "actions": rows(Action, Action.objects.filter(run_id=run_id).order_by("seq")),
                    "attempts": rows(Attempt, Attempt.objects.filter(action__run_id=run_id).order_by(
                        "action__seq", "number")),
                    "checkpoints": rows(Checkpoint, Checkpoint.objects.filter(run_id=run_id).order_by("pk")),
                    "head": list(AuditHead.objects.filter(pk=tenant_id).values_list("seq", "hash")),
                    # (but the rows' own ids, drawn from a sequence that a rollback does not wind back)
                    "events": [{**row, "id": None} for row in rows(AuditEvent, AuditEvent.objects.filter(
                        tenant_id=tenant_id, seq__gt=before).order_by("seq"))]}
            raise _Undone
    except _Undone:
        pass
    return seen


def by_the_function(plan):
    return fastpath.complete(plan)


def by_python(plan):
    with ledger_transaction(plan.run.tenant_id) as audit:
        return plans.write_completion(plan, log=audit)


def _completion_plan(world):
    """A run whose steps hold every status a completed run may hold (moved behind the engine's back: only what the
    decision reads of them matters here), and its completion decided from the ledger, its checkpoint's id drawn."""
    run = open_run(world, goal="two writers")
    moved = ("failed", "lost", "compensated", "rejected", "skipped")
    steps = [act(run, "hr.create_user", {"email": f"w{i}@company.com", "name": f"W{i}"}) for i in range(len(moved) + 1)]
    for done, status in zip(steps[1:], moved):
        Action.objects.filter(pk=done.pk).update(status=status)
    read, seen = runsteps.run_with_steps(run.pk)
    return completion(read, seen, actor="agent:booker").numbered(fastpath.checkpoint_id()), steps


# What may change between the decision and its writing, applied inside each writer's savepoint alike.
CHANGED_SINCE = {
    "nothing": lambda plan, steps, newer: None,
    "a step": lambda plan, steps, newer: Action.objects.filter(pk=steps[0].pk).update(status="running"),
    "the goal": lambda plan, steps, newer: Run.objects.filter(pk=plan.run.pk).update(goal="another goal"),
    "a checkpoint": lambda plan, steps, newer: Checkpoint.objects.create(
        pk=newer, tenant_id=plan.run.tenant_id, run_id=plan.run.pk, label="resumed", state={}),
}


def both_writers(world, monkeypatch, changed: str) -> tuple[dict, dict]:
    """One plan, and what each writer makes of it after `changed` (CHANGED_SINCE) happened since its decision."""
    plan, steps = _completion_plan(world)
    newer = fastpath.checkpoint_id()  # drawn after the plan's: a checkpoint of the run filed after the completion's
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)  # the writers' clocks (events, checkpoint) read alike

    def after_the_change(write):
        def written(plan_):
            CHANGED_SINCE[changed](plan_, steps, newer)
            return write(plan_)
        return written

    return written_by(after_the_change(by_the_function), plan), written_by(after_the_change(by_python), plan)


@pytest.mark.parametrize("changed", list(CHANGED_SINCE))
def test_both_writers_apply_a_plan_to_the_same_rows_alike(tools, monkeypatch, changed):
    """One completion plan, written by `unwind_complete` and by `plans.write_completion` from the same rows: the same
    answer, and every column of the run, its checkpoints and the chain's events and head the same, byte for byte
    (their clocks frozen alike). When something the plan was decided from changed since, both answer 'stale' and
    write nothing."""
    function, python = both_writers(tools, monkeypatch, changed)
    found = differences(function, python)
    assert not found, "\n".join(found)
    if changed == "nothing":
        assert function["run"][0]["status"] == "completed" and len(function["events"]) == 2
        assert function["checkpoints"][-1]["state"]["pending_action_ids"]  # failed and lost: unfinished
    else:
        assert function["answer"] == plans.STALE and function["events"] == []


def test_a_writer_that_skips_a_guard_is_caught(tools, monkeypatch):
    """The comparison above can fail: a function that no longer compares the run's steps with the plan's writes a
    completion decided before a step went back in flight, where the Python writer answers 'stale'."""
    _install_changed("unwind_complete", "OR v_steps <> p_steps ", "", monkeypatch)
    function, python = both_writers(tools, monkeypatch, "a step")
    assert python["answer"] == plans.STALE and function["answer"] != plans.STALE
    assert ".answer: " in "\n".join(differences(function, python))


# --- a step's success: one plan, two writers -----------------------------------------------------------------------

def success_by_the_function(plan):
    return fastpath.succeed(plan)


def success_by_python(plan):
    with ledger_transaction(plan.run.tenant_id) as audit:
        return plans.write_outcome(plan, log=audit)


def _success_plan(world, *, awaiting: bool):
    """A step in flight (proposed and claimed, its tool not yet answered) and its success decided from the ledger.
    `awaiting`: the run waits for another step's approval, so the decision reads its steps (they become a guard)
    and leaves the run waiting; otherwise it reads none, and the plan writes the step alone."""
    run = open_run(world, goal="two writers")
    other = act(run, "hr.create_user", {"email": "w0@company.com", "name": "W0"})
    flight = action_propose(run=run, tool_name="hr.create_user", args=USER, actor="agent:booker").action
    if awaiting:
        Action.objects.filter(pk=other.pk).update(status="awaiting_approval")
        Run.objects.filter(pk=run.pk).update(status="awaiting_approval")
    read, seen = runsteps.run_with_steps(run.pk)
    step = Action.objects.select_related("tool").get(pk=flight.pk)
    changes = dict(result={"id": "usr_1"}, after=None, verification=None, target_id="usr_1",
                   compensation_plan=step.compensation_plan, lease_owner="", lease_expires_at=None, error_class="",
                   error_message="")
    plan = outcome_plans.success(step, read, changes, latency_ms=12.5, actor="agent:booker", steps_of=lambda: seen)
    assert not (plan.run_changes or plan.checkpoints or plan.emits) and (plan.guards.run.steps is not None) == awaiting
    return plan, [other, flight]


# What may change between a success's decision and its writing: each a guard of the plan (`plans.StepGuards`).
SUCCESS_CHANGED = {
    "nothing": lambda plan, steps: None,
    "the run's status": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(status="needs_attention"),
    "the pivot": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(pivot_committed=True),
    "the goal": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(goal="another goal"),
    "the cancel mark": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(
        cancel_requested_at=timezone.now()),
    "the unwind lease": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(
        lease_expires_at=timezone.now() + timedelta(minutes=1)),
    "the step": lambda plan, steps: Action.objects.filter(pk=steps[1].pk).update(status="lost"),
    "another step": lambda plan, steps: Action.objects.filter(pk=steps[0].pk).update(status="approved"),
}


def success_by_both(world, monkeypatch, changed: str, *, awaiting: bool) -> tuple[dict, dict]:
    plan, steps = _success_plan(world, awaiting=awaiting)
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)

    def after_the_change(write):
        def written(plan_):
            SUCCESS_CHANGED[changed](plan_, steps)
            return write(plan_)
        return written

    return (written_by(after_the_change(success_by_the_function), plan),
            written_by(after_the_change(success_by_python), plan))


@pytest.mark.parametrize("awaiting", [False, True], ids=["running", "awaiting"])
@pytest.mark.parametrize("changed", list(SUCCESS_CHANGED))
def test_both_writers_apply_a_success_alike(tools, monkeypatch, changed, awaiting):
    """One success plan, written by `unwind_outcome` and by `plans.write_outcome` from the same rows: the same answer,
    and every column of the run, its actions and attempts and the chain's events and head the same, byte for byte.
    When a guard's field changed since the decision, both answer 'stale' and write nothing; another step's status
    is a guard only of a decision that read the steps."""
    function, python = success_by_both(tools, monkeypatch, changed, awaiting=awaiting)
    found = differences(function, python)
    assert not found, "\n".join(found)
    if changed == "nothing" or (changed == "another step" and not awaiting):
        step = function["actions"][1]
        assert step["status"] == "succeeded" and step["result"] == {"id": "usr_1"} and step["lease_owner"] == ""
        assert function["attempts"][-1]["outcome"] == "succeeded" and function["attempts"][-1]["latency_ms"] == 12.5
        assert [e["kind"] for e in function["events"]] == ["forward.succeeded"]
        assert function["run"][0]["status"] == ("awaiting_approval" if awaiting else "running")
    else:
        assert function["answer"] == plans.STALE and function["events"] == []
        assert function["actions"][1]["status"] in ("running", "lost")


def test_a_success_writer_that_skips_a_guard_is_caught(tools, monkeypatch):
    """The comparison above can fail: a function that no longer compares the cancel mark writes a success decided
    before the run was cancelled (as if the step still counted as the run's), where the Python writer answers
    'stale' (and the decision made again takes it as a late completion, undone with the rest)."""
    _install_changed("unwind_outcome", "AND (r.cancel_requested_at IS NOT NULL) = p_cancelled ", "", monkeypatch)
    function, python = success_by_both(tools, monkeypatch, "the cancel mark", awaiting=False)
    assert python["answer"] == plans.STALE and function["answer"] != plans.STALE
    assert ".answer: " in "\n".join(differences(function, python))


# --- a step's failure for good: one plan, two writers ----------------------------------------------------------------

def failure_by_the_function(plan):
    return fastpath.outcome(plan)


def _failure_plan(world, *, late: bool):
    """A step in flight after one that succeeded, and its failure for good decided from the ledger (its checkpoint's
    id drawn). Before the pivot in a running run, the unwind starts (the steps read and guarded, the run moved, a
    checkpoint); `late`: the run is unwinding already, and the plan writes the step alone."""
    run = open_run(world, goal="two writers")
    done = act(run, "hr.create_user", {"email": "w0@company.com", "name": "W0"})
    flight = action_propose(run=run, tool_name="hr.create_user", args=USER, actor="agent:booker").action
    if late:
        Run.objects.filter(pk=run.pk).update(status="unwinding")
    read, seen = runsteps.run_with_steps(run.pk)
    step = Action.objects.select_related("tool").get(pk=flight.pk)
    error = ToolError("the directory said no", transient=False, status=422)
    plan = outcome_plans.failure(step, read, error, latency_ms=7.5, actor="agent:booker", steps_of=lambda: seen,
                                 pending_of=lambda pks: list(Action.objects.filter(pk__in=pks).order_by("seq")))
    assert not (plan.others or plan.emits) and plan.unwind_after
    assert bool(plan.run_changes) == bool(plan.checkpoints) == (plan.guards.run.steps is not None) == (not late)
    return plan.numbered([fastpath.checkpoint_id() for _ in plan.checkpoints]), [done, flight]


FAILURE_CHANGED = {**SUCCESS_CHANGED, "another step": lambda plan, steps: Action.objects.filter(
    pk=steps[0].pk).update(status="compensating")}


def failure_by_both(world, monkeypatch, changed: str, *, late: bool) -> tuple[dict, dict, list]:
    plan, steps = _failure_plan(world, late=late)
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)

    def after_the_change(write):
        def written(plan_):
            FAILURE_CHANGED[changed](plan_, steps)
            return write(plan_)
        return written

    return (written_by(after_the_change(failure_by_the_function), plan),
            written_by(after_the_change(success_by_python), plan), steps)


@pytest.mark.parametrize("late", [False, True], ids=["starts-unwind", "late"])
@pytest.mark.parametrize("changed", list(FAILURE_CHANGED))
def test_both_writers_apply_a_failure_alike(tools, monkeypatch, changed, late):
    """One failure plan, written by `unwind_outcome` and by `plans.write_outcome` (each the same writer as a
    success's, with other changes) from the same rows: the same answer, and every column of the run, its actions,
    attempts and checkpoints and the chain's events and head the same. When a guard's field changed since the
    decision, both answer 'stale' and write nothing."""
    function, python, steps = failure_by_both(tools, monkeypatch, changed, late=late)
    found = differences(function, python)
    assert not found, "\n".join(found)
    if changed == "nothing" or (changed == "another step" and late):
        step = function["actions"][1]
        assert step["status"] == "failed" and step["error_class"] == "http_422" and step["lease_owner"] == ""
        assert function["attempts"][-1]["outcome"] == "failed_permanent"
        assert function["attempts"][-1]["error_message"] == "the directory said no"
        assert function["run"][0]["status"] == "unwinding"
        kinds = [e["kind"] for e in function["events"]]
        assert kinds == ["forward.failed"] if late else kinds == ["forward.failed", "run.unwinding", "run.checkpoint"]
        if not late:
            assert function["checkpoints"][-1]["label"] == "unwind_started"
            assert function["checkpoints"][-1]["state"]["pending_action_ids"] == [steps[1].pk]
    else:
        assert function["answer"] == plans.STALE and function["events"] == []


def test_a_failure_writer_that_skips_a_guard_is_caught(tools, monkeypatch):
    """The comparison above can fail: a function that no longer compares the run's steps starts an unwind whose
    checkpoint was decided before an earlier step moved, where the Python writer answers 'stale'."""
    _install_changed("unwind_outcome", "IF p_steps IS NOT NULL AND p_steps <>", "IF false AND p_steps <>",
                     monkeypatch)
    function, python, _ = failure_by_both(tools, monkeypatch, "another step", late=False)
    assert python["answer"] == plans.STALE and function["answer"] != plans.STALE
    assert ".answer: " in "\n".join(differences(function, python))


# --- a compensation's success, and the unwind's start: one plan, two writers ----------------------------------------

def unwind_by_the_function(plan):
    return _answer(fastpath.compensated(plan))


def unwind_by_python(plan):
    with ledger_transaction(plan.run.tenant_id) as audit:
        return _answer(plans.write_unwind(plan, log=audit))


def _answer(written) -> str:
    """A writer's answer as both can give it (the leases it took start on the database's clock, when each wrote)."""
    if not isinstance(written, plans.Unwound):
        return written
    return (f"ok step={written.step} defaults={written.defaults_version} undo={written.undo_id} "
            f"checkpoint={written.checkpoint_id} run_lease={written.run_lease is not None} "
            f"undo_lease={written.undo_lease is not None}")


def _unwinding(world, *, steps: int):
    """A run of `steps` succeeded steps, unwinding, its newest step's undo claimed by an unwinder (its lease taken)
    and its tool answered: the undo's success is decided next."""
    run = open_run(world, goal="two writers")
    done = [act(run, "hr.create_user", {"email": f"w{i}@company.com", "name": f"W{i}"}) for i in range(steps)]
    Run.objects.filter(pk=run.pk).update(status="unwinding")
    claimed, undo = unwind_plans.claim_unwind(run.pk, tenant_id=run.tenant_id, owner="unwinder#1")
    assert claimed and undo is not None and undo.compensates_id == done[-1].pk
    return run, done, Action.objects.select_related("tool", "compensates").get(pk=undo.pk)


def _compensated_plan(world, *, variant: str):
    """A compensation's success decided from the ledger (`unwind_plans.compensated`, its ids drawn by the read):
    `claims`, the unwinder claims the next undo with it; `settles`, no step is left and the run settles compensated;
    `alone`, a compensation recorded without the unwinder (the lease read: whether to queue one)."""
    run, done, undo = _unwinding(world, steps=1 if variant == "settles" else 2)
    changes = dict(result={"deleted": True}, after=None, verification=None, target_id=undo.target_id,
                   compensation_plan=undo.compensation_plan, lease_owner="", lease_expires_at=None, error_class="",
                   error_message="")
    plan = unwind_plans.compensated(undo, changes, unwinding.UnwindState.read(run.pk), latency_ms=3.5,
                                    actor="system", owner=None if variant == "alone" else "unwinder#1")
    assert not plan.then_claim and not plan.emits
    assert (plan.claim is not None) == (variant == "claims") and bool(plan.run_changes) == (variant == "settles")
    assert plan.guards.lease_compared == (variant == "alone")
    return plan, [*done, undo]


def _claim_plan(world, *, variant: str):
    """The unwind's start decided from the ledger (`unwind_plans.claimed`): the run's lease taken, and its newest
    step's undo claimed."""
    run = open_run(world, goal="two writers")
    done = [act(run, "hr.create_user", {"email": f"w{i}@company.com", "name": f"W{i}"}) for i in range(2)]
    Run.objects.filter(pk=run.pk).update(status="unwinding")
    plan = unwind_plans.claimed(unwinding.UnwindState.read(run.pk), owner="unwinder#1")
    assert plan.lease is not None and plan.claim is not None and plan.guards.lease_compared
    return plan, [*done, None]


def _status(pk, status):
    return Action.objects.filter(pk=pk).update(status=status)


# What may change between an unwind's decision and its writing: each a guard of the plan (`plans.UnwindGuards`),
# `steps` the run's forward steps, oldest first, then the undo (None for the unwind's start).
UNWIND_CHANGED = {
    "nothing": lambda plan, steps: None,
    "the run's status": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(status="needs_attention"),
    "the pivot": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(pivot_committed=True),
    "the goal": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(goal="another goal"),
    "the undo": lambda plan, steps: steps[-1] and _status(steps[-1].pk, "lost"),
    "the undone step": lambda plan, steps: _status(steps[-2].pk, "compensation_failed"),
    "another step": lambda plan, steps: _status(steps[0].pk, "failed") if len(steps) > 2 else None,
    "the unwind lease": lambda plan, steps: Run.objects.filter(pk=plan.run.pk).update(
        lease_expires_at=timezone.now() + timedelta(minutes=7)),
    "the threshold": lambda plan, steps: Tenant.objects.filter(pk=plan.run.tenant_id).update(
        approval_threshold="critical"),
}
UNWIND_PLANS = {"claims": _compensated_plan, "settles": _compensated_plan, "alone": _compensated_plan,
                "starts": _claim_plan}


def unwind_by_both(world, monkeypatch, changed: str, *, variant: str) -> tuple[dict, dict, list]:
    plan, steps = UNWIND_PLANS[variant](world, variant=variant)
    frozen = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: frozen)

    def after_the_change(write):
        def written(plan_):
            UNWIND_CHANGED[changed](plan_, steps)
            return write(plan_)
        return written

    seen = [written_by(after_the_change(write), plan) for write in (unwind_by_the_function, unwind_by_python)]
    for rows_ in seen:  # the leases each writer started on the database's clock, and its new attempts' ids
        for row in rows_["run"] + rows_["actions"]:
            row["lease_expires_at"] = row["lease_expires_at"] is not None
        for row in rows_["attempts"]:
            row["id"] = None
    return *seen, steps


def _guarded(variant: str, changed: str, plan_steps: int) -> bool:
    """Whether `changed` is a guard of the `variant` plan: the lease only where the decision read it, the threshold
    only where it claims an undo, the undo only where there is one, another step only where there is one."""
    return not (changed == "nothing" or (changed == "the unwind lease" and variant in ("claims", "settles"))
                or (changed == "the threshold" and variant in ("settles", "alone"))
                or (changed == "the undo" and variant == "starts")
                or (changed == "another step" and plan_steps <= 2))


@pytest.mark.parametrize("variant", list(UNWIND_PLANS))
@pytest.mark.parametrize("changed", list(UNWIND_CHANGED))
def test_both_writers_apply_an_unwind_step_alike(tools, monkeypatch, changed, variant):
    """One plan of a step of an unwind (a compensation's success with the next undo claimed, with the run settled,
    recorded alone; the unwind's start), written by `unwind_compensated` and by `plans.write_unwind` from the same
    rows: the same answer, and every column of the run, its actions, attempts and checkpoints and the chain's events
    and head the same, byte for byte (the leases each started on the database's clock: whether set). When a guard's
    field changed since the decision, both answer 'stale' and write nothing."""
    function, python, steps = unwind_by_both(tools, monkeypatch, changed, variant=variant)
    found = differences(function, python)
    assert not found, "\n".join(found)
    if _guarded(variant, changed, len(steps)):
        assert function["answer"] == plans.STALE and function["events"] == []
        return
    assert function["answer"].startswith("ok ")
    kinds = [e["kind"] for e in function["events"]]
    undone = [] if variant == "starts" else ["compensation.succeeded", "forward.compensated"]
    following = {"claims": ["compensation.proposed", "forward.compensating"], "starts": [
        "compensation.proposed", "forward.compensating"], "settles": ["run.compensated", "run.checkpoint"],
        "alone": []}[variant]
    assert kinds == undone + following
    statuses = [row["status"] for row in function["actions"]]
    if variant == "claims":
        assert statuses == ["compensating", "compensated", "succeeded", "running"] or changed != "nothing"
        assert function["attempts"][-1]["finished_at"] is None and function["actions"][-1]["lease_expires_at"]
    if variant == "settles":
        assert function["run"][0]["status"] == "compensated" and not function["run"][0]["lease_expires_at"]
        assert function["checkpoints"][-1]["label"] == "compensated"
    if variant == "starts":
        assert function["run"][0]["lease_expires_at"] and statuses[-1] == "running"


def test_an_unwind_writer_that_skips_a_guard_is_caught(tools, monkeypatch):
    """The comparison above can fail: a function that no longer compares the tenant's approval threshold claims an
    undo without approval decided before the threshold changed, where the Python writer answers 'stale'."""
    _install_changed("unwind_compensated", "IF v_threshold IS DISTINCT FROM p_threshold THEN", "IF false THEN",
                     monkeypatch)
    function, python, _ = unwind_by_both(tools, monkeypatch, "the threshold", variant="claims")
    assert python["answer"] == plans.STALE and function["answer"] != plans.STALE
    assert ".answer: " in "\n".join(differences(function, python))
