"""The correction trail as the customer reads it: their own words, no internals, no way into the staff site.

The trail is made for the person the agent acted for. The operator's run page keeps the URLs, tool ids, error
texts, HTTP statuses and audit numbers; the share page, its email and the API's trail never show them. A tool's
`describe` sentences are written by a tenant admin and read by customers, so their formatter is sandboxed:
what could reach into Python (attributes, indexes, format specs) is refused when the policy is written, and a
template that got into the database some other way renders as nothing (the plain fallback is shown instead).
"""
import json
import re
from html.parser import HTMLParser

import pytest
import requests

from ledger.policy import describe
from ledger.models import AuditEvent, Tool
from recovery.trail import correction_trail, trail_link_create
from tests.helpers import act, open_run

LEAK_PATTERNS = [
    (re.compile(r"https?://|www\.", re.I), "a URL"),
    (re.compile(r"/(sandbox|console|api|admin|accounts|approvals)\b"), "a path into the service"),
    (re.compile(r"(?<![-\w.:])[1-5]\d\d(?![-\w])(?! ?(cents|nights))"), "an HTTP status"),
    (re.compile(r"answered|injected|fault|traceback|exception|http_\d", re.I), "an internal error text"),
    (re.compile(r"#\d+|events? #|audit chain|seq", re.I), "an audit number"),
]


def customer_leaks(text: str, run) -> list[str]:
    """Every internal the text shows: URLs, paths, statuses, error texts, audit numbers, and the tenant's tool ids."""
    text = re.sub(r"reference:? \d+", "reference", text)  # the run's reference is for the customer to quote
    found = [f"{what}: {match.group(0)!r}" for pattern, what in LEAK_PATTERNS for match in pattern.finditer(text)]
    for name in Tool.objects.filter(tenant_id=run.tenant_id).values_list("name", flat=True).distinct():
        if name in text:
            found.append(f"a tool id: {name!r}")
    return found


class Page(HTMLParser):
    """The visible text of a page (head, styles and scripts left out) and every link and form in it."""

    def __init__(self, html: str):
        super().__init__()
        self.text: list[str] = []
        self.links: list[str] = []
        self.forms: list[str] = []
        self._hidden = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("head", "style", "script", "title"):
            self._hidden += 1
        if tag == "a":
            self.links.append(attrs.get("href") or "")
        if tag == "form":
            self.forms.append(attrs.get("action") or "")

    def handle_endtag(self, tag):
        if tag in ("head", "style", "script", "title"):
            self._hidden -= 1

    def handle_data(self, data):
        if not self._hidden:
            self.text.append(data)

    @property
    def visible(self) -> str:
        return " ".join(" ".join(self.text).split())


