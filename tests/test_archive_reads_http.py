"""Issue 42: every read of a run answers for an archived run (docs/archive.md), over HTTP against a live server: its
attempts, its events and its steps as they answered while hot, marked `archived`, and the run list with
`archived=true` from the index alone. Exactly the callers of the hot run: another agent or tenant gets the 404 of a
run that never was, byte for byte; a segment that fails its hash answers 503 archive_unavailable; every write
answers 409 run_archived, and nothing changes."""
import hashlib
import os

import requests
from drf_spectacular.generators import SchemaGenerator

from ledger.models import Action, ArchivedKey, ArchivedRun, Attempt, AuditEvent, Run
from ledger.tenancy import agent_create
from recovery.erasure import subject_erase
from tests.api_support import effects
from tests.helpers import archive_past_retention, as_if, live_api, open_run
from tests.test_archive_erasure import dana_run
from tests.test_erasure import DANA

pytest_plugins = ["tests.archive_fixtures"]  # the archived fixture: a live server, two archived runs

NEVER = 987654  # an id no run or step has


def reads(world):
    """Every read of alpha by id: its history and each of its steps (with its wait)."""
    run = world.alpha.pk
    return [f"/api/v1/runs/{run}", f"/api/v1/runs/{run}/attempts", f"/api/v1/runs/{run}/events",
            *(f"/api/v1/actions/{step}" for step in world.alpha_steps),
            *(f"/api/v1/actions/{step}/wait?timeout=5" for step in world.alpha_steps)]


def person(world, path, username, method="get", **kwargs):
    return getattr(requests, method)(f"{world.url}{path}", auth=(username, f"pw-{username}"), timeout=10, **kwargs)


def test_the_owner_reads_the_history_and_steps_of_its_archived_run_as_they_were(archived):
    segment = ArchivedRun.objects.get(pk=archived.alpha.pk).segment.sha256
    for path, hot in archived.hot.items():
        answer = live_api(archived, path, archived.key)
        assert answer.status_code == 200, (path, answer.text)
        body = answer.json()
        assert body.pop("archived")["segment"] == segment, path
        assert body == hot, path  # the same serializers, fields and values as while it was hot
    attempts = archived.hot[f"/api/v1/runs/{archived.alpha.pk}/attempts"]["results"]
    assert [a["tool"] for a in attempts] == ["hr.create_user", "licenses.provision"]
    events = archived.hot[f"/api/v1/runs/{archived.alpha.pk}/events"]["results"]
    assert events[0]["kind"] == "run.opened" and "beta-secret" not in str(events)


def test_a_person_of_the_tenant_reads_them_too_and_a_wait_answers_at_once(archived):
    for path in reads(archived):
        answer = person(archived, path, "victor")  # a viewer
        assert answer.status_code == 200 and answer.json()["archived"]["at"], (path, answer.text)
    waited = live_api(archived, f"/api/v1/actions/{archived.alpha_steps[0]}/wait?timeout=30", archived.key)
    assert waited.status_code == 200 and waited.elapsed.total_seconds() < 5
    assert waited.json()["status"] == "succeeded" and waited.json()["archived"]


def test_history_pages_of_an_archived_run_follow_their_cursors(archived):
    path = f"/api/v1/runs/{archived.alpha.pk}/attempts"
    first = live_api(archived, f"{path}?limit=1", archived.key).json()
    second = requests.get(first["next"], headers={"Authorization": f"Bearer {archived.key}"}, timeout=10).json()
    assert [a["tool"] for a in first["results"] + second["results"]] == ["hr.create_user", "licenses.provision"]
    assert second["next"] is None and second["previous"] and second["archived"] == first["archived"]
    back = requests.get(second["previous"], headers={"Authorization": f"Bearer {archived.key}"}, timeout=10).json()
    assert back["results"] == first["results"]
    bad = live_api(archived, f"{path}?cursor=cD1hYmM%3D", archived.key)  # a position (p=abc) that is no id
    assert bad.status_code == 400 and bad.json()["code"] == "validation_error"


def test_another_agent_or_tenant_gets_the_404_of_a_run_that_never_was(archived):
    _, second = agent_create(tenant=archived.acme, name="second")
    for path in reads(archived):
        real = archived.alpha.pk if "/runs/" in path else int(path.split("/")[4])
        never = live_api(archived, path.replace(str(real), str(NEVER)), archived.key)
        assert never.status_code == 404, (path, never.text)
        for answer in (live_api(archived, path, second), live_api(archived, path, archived.other_key),
                       person(archived, path, "mallory")):
            assert answer.status_code == 404 and "secret" not in answer.text, (path, answer.text)
            assert as_if(answer, real, NEVER) == never.text, path
            assert answer.headers["Content-Type"] == never.headers["Content-Type"]


