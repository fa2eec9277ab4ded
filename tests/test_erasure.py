"""Erasure of a person's data at their request (issue 42): the chain keeps verifying, the text is gone from every
table, the pages say so, and nobody but the tenant's admin can do it."""
import re

import pytest
from django.apps import apps
from django.core.management import CommandError, call_command
from django.db import connection, models

from approvals.models import ApprovalRequest
from approvals.services import approval_decide
from ledger.audit.verify import verify_chain
from ledger.engine.runs import run_complete, run_open
from ledger.errors import PermissionDenied, StateConflict, ValidationFailed
from ledger.models import AuditEvent, ErasedRun, Run
from recovery.erasure import subject_erase, subject_erase_by
from recovery.trail import trail_link_create
from tests.helpers import act

DANA = "dana.quill@example.org"
NAME = "Dana Quill"
GOAL = "Onboard Dana Quill to the spring design team and book her trip"
REASONING = "Dana asked for an account before her first day"
# Every text of Dana's that must be gone after the erasure.
SECRETS = (DANA, NAME, "spring design team", "her first day", "Quillsworth")


def dana_run(world, capture, *, complete=True):
    run = run_open(tenant=world.acme, agent=world.agent, goal=GOAL, on_behalf_of=DANA, actor="agent:booker")
    act(run, "hr.create_user", {"email": DANA, "name": NAME},
        intent={"goal": GOAL, "reasoning": REASONING, "confidence": 0.9})
    act(run, "travel.book_flight", {"passenger": f"{NAME} Quillsworth", "flight": "LH1", "date": "2027-01-01"})
    act(run, "payments.charge", {"customer": DANA, "amount_cents": 4200})
    request = ApprovalRequest.objects.get(run=run)
    with capture(execute=True):
        approval_decide(request=request, user=world.alice, approve=True)
    run.refresh_from_db()
    if complete:
        run = run_complete(run=run, actor="agent:booker")
    return run


def other_run(world):
    run = run_open(tenant=world.acme, agent=world.agent, goal="Onboard Erin", on_behalf_of="erin@example.org",
                   actor="agent:booker")
    act(run, "hr.create_user", {"email": "erin@example.org", "name": "Erin Stone"})
    return run_complete(run=run, actor="agent:booker")


def text_columns():
    """Every text and JSON column of every ledger, approvals and recovery table."""
    for app in ("ledger", "approvals", "recovery"):
        for model in apps.get_app_config(app).get_models():
            names = [f.column for f in model._meta.concrete_fields
                     if isinstance(f, (models.CharField, models.TextField, models.JSONField))]
            if names:
                yield model._meta.db_table, names


def where_found(text: str) -> list[str]:
    found = []
    cast = "::text" if connection.vendor == "postgresql" else ""
    with connection.cursor() as cursor:
        for table, columns in text_columns():
            for column in columns:
                cursor.execute(f'SELECT count(*) FROM {table} WHERE lower("{column}"{cast}) LIKE %s',
                               [f"%{text.lower()}%"])
                if cursor.fetchone()[0]:
                    found.append(f"{table}.{column}")
    return found


@pytest.fixture
def erased(tools, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks)
    trail_link_create(run=run, user=tools.oscar, sent_to=DANA)
    other = other_run(tools)
    assert verify_chain(tools.acme.pk).ok
    assert where_found(DANA)  # the search finds what is there
    result = subject_erase(tenant=tools.acme, subject=DANA.upper(), reason="request #4411", by="user:ada")
    tools.run, tools.other, tools.result = run, other, result
    return tools


def test_erasure_keeps_the_chain_verifying(erased):
    report = verify_chain(erased.acme.pk)
    assert report.ok, report
    assert erased.result.runs == 1 and erased.result.actions >= 2 and erased.result.events > 0
    call_command("verify_audit")


def test_erased_text_is_in_no_table_and_no_event(erased):
    for text in SECRETS:
        assert where_found(text) == [], text
    # The other person's run is untouched.
    assert where_found("erin@example.org")


def test_the_erasure_is_audited_without_naming_the_person(erased):
    event = AuditEvent.objects.get(tenant=erased.acme, kind="subject.erased")
    assert event.actor == "user:ada"
    assert event.data["reason"] == "request #4411"
    assert event.data["runs"] == 1 and event.data["actions"] == erased.result.actions
    assert DANA not in str(event.data) and NAME not in str(event.data)


def test_the_runs_key_is_destroyed_and_others_kept(erased):
    assert Run.objects.get(pk=erased.run.pk).fingerprint_key == ""
    assert len(Run.objects.get(pk=erased.other.pk).fingerprint_key) == 64
    assert erased.result.unkeyed_events == 0