def failed_onboarding_over_http(world):
    """Seed 001 with every tool over real HTTP: the welcome email answers 504 (an injected fault), all is undone."""
    requests.post(f"{world.live_server.url}/sandbox/faults", auth=("oscar", "pw-oscar"), timeout=5,
                  json={"tool": "email.send", "mode": "status", "status": 504, "times": 0}).raise_for_status()
    run = open_run(world, goal="Onboard Ashu")
    user = act(run, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    act(run, "licenses.provision", {"user_id": user.result["id"]})
    mail = act(run, "email.send", {"to": "ashu@home.example", "subject": "Welcome", "body": "Hi"})
    run.refresh_from_db()
    assert run.status == "compensated" and mail.error_class == "http_504"
    assert "/sandbox/email/send answered 504" in mail.error_message  # the internals exist: they must not show
    return run


def test_the_share_page_of_a_failed_and_unwound_run_shows_no_internals(http_tools):
    run = failed_onboarding_over_http(http_tools)
    _, token = trail_link_create(run=run, user=http_tools.oscar)
    response = requests.get(f"{http_tools.live_server.url}/console/trail/{token}/", timeout=10)
    assert response.status_code == 200
    page = Page(response.text)
    assert "We could not send the email \u201cWelcome\u201d to ashu@home.example" in page.visible
    assert "We removed the HR account we had created for Ashu Kumar." in page.visible
    assert customer_leaks(page.visible, run) == []
    assert page.links == [] and page.forms == []  # no brand link to the login page, no navigation, no logout
    assert "/accounts/login" not in response.text and "/console/" not in response.text.replace(
        f"/console/trail/{token}/", "")
    assert response.headers["Referrer-Policy"] == "no-referrer"

    # The operator's page keeps what the customer's leaves out.
    from django.test import Client

    oscar = Client()
    oscar.force_login(http_tools.oscar)
    html = oscar.get(f"/console/runs/{run.pk}/").content.decode()
    assert "email.send" in html and "answered 504" in html and "audit chain of tenant acme" in html


def test_the_trail_email_and_the_api_trail_show_no_internals(http_tools):
    from django.test import Client

    from approvals.models import Notification

    run = failed_onboarding_over_http(http_tools)
    oscar = Client()
    oscar.force_login(http_tools.oscar)
    assert oscar.post(f"/console/runs/{run.pk}/trail/email/").status_code == 302
    note = Notification.objects.get(kind="correction_trail")
    body = note.body_text.replace(note.body_text[note.body_text.index("http"):].split()[0], "")  # the share link
    assert customer_leaks(body, run) == []
    html = Page(note.body_html)
    assert customer_leaks(html.visible, run) == []
    assert len(html.links) == 1 and "/console/trail/" in html.links[0]  # the one link: the trail itself

    trail = correction_trail(run)
    assert customer_leaks(trail["headline"] + json.dumps(trail["statements"]), run) == []


@pytest.mark.parametrize("template", [
    "{args.__class__}", "{args.email.__class__}", "{args.x.__globals__}", "{0}", "{}", "{args[email]}",
    "{args.email!r}", "{args.email:>99999}", "{args.email:{args.name}}", "{result.__dict__}", "{target.upper}",
    "{settings.SECRET_KEY}", "{_private}", "{args._x}", "{args.email", "args.email}", "line\nbreak {args.email}",
    "x" * 301,
])
def test_a_malicious_describe_template_is_refused_at_policy_write(tools, template):
    from django.test import Client

    ada = Client()
    ada.force_login(tools.ada)
    before = Tool.objects.filter(tenant=tools.acme, name="hr.create_user").count()
    events = AuditEvent.objects.count()
    spec = {"description": "Create a user.", "executor": "python", "endpoint": "sandbox.hr.create_user",
            "args_schema": {"type": "object", "properties": {"email": {"type": "string"}, "name": {}, "x": {},
                                                             "_x": {}}},
            "compensation": "none", "describe": {"done": template}}
    response = ada.put("/api/v1/tools/hr.create_user", data=json.dumps(spec), content_type="application/json")
    assert response.status_code == 400, response.content
    problem = response.json()
    assert problem["code"] == "validation_error" and problem["field"] == "tools.hr.create_user.describe.done"
    assert Tool.objects.filter(tenant=tools.acme, name="hr.create_user").count() == before
    assert AuditEvent.objects.count() == events  # nothing written


def test_describe_accepts_only_its_keys_and_declared_arguments(tools):
    from django.test import Client

    ada = Client()
    ada.force_login(tools.ada)
    base = {"description": "Book.", "executor": "client", "compensation": "none",
            "args_schema": {"type": "object", "properties": {"hotel": {"type": "string"}}}}
    for describe_value, field, words in [
        ({"doen": "We booked"}, "describe.doen", "is not a describe key"),
        ({"done": "We booked {args.hotle}"}, "describe.done", "is not one of the tool's arguments (hotel)"),
        ({"done": ""}, "describe.done", "must be a sentence"),
        ("We booked", "describe", "must be an object"),
    ]:
        response = ada.put("/api/v1/tools/travel.book", data=json.dumps({**base, "describe": describe_value}),
                           content_type="application/json")
        assert response.status_code == 400, response.content
        assert response.json()["field"] == f"tools.travel.book.{field}"
        assert words in response.json()["detail"]
    ok = {**base, "describe": {"done": "We booked {args.hotel} ({{{target}}})", "undone": "We cancelled it"}}
    response = ada.put("/api/v1/tools/travel.book", data=json.dumps(ok), content_type="application/json")
    assert response.status_code == 201, response.content
    assert response.json()["policy"]["describe"] == ok["describe"]  # GET shows it, PUT takes it back as is
    tool = Tool.objects.get(tenant=tools.acme, name="travel.book", is_current=True)
    assert describe.render(tool.describe["done"], args={"hotel": "Avenida"}, result={}, target="R-1") == \
        "We booked Avenida ({R-1})"


@pytest.mark.parametrize("template", [
    "{args.__class__}", "{args.x.__globals__}", "{0}", "{args.email:>10}", "{args.email!r}", "{", "{args[0]}",
])
def test_a_template_that_reached_the_database_behind_the_policy_renders_inert(tools, template):
    """A row edited behind the services' back: the formatter renders nothing, the plain sentence is shown."""
    from django.db.models import QuerySet

    tool = Tool.objects.get(tenant=tools.acme, name="hr.create_user", is_current=True)
    QuerySet.update(Tool.objects.filter(pk=tool.pk), describe={"done": template})  # past ToolQuerySet's guard
    assert describe.render(template, args={"email": "a@b.c", "x": {"y": 1}}, result={}) is None
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "bea@company.com", "name": "Bea"})
    changed = [s["text"] for s in correction_trail(run)["statements"] if s["kind"] == "changed"]
    assert changed == ["We took this step: create a user in the HR directory (email: bea@company.com, name: Bea)."]
    assert "class" not in changed[0] and "globals" not in changed[0]


def test_a_value_that_cannot_be_shown_falls_back_to_the_plain_sentence(tools):
    """Missing, nested, multi-line or over-long values make the whole sentence fall back, never half of it."""
    template = "We booked {args.hotel} for {args.nights} nights"
    assert describe.render(template, args={"hotel": "Avenida", "nights": 3}, result={}) == \
        "We booked Avenida for 3 nights"
    for args in ({"hotel": "Avenida"}, {"hotel": {"name": "x"}, "nights": 3}, {"hotel": "a\nb", "nights": 3},
                 {"hotel": "x" * 81, "nights": 3}, {"hotel": "Avenida", "nights": True}, None):
        assert describe.render(template, args=args, result=None) is None, args
    assert describe.render("{result.id} for {target}", args={}, result={"id": "R-9"}, target="T-1") == "R-9 for T-1"
