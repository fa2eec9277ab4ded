"""Every run settles (issue 32): whatever fails while an outcome is settled ends in a recorded state and a recovery
item that says what failed, never in an action left running for the sweep to take over and fail again; a step
found done by reading it back gets the result the tool would have answered, or goes to a person with the record."""
import pytest

from ledger.engine import failpoints
from ledger.models import Action, Run
from ledger.engine.proposal import action_propose
from ledger.engine.execution import execute
from ledger.engine.sweep import sweep
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from sandbox.selectors import world_state
from tests.conftest import in_process_policy
from tests.helpers import acme, act, fault, open_run
from tests.test_serving import free_port

SETTLING = ["settle_target", "settle_snapshot", "settle_verify", "settle_plan", "settle_record"]


@pytest.fixture
def failpoint(monkeypatch):
    def arm(name: str) -> None:
        monkeypatch.setenv("UNWIND_FAILPOINTS", f"{name}=raise")
        failpoints.reset()

    yield arm
    monkeypatch.delenv("UNWIND_FAILPOINTS", raising=False)
    failpoints.reset()


@pytest.mark.parametrize("point", SETTLING)
def test_a_failure_while_recording_an_answer_settles_the_step_and_tells_a_person(tools, failpoint, point,
                                                                                 django_capture_on_commit_callbacks):
    """The ticket changed (the tool answered), then recording it failed at `point`: the step is recorded
    succeeded with the tool's answer, and the run waits for a person with an item naming what failed."""
    run = open_run(tools)
    failpoint(point)
    change = act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    assert change.status == "succeeded" and change.result  # the tool's answer is kept
    assert change.verification["ok"] is False and "recording the tool's answer failed" in change.verification["detail"]
    run.refresh_from_db()
    item = RecoveryItem.objects.get(run=run)
    assert run.status == "needs_attention" and item.reason == "settle_failed"
    assert f"failpoint {point}" in item.detail and "was carried out" in item.detail
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["reclaimed"] == 0  # nothing left running for the sweep to take over
    assert list(change.attempt_set.values_list("outcome", flat=True)) == ["settle_failed"]


def test_a_failure_while_reading_back_settles_the_step_as_unknown(tools, failpoint, django_capture_on_commit_callbacks):
    """The email went out and answered 500 (the tool ignores keys); reading it back then failed inside Unwind: the
    step is recorded lost with what failed, and the run waits for a person; it is not sent again."""
    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(tools)
    failpoint("settle_read_back")
    sent = act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    assert sent.status == "lost" and sent.error_class == "settle_failed"
    assert "reading the step back failed" in sent.error_message
    run.refresh_from_db()
    assert run.status == "needs_attention" and RecoveryItem.objects.get(run=run).reason == "settle_failed"
    assert len(world_state(tenant=acme())["messages"]) == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["reclaimed"] == 0


def test_a_failure_while_recording_an_error_settles_the_step(tools, failpoint):
    """The tool refused; recording the refusal failed: the step is recorded lost (what it did is not recorded),
    never left running."""
    fault("crm.update_ticket", "status", status=422, times=1)
    run = open_run(tools)
    failpoint("settle_failure")
    change = act(run, "crm.update_ticket", {"ticket_id": "T-204", "priority": "high"})
    assert change.status == "lost" and "recording the tool's error failed" in change.error_message
    run.refresh_from_db()
    assert run.status == "needs_attention" and RecoveryItem.objects.get(run=run).reason == "settle_failed"


def email_with_target(tools, target_from: str, **lookup):
    spec = in_process_policy()["tools"]["email.send"]
    spec["target"] = {"type": "message", "from": target_from}
    spec["lookup"] = {**spec["lookup"], **lookup}
    tool_upsert(tenant=tools.acme, name="email.send", spec=spec, actor="test")


def test_a_step_found_by_its_lookup_gets_the_tools_answer_as_its_result(tools):
    """Issue 32's loop: the email went out and the tool answered 500; the lookup finds the message. Its record is
    the result the agent receives (`message_id`, the target, as the send answers it), not a wrapper."""
    email_with_target(tools, "result.message_id")
    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(tools)
    sent = act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    message = world_state(tenant=acme())["messages"][0]
    assert sent.status == "succeeded" and sent.result["message_id"] == message["message_id"]
    assert sent.target_id == message["message_id"]
    assert sent.verification["read_back"] == {"by": "lookup", "evidence": sent.result}
    run.refresh_from_db()
    assert run.status == "running" and not RecoveryItem.objects.filter(run=run).exists()
    assert len(world_state(tenant=acme())["messages"]) == 1


def test_a_lookup_result_mapping_shapes_the_record(tools):
    email_with_target(tools, "result.id", result={"id": "$result.message_id", "sent_to": "$result.to"})
    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(tools)
    sent = act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    message = world_state(tenant=acme())["messages"][0]
    assert sent.status == "succeeded" and sent.result == {"id": message["message_id"], "sent_to": "a@x.io"}
    assert sent.target_id == message["message_id"]


def test_a_record_that_cannot_be_the_result_goes_to_a_person_with_the_evidence(tools,
                                                                                django_capture_on_commit_callbacks):
    """`target.from: result.id`, and the record has no `id`: the step did act (recorded succeeded, with the record),
    and a person gets it with the record and the undo to complete; no loop, no second email."""
    email_with_target(tools, "result.id")
    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(tools)
    sent = act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    message = world_state(tenant=acme())["messages"][0]
    assert sent.status == "succeeded" and sent.verification["ok"] is False
    run.refresh_from_db()
    item = RecoveryItem.objects.get(run=run)
    assert run.status == "needs_attention" and item.reason == "read_back_incomplete"
    assert message["message_id"] in item.detail and "$result.id" in item.detail and "did act" in item.detail
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["reclaimed"] == 0
    assert len(world_state(tenant=acme())["messages"]) == 1