def bare_digests(run) -> set[str]:
    """What someone holding a run's rows (or guessing them) could compute of them without its key: the bare digests
    of the run and its steps, and of the bodies and calls the steps sent."""
    from ledger.audit import chain, subjects
    from ledger.models import Action

    with subjects.cache_scope():
        subjects._local.cache.update({run.pk: ""})  # as if the run had no key
        fresh = Run.objects.get(pk=run.pk)
        fresh.fingerprint_key = ""
        found = {chain.run_fingerprint(fresh)}
        for action in Action.objects.filter(run=run):
            found.add(chain.action_fingerprint(action))
            found.update(value for name, value in chain.seal(action).items() if name != "approvals")
            found.add(chain.undo_seal(action))
    return found


def recorded_digests(tenant) -> str:
    return " ".join(str(data) for data in AuditEvent.objects.filter(tenant=tenant).values_list("data", flat=True))


def test_the_chain_holds_no_digest_a_guess_can_be_tested_against(tools, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks)
    guesses = bare_digests(run)
    recorded = recorded_digests(tools.acme)
    assert guesses and not [guess for guess in guesses if guess in recorded]
    subject_erase(tenant=tools.acme, subject=DANA, reason="request #9", by="user:ada")
    recorded = recorded_digests(tools.acme)
    assert not [guess for guess in guesses if guess in recorded]
    assert Run.objects.get(pk=run.pk).fingerprint_key == ""


def test_an_erased_row_or_event_edited_afterwards_still_shows(erased):
    from django.db import models as m
    from ledger.models import Action

    rewritten = AuditEvent.objects.filter(tenant=erased.acme, kind="run.opened", run_ref=erased.run.pk).get()
    m.QuerySet(model=AuditEvent).filter(pk=rewritten.pk).update(data={**rewritten.data, "goal": "edited"})
    report = verify_chain(erased.acme.pk)
    assert not report.ok and report.check == "hmac" and f"event #{rewritten.seq}" in report.problem
    m.QuerySet(model=AuditEvent).filter(pk=rewritten.pk).update(data=rewritten.data)
    assert verify_chain(erased.acme.pk).ok
    step = Action.objects.filter(run=erased.run).first()
    m.QuerySet(model=Action).filter(pk=step.pk).update(args={"email": "someone@else.example"})
    report = verify_chain(erased.acme.pk)
    assert not report.ok and report.check == "fingerprint" and f"action {step.pk} differs" in report.problem
    m.QuerySet(model=Action).filter(pk=step.pk).update(args=step.args)
    assert verify_chain(erased.acme.pk).ok
    # Marking another run erased, to make its pages and links lie, shows too.
    ErasedRun.objects.create(tenant=erased.acme, run=erased.other, erasure=ErasedRun.objects.get().erasure,
                             erased_at=erased.result.erased_at)
    report = verify_chain(erased.acme.pk)
    assert not report.ok and report.check == "fingerprint" and "ledger.erasedrun" in report.problem


def test_a_run_recorded_before_keys_verifies_and_its_erasure_says_what_stays(tools, monkeypatch,
                                                                              django_capture_on_commit_callbacks):
    from ledger.audit import subjects

    monkeypatch.setattr(subjects, "new_key", lambda: "")  # runs opened before this change have no key
    run = dana_run(tools, django_capture_on_commit_callbacks)
    monkeypatch.undo()
    assert Run.objects.get(pk=run.pk).fingerprint_key == ""
    assert verify_chain(tools.acme.pk).ok
    result = subject_erase(tenant=tools.acme, subject=DANA, reason="request #2", by="user:ada")
    assert result.unkeyed_events > 0
    assert f"{result.unkeyed_events} of their runs' audit events were recorded before fingerprints were keyed" \
        in result.sentence()
    assert "bare SHA-256 digests" in result.sentence()
    assert verify_chain(tools.acme.pk).ok
    for text in SECRETS:
        assert where_found(text) == [], text


def test_erasing_twice_is_a_clear_no_op(erased):
    before = AuditEvent.objects.filter(tenant=erased.acme).count()
    again = subject_erase(tenant=erased.acme, subject=DANA, reason="request #4411", by="user:ada")
    assert again.runs == 0
    assert "nothing changed" in again.sentence()
    assert AuditEvent.objects.filter(tenant=erased.acme).count() == before
    assert verify_chain(erased.acme.pk).ok


