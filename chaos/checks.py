"""The verdict on a chaos run: for every run, did it end well by the ledger, and does the world agree?

A run passes when
- it ended `completed`, `compensated` (or `closed` by a person) with no open recovery item, or
  `needs_attention` with exactly one open recovery item;
- every forward step's effect in the sandbox matches its ledger status: a succeeded step's effect stands,
  a compensated one's is undone (cancelled, refunded, revoked, deleted, restored, or corrected by email),
  a failed or skipped one left no effect — unless the open recovery item names that very step;
- a compensated run has nothing left standing, a completed run has every step succeeded;
- no effect of any of its steps or compensations happened twice.
Effects are mapped to ledger entries by the Idempotency-Key Unwind sent (`Action.tool_key`).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ledger.audit.verify import verify_chain
from ledger.canonical import dumps
from ledger.models import Action, ActionClass, ActionKind, Attempt, AuditEvent, Run, Tenant
from ledger.models import ActionStatus as A
from ledger.models import RunStatus as R
from recovery.models import RecoveryItem
from sandbox.models import (
    Charge,
    DirectoryUser,
    FlightBooking,
    HotelReservation,
    IdempotencyRecord,
    License,
    Message,
    Ticket,
    ToolCall,
)

OUR_KEYS = "uw-"  # the prefix of every Idempotency-Key Unwind sends

# Tools that create a record: where its id is in the answer, and how to tell whether it still stands.
CREATED = {
    "hr.create_user": ("id", lambda pk: "stands" if DirectoryUser.objects.filter(pk=pk).exists() else "undone"),
    "licenses.provision": ("id", lambda pk: _status(License, pk, stands="active", undone="revoked")),
    "travel.book_flight": ("booking_id", lambda pk: _status(FlightBooking, pk, stands="booked", undone="cancelled")),
    "travel.reserve_hotel": ("reservation_id", lambda pk: _status(HotelReservation, pk, stands="reserved",
                                                                   undone="cancelled")),
    "payments.charge": ("charge_id", lambda pk: _status(Charge, pk, stands="captured", undone="refunded")),
}
NOT_DONE = {A.FAILED, A.SKIPPED, A.REJECTED, A.EXPIRED}
OPEN_QUESTION = {A.COMPENSATION_FAILED, A.LOST, A.COMPENSATING}
IN_FLIGHT = {A.PLANNED, A.AWAITING_APPROVAL, A.APPROVED, A.RUNNING, A.RETRY_SCHEDULED}


def _status(model, pk, *, stands: str, undone: str) -> str:
    status = model.objects.filter(pk=pk).values_list("status", flat=True).first()
    return {stands: "stands", undone: "undone", None: "missing"}.get(status, f"status {status}")


@dataclass
class World:
    """The sandbox's evidence, indexed by the Idempotency-Key each call carried."""

    effects: Counter          # (tool, key) -> calls that applied an effect
    answers: dict             # (tool, key) -> the stored answer of the first successful call
    messages: Counter         # key -> messages sent with it
    faults: dict              # key -> [fault labels of the calls that carried it]

    @classmethod
    def load(cls) -> World:
        effects, faults = Counter(), defaultdict(list)
        for tool, key, applied, mode, status in ToolCall.objects.values_list(
                "tool", "idempotency_key", "effect_applied", "fault", "status").iterator(chunk_size=5000):
            if applied:
                effects[(tool, key)] += 1
            if mode:
                faults[key].append(fault_label(mode, status))
        answers = {(tool, key): response for tool, key, response in
                   IdempotencyRecord.objects.values_list("tool", "key", "response").iterator(chunk_size=5000)}
        messages = Counter(Message.objects.values_list("idempotency_key", flat=True).iterator(chunk_size=5000))
        return cls(effects=effects, answers=answers, messages=messages, faults=faults)


def fault_label(mode: str, status: int) -> str:
    if mode == "status":
        return "http_429" if status == 429 else "http_5xx" if status >= 500 else "http_4xx"
    return mode