def test_a_segment_that_fails_its_hash_answers_503_and_the_index_still_lists(archived):
    files = [path for path in archived.archive_dir.rglob("*.jsonl.zst")]
    assert len(files) == 1
    assert all(live_api(archived, path, archived.key).status_code == 200 for path in reads(archived))  # now cached
    kept = files[0].stat()
    files[0].write_bytes(files[0].read_bytes()[:-1] + b"\0")  # same size, and its time set back:
    os.utime(files[0], ns=(kept.st_atime_ns, kept.st_mtime_ns))  # a reader's cache must still see the change
    for path in reads(archived):
        answer = live_api(archived, path, archived.key)
        assert answer.status_code == 503 and answer.json()["code"] == "archive_unavailable", (path, answer.text)
        assert "secret" not in answer.text
    _, second = agent_create(tenant=archived.acme, name="second")
    assert live_api(archived, reads(archived)[1], second).status_code == 404  # the index decides first
    listed = live_api(archived, "/api/v1/runs?archived=true", archived.key)  # no segment is fetched to list
    assert listed.status_code == 200 and len(listed.json()["results"]) == 2


def test_a_segment_removed_after_it_was_read_answers_503_not_from_memory(archived):
    path = reads(archived)[0]
    assert live_api(archived, path, archived.key).status_code == 200
    [segment] = archived.archive_dir.rglob("*.jsonl.zst")
    segment.unlink()
    answer = live_api(archived, path, archived.key)
    assert answer.status_code == 503 and "is missing" in answer.json()["detail"], answer.text


def everything(world) -> tuple:
    """What a write could change: the ledger's rows, the index, the sandbox's effects, the archive's files."""
    files = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in world.archive_dir.rglob("*") if p.is_file()}
    return (Run.objects.count(), Action.objects.count(), Attempt.objects.count(), AuditEvent.objects.count(),
            ArchivedRun.objects.count(), ArchivedKey.objects.count(), len(effects("hr.create_user")), files)


def writes(world):
    run, step = world.alpha.pk, world.alpha_steps[0]
    return [(f"/api/v1/runs/{run}/actions", {"tool": "hr.create_user", "args": {"email": "z@x.io", "name": "Z"}}),
            (f"/api/v1/runs/{run}/cancel", {"reason": "x"}), (f"/api/v1/runs/{run}/complete", None),
            (f"/api/v1/actions/{step}/report", {"ok": True, "result": {}})]


def test_a_write_to_an_archived_run_answers_409_run_archived_and_changes_nothing(archived):
    before = everything(archived)
    segment = ArchivedRun.objects.get(pk=archived.alpha.pk).segment.sha256
    for path, body in writes(archived):
        answer = live_api(archived, path, archived.key, "post", json=body)
        assert answer.status_code == 409, (path, answer.text)
        problem = answer.json()
        assert problem["code"] == "run_archived" and "archived" in problem["detail"], problem
        assert problem["run_id"] == archived.alpha.pk and problem["archived"]["segment"] == segment
        assert answer.headers["Content-Type"] == "application/problem+json"
    cancelled = person(archived, f"/api/v1/runs/{archived.alpha.pk}/cancel", "oscar", "post", json={})
    assert cancelled.status_code == 409 and cancelled.json()["code"] == "run_archived"
    assert everything(archived) == before
    assert not Run.objects.filter(pk=archived.alpha.pk).exists()


def test_another_agent_or_tenant_writing_to_an_archived_run_gets_404_and_changes_nothing(archived):
    _, second = agent_create(tenant=archived.acme, name="second")
    before = everything(archived)
    for path, body in writes(archived):
        real = archived.alpha.pk if "/runs/" in path else archived.alpha_steps[0]
        never = live_api(archived, path.replace(str(real), str(NEVER)), archived.key, "post", json=body)
        assert never.status_code == 404, (path, never.text)
        for key in (second, archived.other_key):
            answer = live_api(archived, path, key, "post", json=body)
            assert answer.status_code == 404 and as_if(answer, real, NEVER) == never.text, (path, answer.text)
    refused = person(archived, f"/api/v1/runs/{archived.alpha.pk}/cancel", "mallory", "post", json={})
    assert refused.status_code == 404
    assert everything(archived) == before