def test_a_run_not_settled_is_refused_and_nothing_changes(tools, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks, complete=False)
    events = AuditEvent.objects.filter(tenant=tools.acme).count()
    with pytest.raises(StateConflict, match=rf"run {run.pk} \(running\).*not settled.*Nothing was changed"):
        subject_erase(tenant=tools.acme, subject=DANA, reason="request #1", by="user:ada")
    run.refresh_from_db()
    assert run.on_behalf_of == DANA and run.goal == GOAL
    assert AuditEvent.objects.filter(tenant=tools.acme).count() == events
    assert not ErasedRun.objects.exists()
    with pytest.raises(CommandError, match="not settled"):
        call_command("erase", subject=DANA, reason="request #1", by="ops")


def test_a_reason_that_names_the_person_is_refused(tools, django_capture_on_commit_callbacks):
    dana_run(tools, django_capture_on_commit_callbacks)
    with pytest.raises(ValidationFailed, match="names the person"):
        subject_erase(tenant=tools.acme, subject=DANA, reason=f"asked by {DANA}", by="user:ada")


def test_only_the_tenants_admin_erases(tools, django_capture_on_commit_callbacks):
    run = dana_run(tools, django_capture_on_commit_callbacks)
    with pytest.raises(PermissionDenied):
        subject_erase_by(user=tools.oscar, tenant=tools.acme, subject=DANA, reason="r1")
    with pytest.raises(PermissionDenied):
        subject_erase_by(user=tools.mallory, tenant=tools.acme, subject=DANA, reason="r1")
    run.refresh_from_db()
    assert run.on_behalf_of == DANA
    assert subject_erase_by(user=tools.ada, tenant=tools.acme, subject=DANA, reason="r1").runs == 1


def test_the_command_erases_and_says_what_it_did(tools, django_capture_on_commit_callbacks, capsys):
    dana_run(tools, django_capture_on_commit_callbacks)
    call_command("erase", subject=DANA, tenant="acme", reason="request #7", by="ops:ann")
    out = capsys.readouterr().out
    assert re.search(r"tenant acme: erased 1 run\(s\), \d+ step\(s\)", out), out
    call_command("erase", subject=DANA, reason="request #7", by="ops:ann")
    assert "nothing changed" in capsys.readouterr().out
    call_command("verify_audit")


# --- over HTTP: the pages, the trail link, the API, and who may erase ----------------------------------------------

class _Capture:
    """With a live server the tasks run after each real commit: nothing to capture."""

    def __call__(self, execute=True):
        from contextlib import nullcontext
        return nullcontext()


def browser_for(live_server, user):
    """A real HTTP session for `user`, logged in through the login form, with its CSRF token."""
    import requests

    session = requests.Session()
    login = f"{live_server.url}/accounts/login/"
    page = session.get(login, timeout=10)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    answer = session.post(login, data={"username": user.username, "password": "pw-" + user.username,
                                       "csrfmiddlewaretoken": token}, headers={"Referer": login}, timeout=10)
    assert answer.status_code == 200 and "sessionid" in session.cookies, answer.status_code
    return session


def post_form(session, url: str, data: dict):
    page = session.get(url, timeout=10)
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    token = match.group(1) if match else session.cookies.get("csrftoken", "")
    return session.post(url, data={**data, "csrfmiddlewaretoken": token}, headers={"Referer": url}, timeout=10,
                        allow_redirects=False)


