"""Issue 40: no engine rule written in two languages. Python decides; the PL/pgSQL functions write what they were
told under the guards the decision was made under (docs/architecture.md, "Every rule and the one place it is
decided").

- No status name appears as a literal in any function's file: the statuses come from Python's enums (a status
  added to ActionStatus or RunStatus is covered without touching this test), handed to the functions as arguments.
- No function reads what the ordering law (a step's saga role) or the same-content match (its content key) decide
  from: both are decided in ledger/engine/runsteps.py, and the one-call proposal only compares the run's actions
  with those the decision was made from.
- No function builds a checkpoint's state (its step lists, its summary: `runstate.checkpoint_state` decides them)
  or sorts a run's steps by a list of statuses it is handed: only the limits count steps by status (the statuses
  that count are `policy.limits.COUNTED`, handed to them).
- A stale decision is never written: a run copy whose steps are out of date is decided again, not recorded.
"""
from __future__ import annotations

import re

import pytest
from django.db import connection

from ledger.engine import fastpath, plans, plpgsql, runstate, runsteps
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_complete
from ledger.errors import OrderingViolation
from ledger.models import Action, ActionStatus, Checkpoint, Run, RunStatus
from tests.conftest import needs_postgres
from tests.helpers import act, open_run

STATUSES = {status.value for status in ActionStatus} | {status.value for status in RunStatus}
LITERAL = re.compile(r"'((?:[^']|'')*)'")
# What the ordering law and the content match read of a step: no function may read them.
RULE_COLUMNS = ("saga_role", "content_key")


def _code(text: str) -> str:
    """A function's text without its comments (which may name a status to say what the caller decides)."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def test_no_status_literal_in_any_sql_file():
    found = {}
    for name, function in plpgsql.functions().items():
        literals = {literal.lower() for literal in LITERAL.findall(_code(function.text))}
        if literals & STATUSES:
            found[name] = sorted(literals & STATUSES)
    assert not found, f"status names written in SQL (hand them from Python's transition tables instead): {found}"


def test_no_sql_file_reads_what_the_ordering_law_or_the_content_match_decide_from():
    found = {name: [column for column in RULE_COLUMNS if re.search(rf"\b{column}\b", _code(function.text))]
             for name, function in plpgsql.functions().items()}
    assert not {name: columns for name, columns in found.items() if columns}, found


# What a checkpoint records of a run besides the run's own columns: decided by `runstate.checkpoint_state` alone.
CHECKPOINT_KEYS = set(runstate.checkpoint_state(Run(status=RunStatus.RUNNING), [])) - {
    f.column for f in Run._meta.concrete_fields}
# The functions that count a run's or a tenant's steps toward a limit, by the statuses handed to them (`p_counted`,
# the triggers' arguments): the one rule that sorts steps by status in SQL, decided in `policy.limits.COUNTED`.
LIMIT_COUNTERS = {"unwind_limits_used", "unwind_limit_measure", "unwind_limit_totals_keep"}
STATUS_LIST = re.compile(r"\bstatus\s*=\s*ANY\s*\(", re.IGNORECASE)


def checkpoint_keys_in(text: str) -> set[str]:
    return {key for key in CHECKPOINT_KEYS if re.search(rf"\b{key}\b", _code(text))}


def test_no_sql_file_builds_a_checkpoint_or_sorts_steps_by_a_status_list():
    assert "summary" in CHECKPOINT_KEYS and "completed_action_ids" in CHECKPOINT_KEYS
    built = {name: sorted(checkpoint_keys_in(function.text)) for name, function in plpgsql.functions().items()}
    assert not {name: keys for name, keys in built.items() if keys}, built
    sorting = {name for name, function in plpgsql.functions().items() if STATUS_LIST.search(_code(function.text))}
    assert sorting <= LIMIT_COUNTERS, sorting - LIMIT_COUNTERS


def test_the_check_sees_a_checkpoint_built_in_sql():
    """The check above can fail: a completion that lists the run's done steps itself, from a status list, is found."""
    text = plpgsql.functions()["unwind_complete"].text
    planted = text.replace("RETURN jsonb_build_object('outcome', 'ok',", "v_run.id := (SELECT jsonb_build_object("
                           "'completed_action_ids', jsonb_agg(a.id) FILTER (WHERE a.status = ANY (p_done)))"
                           " FROM ledger_action a);\n    RETURN jsonb_build_object('outcome', 'ok',")
    assert planted != text
    assert checkpoint_keys_in(planted) == {"completed_action_ids"} and STATUS_LIST.search(_code(planted))


