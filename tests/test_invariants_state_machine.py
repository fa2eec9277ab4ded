"""Random interleavings of propose, fail, approve, reject, expire, cancel, complete, resume, compensate and
close never break the invariants (hypothesis state machine over the real services and the sandbox).

Each example gets a tenant of its own, so examples do not see each other's ledger.
"""
import functools
import itertools
from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, settings as hsettings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from approvals.models import ApprovalRequest
from approvals.services import approval_decide, approvals_expire
from ledger.audit.verify import verify_chain
from ledger.errors import UnwindError
from ledger.models import Action, Run
from ledger.engine import execution
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_cancel, run_complete, run_open
from ledger.tenancy import agent_create, membership_set, tenant_create
from ledger.policy.versions import tools_load
from recovery.models import RecoveryItem
from recovery.services import recovery_close, recovery_compensate, recovery_resume
from sandbox.faults import fault_add
from sandbox.selectors import call_list
from sandbox.services import sandbox_reset
from tests.conftest import in_process_policy

STEPS = [
    ("travel.book_flight", lambda n: {"passenger": f"P{n}", "flight": "LH1", "date": "2026-12-01"}),
    ("travel.reserve_hotel", lambda n: {"guest": f"G{n}", "hotel": "H", "nights": 1 + n % 3}),
    ("hr.create_user", lambda n: {"email": f"u{n}@x.io", "name": f"U{n}"}),
    ("crm.update_ticket", lambda n: {"ticket_id": "T-311", "priority": ["high", "urgent", "normal"][n % 3]}),
    ("payments.charge", lambda n: {"customer": f"c{n}", "amount_cents": 100 + n}),
    ("email.send", lambda n: {"to": f"x{n}@x.io", "subject": f"S{n}", "body": "b"}),
]
COMPENSATIONS = ["travel.cancel_flight", "travel.cancel_hotel", "hr.delete_user", "payments.refund"]
FINAL = {"completed", "compensated", "closed"}
_counter = itertools.count()
CAPTURE = {}


def as_worker(fn):
    """Run a rule and then the work it queued after commit, as a worker would."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CAPTURE["on_commit"](execute=True):
            return fn(*args, **kwargs)
    return wrapper


class Unwinding(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        n = next(_counter)
        self.tenant = tenant_create(slug=f"sm{n}")
        sandbox_reset(tenant=self.tenant)  # each machine starts its own tenant's world
        tools_load(tenant=self.tenant, document=in_process_policy(), actor="test")
        self.agent, _ = agent_create(tenant=self.tenant, name="a")
        for name in ("alice", "oscar"):
            membership_set(tenant=self.tenant, user=USERS[name], role="approver" if name == "alice" else "operator")
        self.runs: list[int] = []
        self.n = 0

    def _run(self, index):
        return Run.objects.get(pk=self.runs[index % len(self.runs)]) if self.runs else None

    @rule()
    @as_worker
    def open_run(self):
        run = run_open(tenant=self.tenant, agent=self.agent, goal="random", actor="agent:a")
        self.runs.append(run.pk)

    @rule(index=st.integers(0, 5), step=st.integers(0, len(STEPS) - 1))
    @as_worker
    def propose(self, index, step):
        run = self._run(index)
        if run is None:
            return
        tool, make = STEPS[step]
        self.n += 1
        try:
            proposal = action_propose(run=run, tool_name=tool, args=make(self.n), actor="agent:a")
        except UnwindError:
            return
        if proposal.claimed:
            execution.execute(proposal.action.pk, owner=proposal.owner)
            if Run.objects.get(pk=run.pk).status == "unwinding":
                execution.unwind(run.pk)

    @rule(tool=st.sampled_from([name for name, _ in STEPS] + COMPENSATIONS),
          status=st.sampled_from([400, 409, 500, 503]), times=st.integers(1, 6))
    def fault(self, tool, status, times):
        fault_add({"tool": tool, "mode": "status", "status": status, "times": times}, tenant=self.tenant)

    @rule(approve=st.booleans())
    @as_worker
    def decide(self, approve):
        request = ApprovalRequest.objects.filter(tenant=self.tenant, status="pending").first()
        if request is not None:
            try:
                approval_decide(request=request, user=USERS["alice"], approve=approve, reason="random reason")
            except UnwindError:
                pass

    @rule()
    @as_worker
    def expire(self):
        approvals_expire(now=timezone.now() + timedelta(days=1))

    @rule(index=st.integers(0, 5), complete=st.booleans())
    @as_worker
    def end(self, index, complete):
        run = self._run(index)
        if run is None:
            return
        try:
            (run_complete if complete else run_cancel)(run=run, actor="agent:a")
        except UnwindError:
            pass

    @rule(choice=st.sampled_from(["resume", "compensate", "close"]))
    @as_worker
    def resolve(self, choice):
        item = RecoveryItem.objects.filter(tenant=self.tenant, status="open").first()
        if item is None:
            return
        service = {"resume": recovery_resume, "compensate": recovery_compensate, "close": recovery_close}[choice]
        try:
            service(item=item, user=USERS["oscar"], reason="decided by a person")
        except UnwindError:
            pass

    @invariant()
    def runs_are_never_left_silently_partial(self):
        for run in Run.objects.filter(tenant=self.tenant):
            open_items = RecoveryItem.objects.filter(run=run, status="open").count()
            assert open_items == (1 if run.status == "needs_attention" else 0), (run.status, open_items)
            forward = Action.objects.filter(run=run, kind="forward")
            if run.status == "compensated":
                assert not forward.filter(status__in=["succeeded", "compensating", "running", "compensation_failed",
                                                      "lost"]).exclude(compensation_plan__strategy="none").exists()
            if run.status in FINAL:
                assert not Action.objects.filter(run=run, status__in=["running", "retry_scheduled", "awaiting_approval",
                                                                       "planned", "approved"]).exists()
            if run.status == "awaiting_approval":
                assert ApprovalRequest.objects.filter(run=run, status="pending").exists()

    @invariant()
    def no_effect_happened_twice(self):
        keys = list(Action.objects.filter(tenant=self.tenant).values_list("tenant_id", "idempotency_key"))
        actions = Action.objects.filter(tenant=self.tenant).select_related("tool")
        tool_keys = {a.tool_key: a.tool.honours_idempotency_key for a in actions}
        seen = {}
        for call in call_list(tenant=self.tenant)["results"]:
            if call["effect_applied"] and call["idempotency_key"] in tool_keys:
                seen[call["idempotency_key"]] = seen.get(call["idempotency_key"], 0) + 1
        assert all(count == 1 for count in seen.values()), seen
        assert len(keys) == len(set(keys))

    @invariant()
    def the_audit_chain_verifies(self):
        report = verify_chain(self.tenant.pk)
        assert report.ok, report.problem


USERS = {}


@pytest.mark.slow
def test_random_interleavings_keep_the_invariants(db, django_capture_on_commit_callbacks, settings):
    from django.contrib.auth import get_user_model
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.UNWIND_MAX_BACKOFF = 0.01
    User = get_user_model()
    USERS.update(alice=User.objects.create_user("alice", "alice@x.io", "pw"),
                 oscar=User.objects.create_user("oscar", "oscar@x.io", "pw"))

    CAPTURE["on_commit"] = django_capture_on_commit_callbacks
    run_state_machine_as_test(Unwinding, settings=hsettings(
        max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
