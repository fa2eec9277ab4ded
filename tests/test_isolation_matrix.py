"""Guarantee 8 over HTTP: every API endpoint and every page, as each persona of tenant globex, against every
object of tenant acme — 404 or 403 (405 for a method the endpoint does not have), never data, never an effect.
And inside acme, agent against agent: a second acme agent against every run and action of the first — 404
exactly like a missing one, or 403 where agents never go; only the tenant's tool list (read-only, agents need
the schemas) is shared.

The endpoints are enumerated from the URL resolver, so a new one fails here until it is mapped to the acme
objects its parameters name. Left out, with the reason: the Django admin (staff only), the sandbox (the shared
fake world, not tenant data), login/logout, the schema and docs, the health check, and the correction-trail
share link (a signed capability URL; a forged one is tested below), an approver's emailed approval link (a
capability for one person's one decision: tested below and in test_approval_links.py) and Slack's interaction
endpoint (signed by Slack, not a session or key: test_slack.py).
"""
import base64
import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from approvals.models import ApprovalRequest
from ledger.audit.verify import verify_chain
from ledger.models import Action, Run, Tool
from ledger.tenancy import agent_create
from ledger.policy.versions import tool_upsert
from recovery.forms import OPERATIONS
from recovery.models import RecoveryItem, TrailShareLink
from recovery.trail import trail_link_create
from tests.helpers import act, fault, open_run

MARKER = "zz-acme-secret"  # in every acme goal, argument and tool description: it must never reach globex
ACME_TOOL = "acmeonly.tool"  # a tool only acme has (names are per tenant: globex may register its own)
SKIP = ("admin/", "sandbox/", "accounts/", "api/schema/", "api/docs/", "healthz", "console/trail/", "approvals/link/",
        "integrations/slack/")
PARAM = re.compile(r"<(?:(?P<converter>[^>:]+):)?(?P<name>[^>]+)>")
METHODS = ("get", "post", "put", "patch", "delete")


def routes():
    """(route, namespace, name, methods) for every URL pattern, from the resolver."""
    def walk(patterns, prefix, namespace):
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern), pattern.namespace or namespace)
            elif isinstance(pattern, URLPattern):
                view = getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None)
                methods = [m for m in METHODS if view is not None and hasattr(view, m)] or ["get", "post"]
                if pattern.name == "tool-detail":
                    methods = ["get"]  # a PUT by that name registers globex's own tool: see the test below
                yield prefix + str(pattern.pattern), namespace, pattern.name, methods
    return [r for r in walk(get_resolver().url_patterns, "", "") if r[0] and not r[0].startswith(SKIP)]


@pytest.fixture
def acme(tools):
    """acme with something of everything: runs completed, compensated, waiting for approval and in the queue."""
    tool_upsert(tenant=tools.acme, name=ACME_TOOL, spec={"executor": "client", "description": MARKER}, actor="test")
    done = open_run(tools, goal=f"{MARKER} onboarding")
    user = act(done, "hr.create_user", {"email": f"{MARKER}@acme.example", "name": MARKER})
    act(done, "licenses.provision", {"user_id": user.result["id"], "sku": MARKER})
    undone = open_run(tools, goal=f"{MARKER} trip")
    act(undone, "travel.book_flight", {"passenger": MARKER, "flight": "LH1", "date": "2027-01-01"})
    fault("travel.reserve_hotel", "status", status=400)
    act(undone, "travel.reserve_hotel", {"guest": MARKER, "hotel": "H", "nights": 1})
    gated = open_run(tools, goal=f"{MARKER} purchase")
    act(gated, "travel.book_flight", {"passenger": MARKER, "flight": "LH2", "date": "2027-01-02"})
    act(gated, "payments.charge", {"customer": MARKER, "amount_cents": 100})
    stuck = open_run(tools, goal=f"{MARKER} stuck")
    act(stuck, "hr.create_user", {"email": f"{MARKER}2@acme.example", "name": MARKER})
    fault("hr.delete_user", "status", status=400)
    fault("email.send", "status", status=400)
    act(stuck, "email.send", {"to": f"{MARKER}@acme.example", "subject": MARKER, "body": MARKER})
    assert ApprovalRequest.objects.filter(tenant=tools.acme).exists()
    assert RecoveryItem.objects.filter(tenant=tools.acme, status="open").exists()
    trail_link_create(run=done, user=tools.oscar)
    return tools


def objects(world, namespace: str, name: str, route: str) -> list:
    """Every acme object a URL parameter can name."""
    acme = world.acme
    if name == "run_id" or (name == "pk" and namespace == "recovery" and route.startswith("console/runs/")):
        return list(Run.objects.filter(tenant=acme).values_list("pk", flat=True))
    if name == "action_id":
        return list(Action.objects.filter(tenant=acme).values_list("pk", flat=True))
    if name == "pk" and namespace in ("approvals", "approvals-api"):
        return list(ApprovalRequest.objects.filter(tenant=acme).values_list("pk", flat=True))
    if name == "pk" and namespace in ("recovery", "recovery-api"):
        return list(RecoveryItem.objects.filter(tenant=acme).values_list("pk", flat=True))
    if name == "link_id":
        return list(TrailShareLink.objects.filter(tenant=acme).values_list("pk", flat=True))
    if name == "name":
        return [ACME_TOOL]
    if name == "operation":
        return list(OPERATIONS)
    raise AssertionError(f"{route}: no acme objects for parameter {name!r} — map it in this test")


