"""schemathesis against the OpenAPI schema (/api/schema/), in-process over WSGI: every operation, with valid
credentials (an agent's key for the agent's endpoints, an admin's HTTP Basic for the people's), on a ledger
with real runs, actions, approvals and recovery items. No 5xx; every 4xx is an RFC 9457 problem; every
response has a status, content type, headers and body the schema declares.
"""
import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hsettings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from approvals.models import ApprovalRequest
from config.wsgi import application
from ledger.models import Action
from ledger.tenancy import deploy_key_create
from recovery.models import RecoveryItem
from tests.api_support import basic
from tests.helpers import act, fault, open_run

PROBLEM_FIELDS = {"type", "title", "status", "detail", "code"}


@schemathesis.check
def refusals_are_problems(ctx, response, case):
    """Every 4xx answers application/problem+json with type, title, status, detail and a machine code."""
    if not 400 <= response.status_code < 500:
        return
    content_type = (response.headers.get("content-type") or response.headers.get("Content-Type") or [""])[0]
    assert content_type.startswith("application/problem+json"), \
        f"{response.status_code} answered {content_type!r}, not application/problem+json"
    body = response.json()
    missing = PROBLEM_FIELDS - set(body)
    assert not missing, f"{response.status_code} problem lacks {sorted(missing)}: {body}"
    assert body["status"] == response.status_code and body["type"] == f"urn:unwind:problem:{body['code']}", body
    return


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, refusals_are_problems]


schema = schemathesis.openapi.from_wsgi("/api/schema/", application)  # generating it reads no database


@pytest.fixture
def ledger(transactional_db, tools, settings):
    """acme with a completed run, a compensated one, one waiting for approval and one in the recovery queue."""
    settings.UNWIND_THROTTLE_RATE = "1000000/min"
    type(tools.ada).objects.filter(pk=tools.ada.pk).update(is_staff=True)  # acme's admin also reads /metrics
    _, deploy_key = deploy_key_create(tenant=tools.acme, name="ci", actor="test")
    done = open_run(tools)
    user = act(done, "hr.create_user", {"email": "s@x.io", "name": "S"})
    act(done, "licenses.provision", {"user_id": user.result["id"]})
    undone = open_run(tools)
    act(undone, "travel.book_flight", {"passenger": "P", "flight": "LH1", "date": "2027-01-01"})
    fault("travel.reserve_hotel", "status", status=400)
    act(undone, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    gated = open_run(tools)
    act(gated, "travel.book_flight", {"passenger": "Q", "flight": "LH2", "date": "2027-01-02"})
    act(gated, "payments.charge", {"customer": "c", "amount_cents": 100})
    stuck = open_run(tools)
    act(stuck, "hr.create_user", {"email": "t@x.io", "name": "T"})
    fault("hr.delete_user", "status", status=400)
    fault("email.send", "status", status=400)
    act(stuck, "email.send", {"to": "t@x.io", "subject": "S", "body": "b"})
    return {
        "world": tools,
        "run_id": done.pk,
        "action_id": Action.objects.filter(run=done).first().pk,
        "approvals": ApprovalRequest.objects.get(run=gated).pk,
        "recovery-items": RecoveryItem.objects.get(run=stuck).pk,
        "name": "hr.create_user",
        "deploy_key": deploy_key,
    }


def aim(case, ledger) -> None:
    """Point about half of the generated ids at real objects of the tenant, so answers are not all 404."""
    for name, value in list((case.path_parameters or {}).items()):
        if zlib.crc32(repr(value).encode()) % 2:
            continue
        if name in ("run_id", "action_id", "name"):
            case.path_parameters[name] = ledger[name]
        elif name == "id":
            kind = "approvals" if "/approvals/" in case.operation.path else "recovery-items"
            case.path_parameters[name] = ledger[kind]


def credentials(case, ledger) -> dict:
    """The agent's key where agents come first, a deploy key on tools and policy, an admin's HTTP Basic where people
    decide."""
    security = case.operation.definition.raw.get("security") or [{}]
    first = next(iter(security[0]), None)
    if first == "deployKey":
        return {"Authorization": f"Bearer {ledger['deploy_key']}"}
    if first == "agentKey":
        return {"Authorization": f"Bearer {ledger['world'].key}"}
    if first == "basicAuth":
        return {"Authorization": basic("ada")}
    return {}


@schema.parametrize()
@hsettings(max_examples=8, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
           suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_to_its_schema(case, ledger):
    aim(case, ledger)
    case.call_and_validate(headers=credentials(case, ledger), checks=CHECKS)
