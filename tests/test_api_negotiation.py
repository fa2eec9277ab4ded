"""Issue 40: the API's content negotiation answers its usual case (Accept absent, */* or application/json) without
parsing the header; whatever it answers is what DRF's own negotiation answers, for every Accept and renderer list."""
import pytest
from django.http import Http404
from django.test import RequestFactory
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer, StaticHTMLRenderer
from rest_framework.request import Request

from ledger.api.base import ApiView, ContentNegotiation


class CharsetJSON(JSONRenderer):
    media_type = "application/json; charset=utf-8"


ACCEPTS = [None, "*/*", "application/json", "text/html", "application/json; indent=4", "text/html, */*;q=0.1",
           "application/*", "application/xml", "", " */*", "application/json, text/html", "*/*; q=0.5"]
RENDERERS = [[JSONRenderer(), BrowsableAPIRenderer()], [BrowsableAPIRenderer(), JSONRenderer()],
             [StaticHTMLRenderer()], [CharsetJSON(), BrowsableAPIRenderer()], [CharsetJSON()]]


def pick(negotiation, request, renderers, suffix):
    try:
        renderer, media_type = negotiation.select_renderer(request, renderers, suffix)
    except NotAcceptable:
        return "406"
    except Http404:
        return "404"
    return type(renderer).__name__, media_type


@pytest.mark.parametrize("accept", ACCEPTS)
def test_it_answers_what_drf_answers(accept):
    extra = {} if accept is None else {"HTTP_ACCEPT": accept}
    for path in ("/api/v1/runs", "/api/v1/runs?format=api", "/api/v1/runs?format=json"):
        request = Request(RequestFactory().get(path, **extra))
        for renderers in RENDERERS:
            for suffix in (None, "json", "api"):
                ours = pick(ContentNegotiation(), request, renderers, suffix)
                assert ours == pick(DefaultContentNegotiation(), request, renderers, suffix), (accept, path, suffix)


def test_the_api_views_use_it():
    assert ApiView.content_negotiation_class is ContentNegotiation
