"""Who may touch the sandbox, attacked over real HTTP against a live server.

The sandbox is opt-in; when it is on, each tenant has its own world. Tool calls must carry Unwind's
signature for their tenant; the world's controls (state, call log, faults, reset) need a logged-in member
of the tenant, and an operator to change anything. Every refusal is checked for what did not happen.
"""
import hashlib
import hmac
import importlib
import json
import time

import pytest
import requests
from django.urls import clear_url_caches, resolve
from django.urls.exceptions import Resolver404

from ledger.executors import signing
from ledger.executors.call import ToolError
from ledger.models import Tenant
from sandbox import callables
from sandbox.models import Charge, DirectoryUser, Fault, IdempotencyRecord, Ticket, ToolCall
from sandbox.selectors import world_state
from tests.conftest import World, seed_sandboxes
from tests.helpers import signed_post

CONTROLS = [  # (method, path, body) of every endpoint for people
    ("GET", "state", None), ("GET", "calls", None), ("GET", "faults", None),
    ("POST", "faults", {"tool": "payments.charge", "mode": "status", "status": 503}),
    ("POST", "faults/clear", {}), ("DELETE", "faults", None), ("POST", "reset", None),
]
READERS = ["crm/tickets", "crm/tickets/T-182", "email/messages", "hr/users/usr_x", "payments/charges/ch_x"]


@pytest.fixture
def live(transactional_db, live_server, _engine_settings):
    world = World()
    seed_sandboxes(world)
    world.live_server = live_server
    world.url = f"{live_server.url}/sandbox"
    return world


def everything() -> dict:
    """Every tenant's sandbox rows, to compare before and after an attack."""
    return {tenant.slug: {**world_state(tenant=tenant),
                          "keys": list(IdempotencyRecord.objects.filter(tenant=tenant).values_list("key", flat=True))}
            for tenant in Tenant.objects.order_by("slug")}


def call(method: str, url: str, body=None, **kwargs) -> requests.Response:
    return requests.request(method, url, json=body, timeout=10, **kwargs)


def assert_problem(response: requests.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.request.method, response.url, response.status_code,
                                            response.text)
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == code


def prepare_acme(live) -> None:
    """Give acme's world something to lose: a user, a charge under a key, a fault and its call log."""
    signed_post(f"{live.url}/hr/users", {"email": "ada@acme.example", "name": "Ada"}).raise_for_status()
    signed_post(f"{live.url}/payments/charge", {"customer": "c", "amount_cents": 100},
                headers={"Idempotency-Key": "acme-1"}).raise_for_status()
    call("POST", f"{live.url}/faults", {"tool": "hr.delete_user", "mode": "status"},
         auth=("oscar", "pw-oscar")).raise_for_status()


# --- people ------------------------------------------------------------------------------------------

def test_anonymous_access_to_the_sandbox_is_refused_and_changes_nothing(live):
    prepare_acme(live)
    before = everything()
    for method, path, body in CONTROLS:
        response = call(method, f"{live.url}/{path}", body)
        assert_problem(response, 401, "not_authenticated")
        assert response.headers["WWW-Authenticate"].startswith("Basic")
    for path in READERS:
        assert_problem(call("GET", f"{live.url}/{path}"), 401, "not_authenticated")
    assert_problem(call("GET", f"{live.url}/state", auth=("oscar", "wrong")), 401, "not_authenticated")
    assert everything() == before


def test_a_member_of_globex_cannot_read_or_reset_acmes_sandbox(live):
    prepare_acme(live)
    before = everything()
    mallory = ("mallory", "pw-mallory")
    for method, path, body in CONTROLS:
        response = call(method, f"{live.url}/{path}?tenant=acme", body, auth=mallory)
        assert_problem(response, 404, "not_found")
        assert "ada@acme.example" not in response.text and "acme-1" not in response.text
    for path in READERS:
        assert_problem(call("GET", f"{live.url}/{path}?tenant=acme", auth=mallory), 404, "not_found")
    assert everything() == before

    # In her own tenant she reads and resets her own world only.
    own = call("GET", f"{live.url}/state", auth=mallory).json()
    assert own["users"] == [] and own["charges"] == [] and own["faults"] == [] and own["call_counts"] == {}
    assert call("POST", f"{live.url}/reset", auth=mallory).status_code == 200
    assert everything()["acme"] == before["acme"]


def test_a_viewer_reads_the_world_but_cannot_inject_faults_or_reset(live):
    prepare_acme(live)
    before = everything()
    victor = ("victor", "pw-victor")
    assert [u["email"] for u in call("GET", f"{live.url}/state", auth=victor).json()["users"]] == ["ada@acme.example"]
    for method, path, body in CONTROLS:
        if method != "GET":
            assert_problem(call(method, f"{live.url}/{path}", body, auth=victor), 403, "permission_denied")
    assert everything() == before