def test_the_run_list_shows_archived_runs_from_the_index_to_their_readers(archived):
    alpha, beta = archived.alpha.pk, archived.beta.pk
    young = open_run(archived, goal="young")
    hot = live_api(archived, "/api/v1/runs", archived.key).json()["results"]
    assert [r["id"] for r in hot] == [young.pk]  # by default: the hot runs only
    listed = live_api(archived, "/api/v1/runs?archived=true", archived.key)
    assert listed.status_code == 200, listed.text
    found = listed.json()["results"]
    assert [r["id"] for r in found] == [beta, alpha]  # newest first
    assert found[1]["agent"] == "booker" and found[1]["finished_at"]
    assert found[1]["archived"]["segment"] == ArchivedRun.objects.get(pk=alpha).segment.sha256
    assert found[1]["links"]["self"].endswith(f"/api/v1/runs/{alpha}")
    assert "secret" not in listed.text  # the index holds no text of the run
    _, second = agent_create(tenant=archived.acme, name="second")
    for answer in (live_api(archived, "/api/v1/runs?archived=true", second),
                   live_api(archived, "/api/v1/runs?archived=true", archived.other_key),
                   person(archived, "/api/v1/runs?archived=true", "mallory")):
        assert answer.status_code == 200 and answer.json()["results"] == []
    for query, ids in (("", [beta, alpha]), ("&agent=booker", [beta, alpha]), ("&agent=second", [])):
        answer = person(archived, f"/api/v1/runs?archived=true{query}", "victor")  # a viewer of acme
        assert [r["id"] for r in answer.json()["results"]] == ids, query
    first = live_api(archived, "/api/v1/runs?archived=true&limit=1", archived.key).json()
    rest = requests.get(first["next"], headers={"Authorization": f"Bearer {archived.key}"}, timeout=10).json()
    assert [r["id"] for r in first["results"] + rest["results"]] == [beta, alpha] and rest["next"] is None


def test_filters_the_index_cannot_answer_are_refused_with_archived(archived):
    for query in ("status=completed", "since=2020-01-01T00:00:00Z"):
        answer = live_api(archived, f"/api/v1/runs?archived=true&{query}", archived.key)
        assert answer.status_code == 400 and answer.json()["code"] == "validation_error", answer.text
        assert answer.json()["field"] == query.split("=")[0] and "archived=true" in answer.json()["detail"]
    bad = live_api(archived, "/api/v1/runs?archived=maybe", archived.key)
    assert bad.status_code == 400 and bad.json()["field"] == "archived"


def test_an_erased_then_archived_run_and_its_steps_carry_the_erased_marker(archived,
                                                                           django_capture_on_commit_callbacks):
    run = dana_run(archived, django_capture_on_commit_callbacks)
    subject_erase(tenant=archived.acme, subject=DANA, reason="request #7", by="user:ada")
    archive_past_retention(archived, [run])
    body = live_api(archived, f"/api/v1/runs/{run.pk}", archived.key).json()
    assert body["archived"] and body["erased"]["why"] == "at the person's request"
    assert all(step["erased"] == body["erased"] for step in body["actions"])
    step = live_api(archived, f"/api/v1/actions/{body['actions'][0]['id']}", archived.key).json()
    assert step["erased"] == body["erased"] and step["archived"] == body["archived"]
    assert live_api(archived, f"/api/v1/runs/{archived.alpha.pk}", archived.key).json()["erased"] is None


def declared(schema: dict, node: dict) -> dict:
    """The properties an OpenAPI schema node declares (through $ref and allOf)."""
    if "$ref" in node:
        return declared(schema, schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]])
    found = dict(node.get("properties", {}))
    for part in node.get("allOf", []):
        found.update(declared(schema, part))
    return found


def test_every_key_an_archived_answer_carries_is_declared_in_the_openapi_schema(archived):
    """The generated clients (clients/typescript) know `archived` only if the schema declares it: on a run, a step,
    a history page and the 409 run_archived problem, each with its `at` and `segment`."""
    schema = SchemaGenerator().get_schema(request=None, public=True)  # what `manage.py spectacular` publishes
    template = {"/api/v1/runs/{run_id}": f"/api/v1/runs/{archived.alpha.pk}",
                "/api/v1/runs/{run_id}/attempts": f"/api/v1/runs/{archived.alpha.pk}/attempts",
                "/api/v1/runs/{run_id}/events": f"/api/v1/runs/{archived.alpha.pk}/events",
                "/api/v1/actions/{action_id}": f"/api/v1/actions/{archived.alpha_steps[0]}"}
    for route, path in template.items():
        body = live_api(archived, path, archived.key).json()
        answer = schema["paths"][route]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        properties = declared(schema, answer)
        assert set(body) <= set(properties), (route, set(body) - set(properties))
        assert set(body["archived"]) == set(declared(schema, properties["archived"])) == {"at", "segment"}, route
    refused = live_api(archived, f"/api/v1/runs/{archived.alpha.pk}/complete", archived.key, "post")
    problem = declared(schema, schema["components"]["schemas"]["Problem"])
    assert refused.status_code == 409 and set(refused.json()) <= set(problem), set(refused.json()) - set(problem)