def urls(world, route: str, namespace: str) -> list[str]:
    found = ["/" + route]
    for match in PARAM.finditer(route):
        values = objects(world, namespace, match["name"], route)
        found = [url.replace(match.group(0), str(value), 1) for url in found for value in values]
    return found


BODIES = {
    "run-actions": {"tool": "hr.create_user", "args": {"email": "m@globex.example", "name": "M"}},
    "action-report": {"ok": True, "result": {}},
    "tool-detail": {"executor": "client"},
    "decide": {"decision": "approve", "reason": "mine now"},
    "trail_email": {"to": "mallory@globex.example"},
}


def body_for(name: str, world) -> dict:
    if name == "bulk":  # acme's items, named in the form rather than in the URL
        items = list(RecoveryItem.objects.filter(tenant=world.acme).values_list("pk", flat=True))
        return {"operation": "close", "items": items, "reason": "mine now", "confirmed": "on"}
    return BODIES.get(name, {"reason": "mine now"})


def personas(world, client_factory):
    """globex's people and agent: mallory (admin of globex) by session and by HTTP Basic, and globex's key."""
    session = client_factory()
    session.force_login(world.mallory)
    basic = client_factory(HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"mallory:pw-mallory").decode())
    agent = client_factory(HTTP_AUTHORIZATION=f"Bearer {world.other_key}")
    return {"mallory (session)": session, "mallory (basic)": basic, "globex agent key": agent}


def state(world) -> dict:
    acme = world.acme
    return {
        "runs": sorted(Run.objects.filter(tenant=acme).values_list("pk", "status", "cancel_requested_at")),
        "actions": sorted(Action.objects.filter(tenant=acme).values_list("pk", "status", "attempts")),
        "items": sorted(RecoveryItem.objects.filter(tenant=acme).values_list("pk", "status", "resolution")),
        "approvals": sorted(ApprovalRequest.objects.filter(tenant=acme).values_list("pk", "status")),
        "share_links": sorted(TrailShareLink.objects.filter(tenant=acme).values_list("pk", "revoked_at")),
        "tools": sorted(Tool.objects.filter(tenant=acme).values_list("name", "description", "executor", "updated_at")),
    }