def test_the_check_sees_a_status_literal_and_the_law_query(tmp_path):
    """The two checks above can fail: a function that names a status, or looks for an earlier pivot, is found."""
    text = plpgsql.functions()["unwind_outcome"].text
    planted = text.replace("a.status = p_from", "a.status = 'running'")
    assert planted != text
    assert set(LITERAL.findall(_code(planted))) & STATUSES == {"running"}
    assert re.search(r"\bsaga_role\b", _code(text + "\nSELECT 1 FROM ledger_action a WHERE a.saga_role = ANY (p_roles)"))


@pytest.fixture
def no_gate(tools):
    tools.acme.approval_threshold = "critical"
    tools.acme.save()
    return tools


@needs_postgres
def test_a_decision_from_stale_steps_is_decided_again_not_written(no_gate, monkeypatch, settings):
    """The process decides a proposal from the steps it holds for the run; the writer checks them under its locks.
    Here the copy says the run's pivot was refused (no earlier step then), while the ledger has it succeeded since,
    with the same step number: the call must answer 'stale', and the decision made again refuses a second pivot."""
    settings.UNWIND_FAST_PATH = True  # about the one-call writer: on even in the run with UNWIND_FAST_PATH=0
    run = open_run(no_gate)
    first = action_propose(run=run, tool_name="payments.charge", args={"customer": "c", "amount_cents": 100},
                           actor="agent:booker").action
    Action.objects.filter(pk=first.pk).update(status=ActionStatus.FAILED, error_class="refused", lease_owner="",
                                              lease_expires_at=None)
    stale, _ = runsteps.run_with_steps(run.pk)  # what a process holds: the pivot refused
    Action.objects.filter(pk=first.pk).update(status=ActionStatus.SUCCEEDED, error_class="")
    answers = []
    propose = fastpath.propose

    def recorded(*args, **kwargs):
        answer = propose(*args, **kwargs)
        answers.append(answer[0])
        return answer

    monkeypatch.setattr(fastpath, "propose", recorded)
    with pytest.raises(OrderingViolation) as refused:
        action_propose(run=stale, tool_name="payments.charge", args={"customer": "c", "amount_cents": 200},
                       actor="agent:booker")
    assert refused.value.extra["rule"] == "one_pivot"
    assert answers[0] == "stale"  # the writer was asked, and refused to write a stale decision
    assert list(Action.objects.filter(run_id=run.pk).values_list("pk", flat=True)) == [first.pk]


@pytest.mark.parametrize("one_call", [True, False], ids=["function", "python-writer"])
def test_a_completion_decided_from_stale_steps_is_decided_again_not_written(tools, monkeypatch, settings, one_call):
    """A completion is decided from the steps the process holds for the run; its writer checks them under its locks.
    Here the ledger has a step failed since, unknown to the copy: the writer (PostgreSQL's function, or the Python
    writer) must answer 'stale', and the decision made again lists the step as unfinished in the checkpoint."""
    if one_call and connection.vendor != "postgresql":
        pytest.skip("the one-call writer is PostgreSQL's")
    settings.UNWIND_FAST_PATH = one_call
    run = open_run(tools)
    first = act(run, "hr.create_user", {"email": "k@b.io", "name": "K"})
    second = act(run, "hr.create_user", {"email": "l@b.io", "name": "L"})
    held = runsteps.read(run.pk)
    runsteps.keep(run, held)  # what the process holds: both succeeded
    Action.objects.filter(pk=second.pk).update(status=ActionStatus.FAILED)
    now = [s._replace(status=ActionStatus.FAILED) if s.pk == second.pk else s for s in held]
    assert [(s.pk, s.status) for s in now] == [(first.pk, "succeeded"), (second.pk, "failed")]
    answers = []
    module, name = (fastpath, "complete") if one_call else (plans, "write_completion")
    write = getattr(module, name)

    def recorded(plan, **kwargs):
        answers.append((plan.guards.steps, write(plan, **kwargs)))
        return answers[-1][1]

    monkeypatch.setattr(module, name, recorded)
    done = run_complete(run=run, actor="agent:booker")
    # The writer was asked, and refused to write the stale decision; the one made again was written.
    assert answers[0] == (runsteps.guard(held), plans.STALE)
    assert len(answers) == 2 and answers[1][0] == runsteps.guard(now)
    assert done.status == "completed" and answers[1][1].status == "completed"
    state = Checkpoint.objects.filter(run=run).order_by("-id").first().state
    assert state["completed_action_ids"] == [first.pk] and state["pending_action_ids"] == [second.pk]


