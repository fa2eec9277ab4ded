"""Issue 31, finding 8: a NUL character in a query parameter, form field or path is a 400, never a 500.

PostgreSQL refuses NUL in text, so `GET /console/policy/?tool=%00` answered 500 there. Every page and endpoint of
the URL configuration is asked with NUL over real HTTP against a live server, by a signed-in admin (so the views
would run) and by an agent's key.
"""
from __future__ import annotations

import re

import pytest
import requests
from django.urls import NoReverseMatch, URLPattern, URLResolver, get_resolver, reverse

from ledger.api.problems import API_PREFIXES
from ledger.models import AuditEvent


def named_paths() -> list[str]:
    """A concrete path for every named URL of the project (placeholder values for its parameters)."""
    found = []

    def walk(patterns, namespace):
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, f"{namespace}{entry.namespace}:" if entry.namespace else namespace)
            elif isinstance(entry, URLPattern) and entry.name:
                found.append((f"{namespace}{entry.name}", list(entry.pattern.converters)))

    walk(get_resolver().url_patterns, "")
    paths = set()
    for name, params in found:
        for value in ("1", "hr.create_user", "abc"):
            try:
                paths.add(reverse(name, kwargs={param: value for param in params}))
                break
            except NoReverseMatch:
                continue
    return sorted(paths)


@pytest.fixture
def admin_session(http_tools):
    session = requests.Session()
    session.get(f"{http_tools.live_server.url}/accounts/login/", timeout=30)
    answer = session.post(f"{http_tools.live_server.url}/accounts/login/", timeout=30,
                          data={"username": "ada", "password": "pw-ada",
                                "csrfmiddlewaretoken": session.cookies["csrftoken"]})
    assert answer.status_code in (200, 302) and "sessionid" in session.cookies, answer.status_code
    return session


def test_the_policy_page_refuses_nul_in_its_query(http_tools, admin_session):
    answer = admin_session.get(f"{http_tools.live_server.url}/console/policy/?tool=%00", timeout=30)
    assert answer.status_code == 400 and "NUL" in answer.text, (answer.status_code, answer.text[:300])


def test_every_page_and_endpoint_refuses_nul(http_tools, admin_session):
    paths = named_paths()
    assert len(paths) > 40 and "/console/policy/" in paths and "/api/v1/runs" in paths
    agent = requests.Session()
    agent.headers["Authorization"] = f"Bearer {http_tools.key}"
    events = AuditEvent.objects.count()
    base = http_tools.live_server.url
    for path in paths:
        for session in (admin_session, agent):
            answer = session.get(f"{base}{path}?q=a%00b&page=1", timeout=30, allow_redirects=False)
            assert answer.status_code == 400, (path, answer.status_code, answer.text[:200])
            named = session.get(f"{base}{path}?x%00=1", timeout=30, allow_redirects=False)
            assert named.status_code == 400, (path, named.status_code)
        form = admin_session.post(f"{base}{path}", data={"reason": "no\x00", "csrfmiddlewaretoken": "x"},
                                  timeout=30, allow_redirects=False,
                                  headers={"X-CSRFToken": admin_session.cookies.get("csrftoken", "")})
        if path.startswith(API_PREFIXES):  # the API takes JSON only: a form is refused whatever it holds
            assert form.status_code in (400, 405, 415), (path, form.status_code, form.text[:200])
        else:
            assert form.status_code == 400, (path, form.status_code, form.text[:200])
    api = agent.get(f"{base}/api/v1/runs?status=%00", timeout=30)
    assert api.headers["Content-Type"].startswith("application/problem+json")
    assert api.json()["code"] == "validation_error" and api.json()["field"] == "status"
    assert "parameter 'status'" in api.json()["detail"]
    assert agent.get(f"{base}/api/v1/tools/hr.create%00user", timeout=30).json()["field"] == "path"
    assert AuditEvent.objects.count() == events  # nothing happened
    assert re.search("NUL", admin_session.get(f"{base}/console/?q=%00", timeout=30).text)