@dataclass
class Verdict:
    run_id: int
    tenant: str
    status: str
    reason: str
    problems: list = field(default_factory=list)
    faults: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Checker:
    def __init__(self, tenant_ids: list[int], *, seen: dict[int, set[int]] | None = None,
                 anomalies: dict[int, list[str]] | None = None):
        """`seen`: the action ids each run's agent was given; `anomalies`: answers an agent should not have
        had (reported apart: the world may still match the outcome)."""
        self.tenant_ids = tenant_ids
        self.seen = seen or {}
        self.anomalies = anomalies or {}
        self.world = World.load()
        self.actions = list(Action.objects.filter(tenant_id__in=tenant_ids).select_related("tool", "tenant")
                            .order_by("run_id", "seq"))
        self.by_run: dict[int, list[Action]] = defaultdict(list)
        for action in self.actions:
            self.by_run[action.run_id].append(action)
        self.compensations: dict[int, list[Action]] = defaultdict(list)
        for action in self.actions:
            if action.kind == ActionKind.COMPENSATION:
                self.compensations[action.compensates_id].append(action)
        self.items = {item.run_id: item for item in RecoveryItem.objects.filter(tenant_id__in=tenant_ids, status="open")}
        self.open_items = Counter(RecoveryItem.objects.filter(tenant_id__in=tenant_ids, status="open")
                                  .values_list("run_id", flat=True))
        self.lost_attempts = Counter(Attempt.objects.filter(action__tenant_id__in=tenant_ids, outcome="lost")
                                     .values_list("action__run_id", flat=True))

    # --- the world, per ledger entry -------------------------------------------------------------

    def applied(self, action: Action) -> bool:
        if not action.tool.honours_idempotency_key:
            return self.world.messages[action.tool_key] > 0 if action.tool.name == "email.send" else \
                self.world.effects[(action.tool.name, action.tool_key)] > 0
        return self.world.effects[(action.tool.name, action.tool_key)] > 0

    def state(self, action: Action) -> str:
        """stands, undone, missing, or what else the world says about a forward step's effect."""
        name = action.tool.name
        if name in CREATED:
            id_field, look = CREATED[name]
            answer = self.world.answers.get((name, action.tool_key))
            if not isinstance(answer, dict) or not answer.get(id_field):
                return "missing"
            return look(answer[id_field])
        if name == "crm.update_ticket":
            ticket = Ticket.objects.filter(tenant_id=action.tenant_id, number=action.args.get("ticket_id")).first()
            if ticket is None:
                return "missing"
            before = action.before or {}
            if before and ticket.priority == before.get("priority") and ticket.status == before.get("status"):
                return "undone"
            wanted = {k: action.args[k] for k in ("priority", "status") if k in action.args}
            current = {"priority": ticket.priority, "status": ticket.status}
            return "stands" if all(current[k] == v for k, v in wanted.items()) else f"changed to {current}"
        if name == "email.send":
            corrected = any(c.status == A.SUCCEEDED and self.world.messages[c.tool_key] > 0
                            for c in self.compensations.get(action.pk, []))
            return "undone" if corrected else "stands"
        return "stands"

    def duplicates(self, action: Action) -> int:
        if action.tool.name == "email.send":
            return max(0, self.world.messages[action.tool_key] - 1)
        if action.tool.honours_idempotency_key:
            return max(0, self.world.effects[(action.tool.name, action.tool_key)] - 1)
        return 0

    # --- verdicts --------------------------------------------------------------------------------

    def verdict(self, run: Run) -> Verdict:
        item = self.items.get(run.pk)
        verdict = Verdict(run.pk, run.tenant.slug, run.status, run.attention_reason)
        problems = verdict.problems
        open_items = self.open_items[run.pk]
        if run.status in (R.COMPLETED, R.COMPENSATED, R.CLOSED):
            if open_items:
                problems.append(f"{run.status} but {open_items} recovery item(s) still open")
        elif run.status == R.NEEDS_ATTENTION:
            if open_items != 1:
                problems.append(f"needs_attention with {open_items} open recovery items (expected 1)")
        else:
            problems.append(f"not settled: still {run.status}")
        for action in self.by_run.get(run.pk, []):
            extra = self.duplicates(action)
            if extra:
                problems.append(f"{action.kind} {action.tool.name} (step {action.seq}, action {action.pk}) took effect "
                                f"{extra + 1} times")
            if action.kind == ActionKind.FORWARD and action.tool.action_class != ActionClass.READ_ONLY:
                problems += self.forward_problems(run, action, item)
            verdict.faults += self.world.faults.get(action.tool_key, [])
        if self.lost_attempts[run.pk]:
            verdict.faults += ["lost_attempt"] * self.lost_attempts[run.pk]
        seen = self.seen.get(run.pk, set())
        known = {a.pk for a in self.by_run.get(run.pk, [])}
        for missing in sorted(seen - known):
            problems.append(f"action {missing} was answered to the agent but is not in this run's ledger")
        return verdict

    def forward_problems(self, run: Run, action: Action, item: RecoveryItem | None) -> list[str]:
        where = f"{action.tool.name} (step {action.seq}, action {action.pk})"
        status = action.status
        applied = self.applied(action)
        if status in IN_FLIGHT:
            return [f"{where} is still {status}"]
        if status == A.SUCCEEDED:
            if not applied:
                return [f"{where} succeeded by the ledger but no effect is in the world"]
            state = self.state(action)
            if state != "stands":
                return [f"{where} succeeded by the ledger but the world says {state}"]
            if run.status == R.COMPENSATED:
                return [f"{where} still stands in a compensated run"]
            return []
        if status == A.COMPENSATED:
            state = self.state(action)
            if applied and state != "undone":
                return [f"{where} compensated by the ledger but the world says {state}"]
            return []
        if status in NOT_DONE:
            if not applied:
                return []
            named = item is not None and (item.action_id == action.pk or f"(step {action.seq})" in item.detail)
            if run.status == R.NEEDS_ATTENTION and named:
                return []
            return [f"{where} is {status} by the ledger but its effect is in the world ({self.state(action)}), "
                    f"and the run is {run.status}" + ("" if run.status != R.NEEDS_ATTENTION else
                                                      " with a recovery item that does not name it")]
        if status in OPEN_QUESTION:
            if run.status not in (R.NEEDS_ATTENTION, R.CLOSED):
                return [f"{where} is {status} but the run is {run.status}, not in the recovery queue"]
            return []
        return [f"{where} has an unexpected status {status}"]

    def lost_entries(self) -> list[str]:
        """Ledger entries that should exist and do not: runs and actions the agents were given, effects with
        a key Unwind sent for an action that is not in the ledger."""
        lost = []
        runs = set(Run.objects.filter(tenant_id__in=self.tenant_ids).values_list("pk", flat=True))
        for run_id in sorted(set(self.seen) - runs):
            lost.append(f"run {run_id} was answered to an agent but is not in the ledger")
        ours = {a.tool_key for a in Action.objects.all().select_related(None).only("tenant_id", "idempotency_key")}
        keys = {key for _, key in self.world.effects} | set(self.world.messages)
        for key in sorted(k for k in keys if k.startswith(OUR_KEYS) and k not in ours):
            lost.append(f"an effect was made with key {key}, which no ledger entry has")
        return lost

    def never_sent_items(self) -> list[str]:
        """Recovery items (open or resolved) opened for a step whose calls never left Unwind: a key-ignoring tool's
        step none of whose attempts was marked sent, or any step whose every finished attempt failed to connect
        (`not_sent`). The tool never got the call, so the step should have been sent again, not handed to a person."""
        items = []
        for item in RecoveryItem.objects.filter(tenant_id__in=self.tenant_ids, action__isnull=False) \
                .select_related("action__tool"):
            attempts = list(Attempt.objects.filter(action=item.action))
            if not attempts or item.action.kind != ActionKind.FORWARD or item.action.tool.executor == "client":
                continue
            unsent = all(a.sent_at is None for a in attempts) if not item.action.tool.honours_idempotency_key \
                else all(a.error_class == "not_sent" for a in attempts if a.finished_at is not None)
            if unsent and any(a.finished_at is not None for a in attempts):
                items.append(f"item {item.pk} ({item.reason}) for {item.action.tool.name} (step {item.action.seq}, "
                             f"action {item.action_id}), which was never sent")
        return items

    def report(self) -> dict:
        runs = list(Run.objects.filter(tenant_id__in=self.tenant_ids).select_related("tenant").order_by("pk"))
        verdicts = [self.verdict(run) for run in runs]
        lost = self.lost_entries()
        duplicates = sum(self.duplicates(a) for a in self.actions)
        audits = {}
        for tenant in Tenant.objects.filter(pk__in=self.tenant_ids).order_by("pk"):
            chain = verify_chain(tenant.pk)
            audits[tenant.slug] = {"ok": chain.ok, "events": chain.events, "problem": chain.problem}
        faults = Counter()
        kinds = {a.tool_key: a.kind for a in self.actions}
        for key, labels in self.world.faults.items():
            prefix = "compensation " if kinds.get(key) == ActionKind.COMPENSATION else ""
            for label in labels:
                faults[prefix + label] += 1
        ok = sum(1 for v in verdicts if v.ok)
        return {
            "runs": len(runs),
            "runs_ok": ok,
            "integrity_pct": round(100.0 * ok / len(runs), 2) if runs else 100.0,
            "outcomes": dict(sorted(Counter(v.status for v in verdicts).items())),
            "attention_reasons": dict(sorted(Counter(v.reason for v in verdicts if v.status == R.NEEDS_ATTENTION).items())),
            "duplicate_effects": duplicates,
            "never_sent_items": len(never_sent := self.never_sent_items()),
            "never_sent": never_sent[:50],
            "lost_entries": len(lost),
            "lost": lost[:50],
            "audit_ok": all(a["ok"] for a in audits.values()),
            "wrong_answers": [{"run": run_id, "answer": answer} for run_id, answers in sorted(self.anomalies.items())
                              for answer in answers],
            "audit": audits,
            "tool_faults": dict(sorted(faults.items())),
            "actions": len(self.actions),
            "violations": [
                {"run": v.run_id, "tenant": v.tenant, "status": v.status, "reason": v.reason, "problems": v.problems,
                 "faults_seen": dict(Counter(v.faults)), "history": self.history(v.run_id)}
                for v in verdicts if not v.ok
            ],
        }

    def history(self, run_id: int) -> list[dict]:
        """What the ledger says happened to a failing run, action by action: each attempt (who ran it, how it
        ended) and the audit events, in order — enough to tell which path acted twice."""
        rows = []
        for action in self.by_run.get(run_id, []):
            attempts = [f"#{a.number} {a.worker} {a.outcome or 'unfinished'} {a.error_class}".strip()
                        for a in Attempt.objects.filter(action=action).order_by("number")]
            audit = [f"{e.seq} {e.kind} {e.actor} {dumps(e.data)[:200]}"
                     for e in AuditEvent.objects.filter(tenant_id=action.tenant_id, action_ref=action.pk).order_by("seq")]
            rows.append({"action": action.pk, "kind": action.kind, "tool": action.tool.name, "status": action.status,
                         "attempts": attempts, "audit": audit})
        return rows