def test_a_refused_connection_is_retried_and_never_handed_to_a_person(tools, settings):
    """The tool server is down (nothing listens): each attempt is known not sent. The step is retried as a timeout
    would be, then fails as not carried out and the run unwinds: no item "may have acted"."""
    spec = dict(in_process_policy()["tools"]["email.send"], executor={"kind": "http", "url": "/send"},
                retry={"max_attempts": 3, "backoff": 0.01})
    settings.UNWIND_TOOL_BASE_URL = f"http://localhost:{free_port()}"  # nothing listens there
    tool_upsert(tenant=tools.acme, name="email.send", spec=spec, actor="test")
    run = open_run(tools)
    sent = act(run, "email.send", {"to": "a@x.io", "subject": "S", "body": "b"})
    assert sent.status == "failed" and sent.attempts == 3
    assert set(sent.attempt_set.values_list("error_class", flat=True)) == {"not_sent"}
    run.refresh_from_db()
    assert run.status in ("unwinding", "compensated") and not RecoveryItem.objects.filter(run=run).exists()


def test_the_operators_send_again_moves_an_unknown_outcome_and_is_recorded_as_theirs(
        tools, django_capture_on_commit_callbacks):
    """A sent email whose worker was lost, with no lookup to read it back: a person decides. "The tool says it did
    not happen: send it again" sends it (once), records the decision as theirs, and opens no new item."""
    from ledger.engine.attempts import mark_sent
    from recovery.forms import SEND_AGAIN, operations_for
    from recovery.services import recovery_resume
    from tests.test_console_queue import client_for
    from tests.test_g05_crash_safety import sweep_until_settled, wait_for_lease

    spec = dict(in_process_policy()["tools"]["email.send"], timeout=0.2)
    spec.pop("lookup")
    tool_upsert(tenant=tools.acme, name="email.send", spec=spec, actor="test")
    run = open_run(tools)
    sent = action_propose(run=run, tool_name="email.send", args={"to": "a@x.io", "subject": "S", "body": "b"},
                          actor="agent:booker")
    assert mark_sent(sent.action, sent.owner)
    wait_for_lease(sent.action)
    assert sweep_until_settled(sent.action, django_capture_on_commit_callbacks).status == "lost"
    item = RecoveryItem.objects.get(run=run)
    assert operations_for(item)["resume"].label == SEND_AGAIN
    page = client_for(tools.oscar).get(f"/console/recovery/{item.pk}/").content.decode()
    assert "The tool says it did not happen: send it again…" in page
    confirm = client_for(tools.oscar).get(f"/console/recovery/{item.pk}/resume/").content.decode()
    assert "your word that the tool did not act" in confirm and "if it did act, it acts twice" in confirm
    with django_capture_on_commit_callbacks(execute=True):
        recovery_resume(item=item, user=tools.oscar, reason="the outbox shows nothing")
    sent.action.refresh_from_db()
    run.refresh_from_db()
    assert sent.action.status == "succeeded", list(sent.action.attempt_set.values_list("outcome", "error_message"))
    assert run.status == "running" and RecoveryItem.objects.filter(run=run, status="open").count() == 0
    assert list(sent.action.attempt_set.values_list("resend_by", flat=True)) == ["", "user:oscar"]
    assert len(world_state(tenant=acme())["messages"]) == 1


def test_a_step_whose_worker_keeps_being_lost_goes_to_a_person_after_the_bound(tools, settings,
                                                                               django_capture_on_commit_callbacks):
    """Each takeover's task is lost too (never run here): after UNWIND_MAX_RECLAIMS lost attempts of a call that
    may have left, the sweep stops taking it over and a person is told, instead of a loop for good."""
    from tests.test_g05_crash_safety import short_lease, wait_for_lease

    settings.UNWIND_MAX_RECLAIMS = 2
    settings.UNWIND_LEASE_SECONDS = 0.1
    short_lease(tools, "hr.create_user")
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "l@x.io", "name": "L"},
                              actor="agent:booker")
    for reclaimed in (1, 0):
        wait_for_lease(proposal.action)
        with django_capture_on_commit_callbacks(execute=False):
            assert sweep()["reclaimed"] == reclaimed
    proposal.action.refresh_from_db()
    run.refresh_from_db()
    assert proposal.action.status == "lost" and "lost 2 times" in proposal.action.error_message
    assert run.status == "needs_attention" and RecoveryItem.objects.get(run=run).reason == "lease_lost"


def test_claims_never_sent_are_taken_over_without_a_bound_and_without_a_person(tools, settings,
                                                                               django_capture_on_commit_callbacks):
    """A key-ignoring tool's claims that never left (a broker that lost the task, a frozen worker) do not count
    towards the bound: nothing was sent, so nothing is asked of a person."""
    from tests.test_g05_crash_safety import short_lease, wait_for_lease

    settings.UNWIND_MAX_RECLAIMS = 2
    settings.UNWIND_LEASE_SECONDS = 0.1
    short_lease(tools, "email.send")
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="email.send", args={"to": "a@x.io", "subject": "S", "body": "b"},
                              actor="agent:booker")
    for _ in range(3):
        wait_for_lease(proposal.action)
        with django_capture_on_commit_callbacks(execute=False):
            assert sweep()["reclaimed"] == 1
    proposal.action.refresh_from_db()
    assert proposal.action.status == "running" and not RecoveryItem.objects.filter(run=run).exists()