def test_a_logged_in_browser_needs_the_csrf_token_to_change_the_world(live):
    prepare_acme(live)
    before = everything()
    oscar = requests.Session()
    login = f"{live.live_server.url}/accounts/login/"
    oscar.get(login, timeout=10)
    oscar.post(login, data={"username": "oscar", "password": "pw-oscar",
                            "csrfmiddlewaretoken": oscar.cookies["csrftoken"]}, headers={"Referer": login}, timeout=10)
    assert oscar.get(f"{live.url}/state", timeout=10).status_code == 200  # the session is a login
    # What a cross-site form would send: the session cookie, no token.
    assert_problem(oscar.post(f"{live.url}/reset", timeout=10), 403, "csrf_failed")
    assert_problem(oscar.post(f"{live.url}/faults/clear", timeout=10), 403, "csrf_failed")
    assert everything() == before
    done = oscar.post(f"{live.url}/reset", timeout=10,
                      headers={"X-CSRFToken": oscar.cookies["csrftoken"], "Referer": f"{live.url}/reset"})
    assert done.status_code == 200 and done.json()["users"] == []


# --- Unwind's signed tool calls ------------------------------------------------------------------------

def forged_requests(url: str, body: bytes) -> dict[str, dict]:
    """Headers an attacker can send for a tool call: none, or a signature that does not hold."""
    genuine = signing.sign(tenant="acme", method="POST", url=url, body=body)
    other_key = hmac.new(b"not-the-key", b"v1.%s.acme.POST./sandbox/hr/users.%s" % (
        genuine["Unwind-Timestamp"].encode(), hashlib.sha256(body).hexdigest().encode()), hashlib.sha256).hexdigest()
    stale = signing.sign(tenant="acme", method="POST", url=url, body=body, now=time.time() - 3600)
    return {
        "unsigned": {},
        "tenant only": {"Unwind-Tenant": "acme"},
        "tenant swapped": {**signing.sign(tenant="globex", method="POST", url=url, body=body),
                           "Unwind-Tenant": "acme"},
        "wrong key": {**genuine, "Unwind-Signature": f"v1={other_key}"},
        "other body": signing.sign(tenant="acme", method="POST", url=url, body=b'{"email": "x@y.z", "name": "X"}'),
        "other path": signing.sign(tenant="acme", method="POST", url=url.replace("/hr/users", "/hr/users/delete"),
                                   body=body),
        "stale": stale,
        "no such tenant": signing.sign(tenant="nobody", method="POST", url=url, body=body),
    }


def test_unsigned_or_forged_tool_calls_are_refused_and_record_nothing(live):
    url = f"{live.url}/hr/users"
    body = json.dumps({"email": "eve@evil.example", "name": "Eve"}).encode()
    for name, headers in forged_requests(url, body).items():
        response = requests.post(url, data=body, headers={"Content-Type": "application/json", **headers}, timeout=10)
        assert_problem(response, 401, "not_authenticated")
    assert not DirectoryUser.objects.exists() and not ToolCall.objects.exists()
    assert not IdempotencyRecord.objects.exists()
    # A person's credentials do not make a tool call either: tools are Unwind's to call.
    response = requests.post(url, data=body, headers={"Content-Type": "application/json"}, auth=("oscar", "pw-oscar"),
                             timeout=10)
    assert_problem(response, 401, "not_authenticated")
    assert not DirectoryUser.objects.exists() and not ToolCall.objects.exists()
    # The genuine signature is what lets the same call through.
    assert signed_post(url, {"email": "eve@evil.example", "name": "Eve"}).status_code == 201


def test_forged_reads_of_a_record_are_refused(live):
    user = signed_post(f"{live.url}/hr/users", {"email": "ada@acme.example", "name": "Ada"}).json()
    url = f"{live.url}/hr/users/{user['id']}"
    as_globex = signing.sign(tenant="globex", method="GET", url=url)
    assert_problem(requests.get(url, headers=as_globex, timeout=10), 404, "not_found")  # not in globex's world
    assert_problem(requests.get(url, headers={**as_globex, "Unwind-Tenant": "acme"}, timeout=10), 401,
                   "not_authenticated")
    assert requests.get(url, headers=signing.sign(tenant="acme", method="GET", url=url), timeout=10).json() == user


# --- one world per tenant ------------------------------------------------------------------------------

