"""The recovery API: operators resume, compensate or close runs that need a person."""
from ledger.models import Tenant
from recovery.models import RecoveryItem
from sandbox.faults import faults_clear
from tests.api_support import assert_problem
from tests.helpers import acme, fault

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

EMAIL = {"to": "a@b.io", "subject": "Receipt", "body": "Thanks"}


def stuck_run(api) -> tuple[dict, RecoveryItem]:
    """A run whose step failed after the pivot: only a person can finish it."""
    Tenant.objects.filter(pk=api.world.acme.pk).update(approval_threshold="critical")
    run = api.open_run()
    assert api.propose(run["id"], "payments.charge", {"customer": "cus_1", "amount_cents": 100}).status_code == 201
    fault("email.send", "status", status=400, times=0)
    failed = api.propose(run["id"], "email.send", EMAIL).json()
    assert failed["status"] == "failed" and failed["run_status"] == "needs_attention"
    return run, RecoveryItem.objects.get(run_id=run["id"], status="open")


def test_list_and_get(api):
    run, item = stuck_run(api)
    oscar = api.person("oscar")
    [row] = oscar.get("/api/v1/recovery-items").json()["results"]
    assert row["id"] == item.pk and row["reason"] == "step_failed" and row["run_status"] == "needs_attention"
    assert row["tool"] == "email.send" and "email.send" in row["detail"] and row["suggestion"]
    assert row["links"]["run"].endswith(f"/api/v1/runs/{run['id']}")
    assert oscar.get(f"/api/v1/recovery-items/{item.pk}").json()["id"] == item.pk
    assert oscar.get("/api/v1/recovery-items", {"reason": "drift"}).json()["results"] == []
    assert oscar.get("/api/v1/recovery-items", {"status": "resolved"}).json()["results"] == []
    assert len(oscar.get("/api/v1/recovery-items", {"status": "all", "run": run["id"]}).json()["results"]) == 1
    assert api.person("victor").get(f"/api/v1/recovery-items/{item.pk}").status_code == 200
    assert_problem(api.person("mallory").get(f"/api/v1/recovery-items/{item.pk}"), 404, "not_found")
    assert api.person("mallory").get("/api/v1/recovery-items").json()["results"] == []


def test_resume_retries_the_failed_step(api):
    run, item = stuck_run(api)
    faults_clear(tenant=acme())
    resumed = api.person("oscar").post(f"/api/v1/recovery-items/{item.pk}/resume", {"reason": "mail server fixed"},
                                       format="json")
    assert resumed.status_code == 200, resumed.content
    body = resumed.json()
    assert body["status"] == "resolved" and body["resolution"] == "resumed" and body["resolved_by"] == "user:oscar"
    assert body["resolution_note"] == "mail server fixed" and body["run_status"] == "running"
    assert api.agent.post(f"/api/v1/runs/{run['id']}/complete").json()["status"] == "completed"
    again = api.person("oscar").post(f"/api/v1/recovery-items/{item.pk}/resume", {}, format="json")
    assert_problem(again, 409, "state_conflict")


def test_compensate_unwinds_what_can_be_undone(api):
    run, item = stuck_run(api)
    response = api.person("oscar").post(f"/api/v1/recovery-items/{item.pk}/compensate", {"reason": "refund it"},
                                        format="json")
    assert response.status_code == 200
    assert response.json()["resolution"] == "compensated" and response.json()["run_status"] == "unwinding"
    refund = [a for a in api.agent.get(f"/api/v1/runs/{run['id']}").json()["actions"] if a["kind"] == "compensation"]
    assert [(a["tool"], a["status"]) for a in refund] == [("payments.refund", "awaiting_approval")]


def test_close_needs_a_reason_and_an_operator(api):
    _, item = stuck_run(api)
    path = f"/api/v1/recovery-items/{item.pk}/close"
    assert assert_problem(api.person("oscar").post(path, {}, format="json"), 400, "validation_error")["field"] == "reason"
    for who in ("victor", "alice"):
        assert_problem(api.person(who).post(path, {"reason": "done"}, format="json"), 403, "permission_denied")
    assert_problem(api.agent.post(path, {"reason": "done"}, format="json"), 403, "permission_denied")
    assert_problem(api.person("mallory").post(path, {"reason": "done"}, format="json"), 404, "not_found")
    closed = api.person("oscar").post(path, {"reason": "receipt sent by hand"}, format="json")
    assert closed.status_code == 200 and closed.json()["resolution"] == "closed"
    assert closed.json()["run_status"] == "closed"