def sweep(world, clients: dict, *, shared: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """Every route, method and acme object as each client: (requests made, what leaked or answered wrongly).
    Routes named in `shared` are the caller's to read (200, and they may show acme's marker)."""
    leaks = []
    checked = 0
    for persona, client in clients.items():
        for route, namespace, name, methods in routes():
            page = not (route.startswith("api/") or route in ("metrics", "mcp"))
            for url in urls(world, route, namespace):
                for method in methods:
                    body = body_for(name, world)
                    if page:
                        response = getattr(client, method)(url, body if method == "post" else None)
                    else:
                        response = getattr(client, method)(url, body, content_type="application/json")
                    checked += 1
                    text = response.content.decode(errors="replace")
                    parametrised = "<" in route
                    allowed = {403, 404, 405} if parametrised else {200, 400, 403, 404, 405}
                    if name in shared and method == "get":
                        allowed = {200}
                    if route == "mcp":  # agents only: a person's session or password is no key there (401);
                        allowed = allowed | {401, 406}  # the MCP SDK refuses a request not accepting its answers
                    if route == "favicon.ico":  # public: the icon's static file, the same for everyone
                        if response.status_code != 301:
                            leaks.append(f"{persona} {method.upper()} {url}: {response.status_code}, not the icon")
                        continue
                    if page and persona != "mallory (session)":  # pages take a session, nothing else
                        allowed = {302}
                        if not response.get("Location", "").startswith("/accounts/login/"):
                            leaks.append(f"{persona} {method.upper()} {url}: {response.status_code} not to the login page")
                    if response.status_code not in allowed:
                        leaks.append(f"{persona} {method.upper()} {url}: {response.status_code}")
                    if MARKER in text and name not in shared:
                        leaks.append(f"{persona} {method.upper()} {url}: {response.status_code} shows acme data")
    return checked, leaks


def test_every_endpoint_as_globex_against_every_acme_object_is_404_or_403(acme):
    before = state(acme)
    table = routes()
    assert len(table) >= 30, [r[0] for r in table]  # the resolver found the API and the pages
    checked, leaks = sweep(acme, personas(acme, lambda **headers: Client(**headers)))
    assert checked > 300
    assert leaks == [], "\n".join(leaks)
    assert state(acme) == before  # nothing of acme changed
    assert verify_chain(acme.acme.pk).ok


def test_every_endpoint_as_another_acme_agent_against_the_first_agents_objects_is_404_or_403(acme):
    """Agent against agent inside one tenant: acme's second agent reaches none of booker's runs and actions."""
    _, rival_key = agent_create(tenant=acme.acme, name="rival", actor="test")
    assert set(Run.objects.filter(tenant=acme.acme).values_list("agent__name", flat=True)) == {"booker"}
    before = state(acme)
    rival = {"acme's other agent key": Client(HTTP_AUTHORIZATION=f"Bearer {rival_key}")}
    checked, leaks = sweep(acme, rival, shared=("tool-list", "tool-detail"))
    assert checked > 100
    assert leaks == [], "\n".join(leaks)
    assert state(acme) == before  # nothing of booker's changed
    assert verify_chain(acme.acme.pk).ok


def test_globex_lists_and_filters_naming_acme_show_nothing_of_acme(acme, client):
    client.force_login(acme.mallory)
    run = Run.objects.filter(tenant=acme.acme).first()
    item = RecoveryItem.objects.filter(tenant=acme.acme).first()
    agent = {"HTTP_AUTHORIZATION": f"Bearer {acme.other_key}"}
    answers = [
        client.get("/api/v1/recovery-items", {"run": run.pk, "status": "all"}),
        client.get("/api/v1/recovery-items", {"tenant": "acme"}),
        client.get("/api/v1/approvals", {"run": run.pk, "status": "all"}),
        client.get("/api/v1/approvals", {"tenant": "acme"}),
        client.get("/api/v1/runs", {"agent": "booker"}),
        client.get("/api/v1/compensations/pending", {"run": run.pk}, **agent),
        client.get("/api/v1/runs", **agent),
        client.get("/api/v1/tools", **agent),
        client.get("/console/recovery/", {"tenant": acme.acme.pk, "status": "all", "q": "acme-secret"}),
        client.get("/console/runs/", {"tenant": acme.acme.pk, "q": "acme-secret"}),
        client.get("/approvals/", {"tenant": "acme", "status": "any"}),
        client.post("/console/recovery/bulk/", {"operation": "close", "items": [item.pk], "reason": "mine",
                                                "confirmed": "on"}),
    ]
    for response in answers:
        assert response.status_code in (200, 400, 403, 404), (response.request["PATH_INFO"], response.status_code)
        assert MARKER not in response.content.decode(errors="replace"), response.request["PATH_INFO"]
    item.refresh_from_db()
    assert item.status == "open"


def test_a_forged_share_link_to_an_acme_trail_shows_nothing(acme, client):
    client.force_login(acme.mallory)
    run = Run.objects.filter(tenant=acme.acme).first()
    _, genuine = trail_link_create(run=run, user=acme.oscar)
    forged = genuine[:-2] + ("AA" if not genuine.endswith("AA") else "BB")
    for token in (forged, f"{run.pk}", f"{run.pk}:x:y"):
        response = client.get(f"/console/trail/{token}/")
        assert response.status_code in (400, 403, 404, 410)
        assert MARKER not in response.content.decode(errors="replace")
    assert client.get(f"/console/trail/{genuine}/").status_code == 200  # the genuine link is the capability


def test_globex_registering_a_tool_by_an_acme_tools_name_gets_its_own(acme, client):
    before = state(acme)
    admin = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"mallory:pw-mallory").decode()}  # globex's admin
    response = client.put(f"/api/v1/tools/{ACME_TOOL}", {"executor": "client", "description": "globex's"},
                          content_type="application/json", **admin)
    assert response.status_code == 201
    assert MARKER not in response.content.decode()
    assert Tool.objects.get(tenant=acme.globex, name=ACME_TOOL).description == "globex's"
    assert state(acme) == before


def test_globex_with_a_forged_or_an_acme_approval_link_changes_nothing(acme, client):
    from approvals.link_service import links_fill, placeholder
    from approvals.models import ApprovalLink, Notification

    client.force_login(acme.mallory)
    request = ApprovalRequest.objects.filter(tenant=acme.acme, status="pending").first()
    link = ApprovalLink.objects.get(request=request, user=acme.alice)
    note = Notification.objects.get(pk=link.notification_id)
    genuine = links_fill(note, placeholder(link, "approve")).rsplit("/approvals/link/", 1)[1].strip("/")
    before = state(acme)
    for token in (genuine[:-2] + ("AA" if not genuine.endswith("AA") else "BB"), str(request.pk), "x" * 43):
        for method in ("get", "post"):
            response = getattr(client, method)(f"/approvals/link/{token}/")
            assert response.status_code == 404 and MARKER not in response.content.decode(errors="replace")
    for method in ("get", "post"):  # the genuine link is alice's: mallory, signed in, cannot use it
        response = getattr(client, method)(f"/approvals/link/{genuine}/")
        assert response.status_code == 403 and MARKER not in response.content.decode(errors="replace")
    assert state(acme) == before
