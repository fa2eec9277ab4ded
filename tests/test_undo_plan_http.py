"""A step found done whose record lacks what its undo needs goes to a person, who completes the undo (issue 32):
over real HTTP against a live server.

The email went out and the tool answered 500; its lookup found the message, but the correction's subject is mapped
from `$result.thread`, which the message record does not have. The operator's item page shows the record and a form
prefilled with what could be resolved; what they submit is checked against the undo tool's schema and the policy,
recorded as their decision in the audit chain, and the correction email is sent with their arguments. Every attack
is refused, and leaves the step, its run, the item, the audit chain and the outbox as they were.
"""
import json
import re

import pytest
import requests

from ledger.audit.verify import verify_chain
from ledger.models import Action, AuditEvent
from ledger.policy.versions import tool_upsert
from recovery.models import RecoveryItem
from sandbox.selectors import world_state
from tests.conftest import in_process_policy
from tests.helpers import acme, act, fault, open_run
from tests.test_login_lockout import log_in

SUBJECT = "Correction: our note about your account"


@pytest.fixture
def incomplete(tools, live_server):
    spec = in_process_policy()["tools"]["email.send"]
    spec["compensation"]["args"]["subject"] = {"$concat": ["Correction: ", "$result.thread"]}
    tool_upsert(tenant=tools.acme, name="email.send", spec=spec, actor="test")
    fault("email.send", "error_after_effect", status=500, times=1)
    run = open_run(tools)
    sent = act(run, "email.send", {"to": "dana@example.com", "subject": "Your account", "body": "Hello Dana"})
    item = RecoveryItem.objects.get(run=run)
    assert sent.status == "succeeded" and item.reason == "read_back_incomplete"
    tools.run, tools.step, tools.item = run, sent, item
    tools.url = f"{live_server.url}/console/recovery/{item.pk}/"
    tools.base = live_server.url
    return tools


def session_of(world, username: str) -> requests.Session:
    session, response = log_in(world.base, username, f"pw-{username}", next_url="/console/recovery/")
    assert response.status_code == 302, response.text
    return session


def token_from(page: str) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)


def submit(session: requests.Session, world, *, args, then="compensate", reason="", token: str | None = None):
    data = {"args": args if isinstance(args, str) else json.dumps(args), "then": then, "reason": reason}
    if token is not None:
        data["csrfmiddlewaretoken"] = token
    return session.post(world.url + "undo-plan/", data=data, headers={"Referer": world.url}, timeout=30,
                        allow_redirects=False)


def completed_args(world) -> dict:
    return {"to": "dana@example.com", "subject": SUBJECT,
            "body": "Please disregard our earlier message \"Your account\": it was sent in error and has been withdrawn."}


def snapshot(world) -> tuple:
    step = Action.objects.get(pk=world.step.pk)
    item = RecoveryItem.objects.get(pk=world.item.pk)
    run = world.run.__class__.objects.get(pk=world.run.pk)
    return (step.status, step.compensation_plan, run.status, item.status, item.resolution,
            Action.objects.filter(run=run).count(), len(world_state(tenant=acme())["messages"]),
            AuditEvent.objects.filter(tenant=world.acme).count())


def test_the_operator_completes_the_undo_and_the_tool_receives_their_arguments(incomplete):
    oscar = session_of(incomplete, "oscar")
    page = oscar.get(incomplete.url, timeout=30)
    assert page.status_code == 200
    message = world_state(tenant=acme())["messages"][0]
    assert message["message_id"] in page.text  # the record the lookup returned
    assert 'id="undo-plan-form"' in page.text and "$result.thread" in page.text
    form = re.search(r'<textarea name="args"[^>]*>(.*?)</textarea>', page.text, re.S).group(1)
    prefilled = json.loads(form.replace("&quot;", '"').replace("&#x27;", "'"))
    assert prefilled == {**completed_args(incomplete), "subject": None}  # what could be resolved, and the gap

    answer = submit(oscar, incomplete, args=completed_args(incomplete), reason="the outbox shows the thread",
                    token=token_from(page.text))
    assert answer.status_code == 302, answer.text
    shown = oscar.get(incomplete.base + answer.headers["Location"], timeout=30).text
    assert "Undo completed and recorded as yours" in shown and "Compensated" in shown
    completed = re.search(r'id="undo-completed-args">(.*?)</pre>', shown, re.S).group(1)
    assert json.loads(completed.replace("&quot;", '"')) == completed_args(incomplete)

    run = incomplete.run.__class__.objects.get(pk=incomplete.run.pk)
    assert run.status == "compensated"
    undo = Action.objects.get(compensates=incomplete.step)
    assert undo.status == "succeeded" and undo.args == completed_args(incomplete)
    messages = world_state(tenant=acme())["messages"]
    assert [m["subject"] for m in messages] == ["Your account", SUBJECT]  # the undo tool got the person's subject
    decided = AuditEvent.objects.get(tenant=incomplete.acme, kind="compensation.plan_completed")
    assert decided.actor == "user:oscar" and decided.data["args"] == completed_args(incomplete)
    item = RecoveryItem.objects.get(pk=incomplete.item.pk)
    assert item.status == "resolved" and item.resolved_by == "user:oscar"
    assert verify_chain(incomplete.acme.pk).ok


