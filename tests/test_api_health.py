"""/healthz (database and worker), /metrics (Prometheus text), and the OpenAPI schema and its docs page."""
from datetime import timedelta

import pytest
import yaml
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import OperationalError
from django.utils import timezone
from django_q.models import OrmQ
from rest_framework.test import APIClient

from ledger.api import health
from tests.api_support import assert_problem, basic
from tests.helpers import fault

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures


def test_healthz_without_any_worker_activity(api_db):
    response = APIClient().get("/healthz")
    assert response.status_code == 200
    assert response.json()["database"] == "ok" and response.json()["worker"] == "none"
    assert response.json()["status"] == "degraded"


def test_healthz_sees_a_worker_through_its_finished_tasks(api):
    run = api.open_run()
    api.propose(run["id"], "payments.charge", {"customer": "c", "amount_cents": 1})
    request_id = api.person("alice").get("/api/v1/approvals").json()["results"][0]["id"]
    api.person("alice").post(f"/api/v1/approvals/{request_id}/approve", {}, format="json")  # runs a task
    body = APIClient().get("/healthz").json()
    assert body["worker"] == "ok" and body["status"] == "ok" and body["worker_detail"]["last_task_at"]


def test_healthz_calls_a_worker_stale_when_queued_work_waits(api_db):
    OrmQ.objects.create(key="unwind", payload="x", lock=timezone.now() - timedelta(minutes=5))
    body = APIClient().get("/healthz").json()
    assert body["worker"] == "stale" and body["worker_detail"]["queued"] == 1
    assert body["worker_detail"]["oldest_wait_seconds"] >= 299


def test_healthz_is_503_when_the_database_does_not_answer(api_db, monkeypatch):
    class Unreachable:
        def cursor(self):
            raise OperationalError("connection refused")

    monkeypatch.setattr(health, "connection", Unreachable())
    response = APIClient().get("/healthz")
    assert response.status_code == 503 and response.json()["database"] == "unreachable"


def test_metrics_in_prometheus_text_for_staff(api):
    run = api.open_run()
    api.propose(run["id"], "hr.create_user", {"email": "a@company.com", "name": "A"})
    fault("email.send", "status", status=400, times=0)
    api.propose(run["id"], "email.send", {"to": "a@b.io", "subject": "s", "body": "b"})  # fails: the run unwinds
    api.propose(api.open_run()["id"], "payments.charge", {"customer": "c", "amount_cents": 1})
    get_user_model().objects.create_user("prometheus", "", "pw-prometheus", is_staff=True)
    scraper = APIClient()
    scraper.credentials(HTTP_AUTHORIZATION=basic("prometheus"))
    response = scraper.get("/metrics", HTTP_ACCEPT="text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    assert 'unwind_actions{tenant="acme",tool="hr.create_user",kind="forward",status="compensated"} 1' in text
    assert 'unwind_actions{tenant="acme",tool="email.send",kind="forward",status="failed"} 1' in text
    assert 'unwind_runs{tenant="acme",status="compensated"} 1' in text
    assert 'unwind_approvals_pending{tenant="acme"} 1' in text
    assert "unwind_unwind_seconds_count 1" in text and 'unwind_unwind_seconds{quantile="0.5"} ' in text
    assert "# TYPE unwind_recovery_items_open gauge" in text
    for line in text.splitlines():
        assert line.startswith(("#", "unwind_")), line
    assert_problem(api.person("oscar").get("/metrics", HTTP_ACCEPT="application/json"), 403, "permission_denied")
    assert APIClient().get("/metrics").status_code == 401
    assert api.agent.get("/metrics").status_code == 403


def test_open_recovery_items_are_counted_by_reason(api):
    from ledger.models import Tenant

    Tenant.objects.filter(pk=api.world.acme.pk).update(approval_threshold="critical")
    run = api.open_run()
    api.propose(run["id"], "payments.charge", {"customer": "c", "amount_cents": 1})
    fault("email.send", "status", status=400, times=0)
    api.propose(run["id"], "email.send", {"to": "a@b.io", "subject": "s", "body": "b"})
    get_user_model().objects.create_superuser("root", "", "pw-root")
    scraper = APIClient()
    scraper.credentials(HTTP_AUTHORIZATION=basic("root"))
    assert 'unwind_recovery_items_open{tenant="acme",reason="step_failed"} 1' in scraper.get("/metrics").content.decode()


def test_the_schema_validates_without_warnings_and_covers_every_endpoint(tmp_path):
    target = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target))
    schema = yaml.safe_load(target.read_text())
    paths = schema["paths"]
    for path in ("/api/v1/runs", "/api/v1/runs/{run_id}/actions", "/api/v1/actions/{action_id}/wait",
                 "/api/v1/actions/{action_id}/report", "/api/v1/compensations/pending", "/api/v1/tools/{name}",
                 "/api/v1/policy", "/api/v1/approvals/{id}/reject", "/api/v1/recovery-items/{id}/close",
                 "/api/v1/runs/{run_id}/trail", "/healthz", "/metrics"):
        assert path in paths, path
    propose = paths["/api/v1/runs/{run_id}/actions"]["post"]
    assert {"200", "201", "202", "400", "401", "403", "404", "409", "422", "429"} <= set(propose["responses"])
    assert "application/problem+json" in propose["responses"]["422"]["content"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            if path not in ("/healthz",):
                assert "401" in operation["responses"] and "403" in operation["responses"], (method, path)


@pytest.mark.django_db
def test_the_docs_page_is_self_hosted():
    page = APIClient().get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "swagger-ui" in html and "/static/drf_spectacular_sidecar/" in html
    for cdn in ("cdn.jsdelivr", "unpkg.com", "cdnjs"):
        assert cdn not in html
    schema = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200 and schema.json()["info"]["title"] == "Unwind API"


@pytest.fixture
def private_redis(tmp_path, monkeypatch):
    """A Redis of the test's own on a free port, made the broker (never the machine's shared one)."""
    import shutil
    import subprocess
    import time

    import redis
    from django_q.conf import Conf

    from tests.test_serving import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    monkeypatch.setattr(Conf, "ORM", None)
    monkeypatch.setattr(Conf, "REDIS", url)
    try:
        yield server
    finally:
        server.terminate()
        server.wait(10)


def test_healthz_reads_the_redis_queue_when_redis_is_the_broker(api_db, private_redis):
    from django_q.brokers import get_broker
    from django_q.signing import SignedPackage

    broker = get_broker()
    body = APIClient().get("/healthz").json()
    assert body["worker_detail"]["broker"] == "redis" and body["worker_detail"]["queued"] == 0
    # Two tasks as django-q2 queues them, the older five minutes ago: nobody is taking them.
    for minutes in (5, 1):
        broker.enqueue(SignedPackage.dumps({"id": f"t{minutes}", "name": "n", "func": "ledger.tasks.sweep",
                                            "args": (), "kwargs": {}, "started": timezone.now() - timedelta(minutes=minutes)}))
    OrmQ.objects.all().delete()  # nothing in the ORM queue: only Redis's backlog can tell
    body = APIClient().get("/healthz").json()
    assert body["worker"] == "stale" and body["status"] == "degraded"
    assert body["worker_detail"]["queued"] == 2 and body["worker_detail"]["oldest_wait_seconds"] >= 299
    private_redis.terminate()
    private_redis.wait(10)
    body = APIClient().get("/healthz").json()
    assert body["broker"] == "unreachable" and body["worker"] == "unknown" and body["status"] == "degraded"