@pytest.mark.parametrize("one_call", [True, False], ids=["function", "python-writer"])
def test_a_success_decided_from_a_stale_run_is_decided_again_not_written(tools, monkeypatch, settings, one_call,
                                                                         django_capture_on_commit_callbacks):
    """A step's success is decided from the run the process holds; its writer checks the guards under its locks.
    Here the run was cancelled (and so started to unwind) behind the copy's back while the step was in flight: the
    writer must answer 'stale' to the success decided as a plain one, and the decision made again from a fresh read
    takes it as a late completion, undone with the rest (an unwinder queued)."""
    from ledger.engine import execution
    from ledger.engine.runs import run_cancel

    if one_call and connection.vendor != "postgresql":
        pytest.skip("the one-call writer is PostgreSQL's")
    settings.UNWIND_FAST_PATH = one_call
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "k@b.io", "name": "K"},
                              actor="agent:booker")
    run_cancel(run=Run.objects.get(pk=run.pk), actor="agent:booker")  # another copy: `run` still says running
    assert run.status == RunStatus.RUNNING and Run.objects.get(pk=run.pk).status == RunStatus.UNWINDING
    answers = []
    module, name = (fastpath, "succeed") if one_call else (plans, "write_outcome")
    write = getattr(module, name)

    def recorded(plan, **kwargs):
        answers.append((plan.guards.run.status, plan.unwind_after, write(plan, **kwargs)))
        return answers[-1][2]

    monkeypatch.setattr(module, name, recorded)
    with django_capture_on_commit_callbacks() as queued:
        action = execution.execute(proposal.action.pk, owner=proposal.owner, sole_owner=True, claimed=proposal.action)
    assert answers[0] == (RunStatus.RUNNING, False, plans.STALE)
    assert [answer[:2] for answer in answers[1:]] == [(RunStatus.UNWINDING, True)] and answers[1][2] != plans.STALE
    assert action.status == ActionStatus.SUCCEEDED and action.run.status == RunStatus.UNWINDING
    assert Action.objects.get(pk=action.pk).status == ActionStatus.SUCCEEDED
    assert len(queued) == 1  # the unwinder, for the late completion


@pytest.mark.parametrize("one_call", [True, False], ids=["function", "python-writer"])
def test_a_compensation_decided_from_a_stale_run_is_decided_again_not_written(tools, monkeypatch, settings, one_call):
    """A compensation's success is decided from the run as the unwinder's last write left it; its writer checks the
    guards under its locks. Here the older step failed behind that copy's back: the writer must answer 'stale' to the
    success decided with that step's undo claimed, and the decision made again from a fresh read settles the run
    (nothing is left to undo)."""
    from ledger.engine import execution, unwind_plans, unwinding
    from ledger.engine.dispatch import new_owner

    if one_call and connection.vendor != "postgresql":
        pytest.skip("the one-call writer is PostgreSQL's")
    settings.UNWIND_FAST_PATH = one_call
    run = open_run(tools)
    older = act(run, "hr.create_user", {"email": "k@b.io", "name": "K"})
    newer = act(run, "hr.create_user", {"email": "l@b.io", "name": "L"})
    Run.objects.filter(pk=run.pk).update(status=RunStatus.UNWINDING)
    owner = new_owner(held=True)
    chain = unwinding.NextUndo(run.pk, owner=owner, allowed=lambda: True)
    claimed, undo = unwind_plans.claim_unwind(run.pk, tenant_id=run.tenant_id, owner=owner, chain=chain)
    assert claimed and undo.compensates_id == newer.pk and chain.state is not None
    Action.objects.filter(pk=older.pk).update(status=ActionStatus.FAILED)  # the copy still says succeeded
    answers = []
    module, name = (fastpath, "compensated") if one_call else (plans, "write_unwind")
    write = getattr(module, name)

    def recorded(plan, **kwargs):
        answers.append((plan.claim is not None, bool(plan.run_changes), write(plan, **kwargs)))
        return answers[-1][2]

    monkeypatch.setattr(module, name, recorded)
    chain.claimed = []
    execution.execute(undo.pk, owner=owner, sole_owner=True, on_compensated=chain, claimed=undo)
    assert answers[0] == (True, False, plans.STALE)  # asked, and refused to claim the older step's undo
    assert [answer[:2] for answer in answers[1:]] == [(False, True)] and answers[1][2] != plans.STALE
    assert chain.claimed == [None] and chain.settled is not None
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPENSATED
    assert list(Action.objects.filter(run=run).order_by("seq").values_list("status", flat=True)) == [
        ActionStatus.FAILED, ActionStatus.COMPENSATED, ActionStatus.SUCCEEDED]