def test_two_tenants_worlds_are_independent(live):
    charge = {"customer": "cus_1", "amount_cents": 500}
    acme = signed_post(f"{live.url}/payments/charge", charge, tenant="acme", headers={"Idempotency-Key": "k-1"})
    globex = signed_post(f"{live.url}/payments/charge", charge, tenant="globex", headers={"Idempotency-Key": "k-1"})
    assert acme.status_code == globex.status_code == 201
    assert acme.json()["charge_id"] != globex.json()["charge_id"]  # same key, two tenants: two charges
    assert Charge.objects.count() == 2 and IdempotencyRecord.objects.filter(key="k-1").count() == 2

    call("POST", f"{live.url}/faults", {"tool": "payments.charge", "mode": "status", "status": 503, "times": 0},
         auth=("oscar", "pw-oscar")).raise_for_status()
    assert signed_post(f"{live.url}/payments/charge", charge, tenant="acme").status_code == 503
    assert signed_post(f"{live.url}/payments/charge", charge, tenant="globex").status_code == 201
    assert Fault.objects.get().tenant.slug == "acme"

    signed_post(f"{live.url}/crm/tickets/update", {"ticket_id": "T-182", "priority": "urgent"}, tenant="globex")
    assert {t.tenant.slug: t.priority for t in Ticket.objects.filter(number="T-182")} == {
        "acme": "normal", "globex": "urgent"}

    acme_calls = call("GET", f"{live.url}/calls", auth=("oscar", "pw-oscar")).json()
    globex_calls = call("GET", f"{live.url}/calls", auth=("mallory", "pw-mallory")).json()
    assert [c["status"] for c in acme_calls["results"]] == [201, 503]
    assert [c["status"] for c in globex_calls["results"]] == [201, 201, 200]
    assert call("POST", f"{live.url}/reset", auth=("oscar", "pw-oscar")).status_code == 200
    assert Charge.objects.filter(tenant__slug="globex").count() == 2  # acme's reset left globex's world alone


def test_callables_act_in_the_tenant_they_are_given_and_refuse_without_one(live):
    args = {"email": "ada@acme.example", "name": "Ada"}
    made = callables.hr_create_user(args, idempotency_key="cb-1", tenant="globex")
    assert DirectoryUser.objects.get().tenant.slug == "globex"
    assert callables.read_user(made["id"], tenant="globex") == made
    assert callables.read_user(made["id"], tenant="acme") is None
    for tenant in (None, "", "nobody"):
        with pytest.raises(ToolError) as refused:
            callables.hr_create_user(args, idempotency_key="cb-2", tenant=tenant)
        assert refused.value.transient is False and "must be called for a tenant" in str(refused.value)
        with pytest.raises(ToolError):
            callables.read_user(made["id"], tenant=tenant)
    assert DirectoryUser.objects.count() == 1 and ToolCall.objects.count() == 1


# --- off -----------------------------------------------------------------------------------------------

def test_with_the_sandbox_off_every_url_is_404_and_the_tools_refuse(live, settings):
    # Routed while on (the URLs are loaded): the views themselves refuse once the setting says off.
    assert resolve("/sandbox/state")
    settings.UNWIND_SANDBOX = False
    response = signed_post(f"{live.url}/hr/users", {"email": "ada@acme.example", "name": "Ada"})
    assert_problem(response, 404, "not_found")
    for method, path, body in CONTROLS:
        assert_problem(call(method, f"{live.url}/{path}", body, auth=("oscar", "pw-oscar")), 404, "not_found")
    with pytest.raises(ToolError) as refused:
        callables.hr_create_user({"email": "ada@acme.example", "name": "Ada"}, idempotency_key="k", tenant="acme")
    assert "the sandbox is off" in str(refused.value) and refused.value.transient is False
    with pytest.raises(ToolError):
        callables.read_ticket("T-182", tenant="acme")
    assert not DirectoryUser.objects.exists() and not ToolCall.objects.exists()


def test_with_the_sandbox_off_its_urls_are_not_even_routed(settings):
    import config.urls

    settings.UNWIND_SANDBOX = False
    try:
        importlib.reload(config.urls)
        clear_url_caches()
        with pytest.raises(Resolver404):
            resolve("/sandbox/state", urlconf=config.urls)
        assert resolve("/healthz", urlconf=config.urls)
    finally:
        settings.UNWIND_SANDBOX = True
        importlib.reload(config.urls)
        clear_url_caches()
    assert resolve("/sandbox/state", urlconf=config.urls)


def test_the_sandbox_is_off_by_default():
    import subprocess
    import sys

    from django.conf import settings

    env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "config.settings", "DEBUG": "1"}
    probe = "import django; django.setup(); from django.conf import settings; print(settings.UNWIND_SANDBOX)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=settings.BASE_DIR, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