def test_pages_links_and_api_say_erased_over_http(http_tools):
    import requests

    world, base = http_tools, http_tools.live_server.url
    run = dana_run(world, _Capture())
    _, token = trail_link_create(run=run, user=world.oscar, sent_to=DANA)
    share = f"{base}/console/trail/{token}/"
    assert requests.get(share, timeout=10).status_code == 200
    ada = browser_for(world.live_server, world.ada)
    answer = post_form(ada, f"{base}/console/erasure/", {"tenant": "acme", "subject": DANA, "reason": "ticket 88"})
    assert answer.status_code == 302, answer.text[:500]
    page = ada.get(base + answer.headers["Location"], timeout=10).text
    assert "erased 1 run(s)" in page and "ticket 88" in page
    stamp = f"erased on {ErasedRun.objects.get(run=run).erased_at:%Y-%m-%d} at the person&#x27;s request"

    oscar = browser_for(world.live_server, world.oscar)
    run_page = oscar.get(f"{base}/console/runs/{run.pk}/", timeout=10)
    assert run_page.status_code == 200 and 'id="erased-notice"' in run_page.text and stamp in run_page.text
    # Follow every link the run page renders to the run's approval pages.
    approvals = set(re.findall(r'href="(/approvals/\d+/)"', run_page.text))
    approvals.add(f"/approvals/{ApprovalRequest.objects.get(run=run).pk}/")
    for path in approvals:
        approval = oscar.get(base + path, timeout=10)
        assert approval.status_code == 200 and 'id="erased-notice"' in approval.text and stamp in approval.text
    for page in [run_page.text] + [oscar.get(base + path, timeout=10).text for path in approvals]:
        for text in SECRETS:
            assert text not in page, text
    gone = requests.get(share, timeout=10)
    assert gone.status_code == 410 and "erased on" in gone.text and "at the person&#x27;s request" in gone.text
    assert requests.post(f"{share}ask/", data={"kind": "question", "text": "hi"}, timeout=10).status_code in (403, 410)

    agent = {"Authorization": f"Bearer {world.key}"}
    api_run = requests.get(f"{base}/api/v1/runs/{run.pk}", headers=agent, timeout=10).json()
    assert api_run["erased"]["why"] == "at the person's request" and api_run["goal"] == api_run["erased"]["sentence"]
    assert all(action["erased"] == api_run["erased"] for action in api_run["actions"])
    one = requests.get(api_run["actions"][0]["links"]["self"], headers=agent, timeout=10).json()
    assert one["erased"] == api_run["erased"] and DANA not in str(one)
    assert verify_chain(world.acme.pk).ok


def test_an_agent_key_and_another_tenants_admin_cannot_erase_over_http(http_tools):
    import requests

    world, base = http_tools, http_tools.live_server.url
    run = dana_run(world, _Capture())
    events = AuditEvent.objects.filter(tenant=world.acme).count()
    url = f"{base}/console/erasure/"
    form = {"tenant": "acme", "subject": DANA, "reason": "r"}
    for headers in ({"Authorization": f"Bearer {world.key}"}, {"Authorization": f"Bearer {world.other_key}"},
                    {"X-Api-Key": world.key}):
        answer = requests.post(url, data=form, headers=headers, timeout=10, allow_redirects=False)
        assert answer.status_code in (302, 403), answer.status_code
        assert "/accounts/login/" in answer.headers.get("Location", "/accounts/login/")
    # The API has no erasure: an agent key finds nothing to call.
    for path in ("/api/v1/erasure", f"/api/v1/runs/{run.pk}/erase"):
        assert requests.post(base + path, json=form, headers={"Authorization": f"Bearer {world.key}"},
                             timeout=10).status_code in (404, 405)
    mallory = browser_for(world.live_server, world.mallory)  # admin of globex only
    assert post_form(mallory, url + "?tenant=globex", form).status_code == 404
    oscar = browser_for(world.live_server, world.oscar)  # operator of acme
    refused = post_form(oscar, url + "?tenant=acme", form)
    assert refused.status_code == 403 and "needs the admin role in acme" in refused.text
    run.refresh_from_db()
    assert run.on_behalf_of == DANA and run.goal == GOAL
    assert AuditEvent.objects.filter(tenant=world.acme).count() == events and not ErasedRun.objects.exists()
    # A subject of globex is not reachable from acme's admin either: the form only erases in a tenant they administer.
    ada = browser_for(world.live_server, world.ada)
    assert post_form(ada, url + "?tenant=acme", {**form, "tenant": "globex"}).status_code == 404


def test_tenant_admins_find_the_erasure_page_in_the_navigation_and_no_one_else_does(http_tools):
    world, base = http_tools, http_tools.live_server.url
    nav = re.compile(r'<nav class="main-nav".*?</nav>', re.S)
    for person, tenant in (("ada", "acme"), ("mallory", "globex")):  # each administers one tenant
        session = browser_for(world.live_server, world.users[person])
        menu = nav.search(session.get(f"{base}/console/runs/", timeout=10).text).group(0)
        [link] = re.findall(r'<a href="([^"]+)"[^>]*>Erasure</a>', menu)
        page = session.get(base + link, timeout=10)
        assert page.status_code == 200 and f'value="{tenant}"' in page.text, (person, page.status_code)
        assert re.search(r'<a href="/console/erasure/" aria-current="page">Erasure</a>', nav.search(page.text).group(0))
    for person in ("oscar", "alice", "victor"):  # operator, approver, viewer of acme
        session = browser_for(world.live_server, world.users[person])
        menu = nav.search(session.get(f"{base}/console/runs/", timeout=10).text).group(0)
        assert "/console/erasure/" not in menu and ">Runs<" in menu, person
        assert session.get(f"{base}/console/erasure/", timeout=10).status_code == 403  # the page agrees