def test_keeping_the_undo_and_resuming_lets_the_run_go_on(incomplete):
    oscar = session_of(incomplete, "oscar")
    token = token_from(oscar.get(incomplete.url, timeout=30).text)
    answer = submit(oscar, incomplete, args=completed_args(incomplete), then="resume", token=token)
    assert answer.status_code == 302, answer.text
    run = incomplete.run.__class__.objects.get(pk=incomplete.run.pk)
    step = Action.objects.get(pk=incomplete.step.pk)
    assert run.status == "running" and step.compensation_plan["completed_args"] == completed_args(incomplete)
    assert len(world_state(tenant=acme())["messages"]) == 1


def test_an_agent_key_cannot_reach_it(incomplete):
    before = snapshot(incomplete)
    agent = requests.Session()
    agent.headers["Authorization"] = f"Bearer {incomplete.key}"
    answer = submit(agent, incomplete, args=completed_args(incomplete))
    assert answer.status_code in (302, 403) and "/accounts/login/" in answer.headers.get("Location", "/accounts/login/")
    assert snapshot(incomplete) == before


@pytest.mark.parametrize("username, status", [("victor", 403), ("alice", 403), ("mallory", 404)])
def test_a_viewer_an_approver_or_another_tenants_admin_cannot(incomplete, username, status):
    before = snapshot(incomplete)
    person = session_of(incomplete, username)
    page = person.get(incomplete.url, timeout=30)
    assert page.status_code == (404 if status == 404 else 200)
    assert 'id="undo-plan-form"' not in page.text
    token = token_from(person.get(incomplete.base + "/console/recovery/", timeout=30).text) \
        if 'csrfmiddlewaretoken' not in page.text else token_from(page.text)
    answer = submit(person, incomplete, args=completed_args(incomplete), token=token)
    assert answer.status_code == status, answer.text
    assert snapshot(incomplete) == before


def test_missing_csrf_is_refused(incomplete):
    before = snapshot(incomplete)
    oscar = session_of(incomplete, "oscar")
    answer = submit(oscar, incomplete, args=completed_args(incomplete))
    assert answer.status_code == 403
    assert snapshot(incomplete) == before


@pytest.mark.parametrize("args, says", [
    ('{"to": "dana@example.com", "subject": ', "not valid JSON"),
    ('["a", "b"]', "must be a JSON object"),
    ({"to": "dana@example.com", "subject": None, "body": "x"}, "comes from the step"),
    (None, "args.subject: None is not of type"),
    ({"to": "mallory@globex.example", "subject": SUBJECT, "body": "x"}, "args.to comes from the step"),
    ("x" * 20001, "at most 20000 characters"),
    ({"to": "dana@example.com", "subject": SUBJECT, "body": "x", "bcc": "mallory@globex.example"},
     "args.bcc is not one of the undo's arguments"),
    (json.dumps({**completed_args(None), "subject": "A\u0000B"}), "NUL character"),
], ids=["malformed", "not_an_object", "body_changed", "schema", "target_changed", "oversized", "extra_argument", "nul"])
def test_bad_arguments_are_refused_with_a_clear_message_and_nothing_changes(incomplete, args, says):
    if args is None:  # the gap left empty: the undo tool's schema wants a string
        args = {**completed_args(incomplete), "subject": None}
    before = snapshot(incomplete)
    oscar = session_of(incomplete, "oscar")
    token = token_from(oscar.get(incomplete.url, timeout=30).text)
    answer = submit(oscar, incomplete, args=args, token=token)
    assert answer.status_code == 400, answer.text
    error = re.search(r'id="undo-args-error">(.*?)</div>', answer.text, re.S)
    assert error and says in error.group(1).replace("&#x27;", "'").replace("&quot;", '"'), answer.text[-3000:]
    assert snapshot(incomplete) == before


def test_a_wrong_choice_of_what_follows_is_refused(incomplete):
    before = snapshot(incomplete)
    oscar = session_of(incomplete, "oscar")
    token = token_from(oscar.get(incomplete.url, timeout=30).text)
    answer = submit(oscar, incomplete, args=completed_args(incomplete), then="close", token=token)
    assert answer.status_code == 400 and "not one of the available choices" in answer.text
    assert snapshot(incomplete) == before


def test_a_step_edited_in_the_database_is_not_sealed_anew_by_completing_its_undo(incomplete):
    """Completing the undo records a new undo seal: an insider's edit of the step's record since its success (its
    result now names a thread of theirs) must not be taken in by it. Refused 409, nothing recorded or sent."""
    step = Action.objects.get(pk=incomplete.step.pk)
    result = dict(step.result, thread="a subject of the insider's")
    Action.objects.filter(pk=step.pk).update(result=result)  # the insider's UPDATE, behind the services' back
    before = snapshot(incomplete)
    oscar = session_of(incomplete, "oscar")
    token = token_from(oscar.get(incomplete.url, timeout=30).text)
    answer = submit(oscar, incomplete, args=completed_args(incomplete), token=token)
    assert answer.status_code == 409, answer.text[-2000:]
    assert "edited behind the services" in answer.text.replace("&#x27;", "'")
    assert snapshot(incomplete) == before
    assert not AuditEvent.objects.filter(kind="compensation.plan_completed").exists()
    assert verify_chain(incomplete.acme.pk).check == "fingerprint"  # no event recorded the step since its edit
