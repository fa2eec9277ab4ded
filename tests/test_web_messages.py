"""Issue 40: the message storage is built per request on first use (ledger/web_messages.py): an API call never builds
it, a page that adds a message still shows it after the redirect, and Django's checks accept the middleware."""
from django.contrib import messages
from django.core import checks
from django.http import HttpResponse
from django.test import Client, RequestFactory
from django.utils.functional import empty

from ledger.web_messages import LazyMessageMiddleware


def test_an_api_call_never_builds_the_storage(tools):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {tools.key}")
    response = client.get("/api/v1/runs")
    assert response.status_code == 200
    assert response.wsgi_request._messages._wrapped is empty
    assert "messages" not in response.cookies


def test_a_message_added_is_stored_and_read_back():
    request = RequestFactory().get("/console/")
    request.session = {}
    stored = {}

    def view(req):
        messages.success(req, "The share link is revoked.")
        return HttpResponse("ok")

    response = LazyMessageMiddleware(view)(request)
    assert request._messages._wrapped is not empty
    stored.update(response.cookies)
    assert "messages" in stored or request.session  # the cookie storage, or the session's when too big
    following = RequestFactory().get("/console/")
    following.COOKIES = {name: morsel.value for name, morsel in stored.items()}
    following.session = request.session
    read = []
    LazyMessageMiddleware(lambda req: read.extend(str(m) for m in messages.get_messages(req)) or HttpResponse())(
        following)
    assert read == ["The share link is revoked."]


def test_djangos_checks_accept_it():
    assert not [e for e in checks.run_checks() if e.id.startswith("admin.") or e.id.startswith("messages.")]
