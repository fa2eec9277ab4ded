"""What every API view shares: problem responses, strict input serializers, paging, id converters."""
from __future__ import annotations

import re

from django.urls import register_converter
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination
from rest_framework.views import APIView

from ledger.api.problems import PROBLEM_JSON


class ApiView(APIView):
    """An APIView whose refusals are served as application/problem+json (except in the browsable API)."""

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        if getattr(response, "exception", False) and getattr(request, "accepted_renderer", None) is not None \
                and request.accepted_renderer.format != "api":
            response.content_type = PROBLEM_JSON
        return response


class StrictSerializer(serializers.Serializer):
    """An input serializer that refuses unknown fields instead of silently ignoring a typo."""

    def to_internal_value(self, data):
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, dict) else []
        errors = {name: [f"is not a field here (known: {', '.join(self.fields)})"] for name in unknown}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            raise serializers.ValidationError({**exc.detail, **errors}) if errors else exc
        if errors:
            raise serializers.ValidationError(errors)
        return value


class NewestFirst(CursorPagination):
    """Cursor paging on the id: a constant number of queries per page, however deep."""

    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def decode_cursor(self, request):
        """A cursor that does not decode is bad input (400), not a missing page."""
        invalid = serializers.ValidationError({"cursor": ["This cursor is not one we gave out: copy it from `next` "
                                                          "or `previous`."]})
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise invalid from None
        # DRF checks the offset and direction of a cursor but passes its position to the query as is.
        if cursor is not None and cursor.position is not None and not IdConverter.regex_matches(cursor.position):
            raise invalid
        return cursor


class OldestFirst(NewestFirst):
    """Cursor paging in the order things happened: a run's history reads from its start."""

    ordering = "id"


PAGE_PARAMETERS = [
    OpenApiParameter("cursor", OpenApiTypes.STR, OpenApiParameter.QUERY, required=False,
                     description="The page to fetch: copy it from `next` or `previous`."),
    OpenApiParameter("limit", OpenApiTypes.INT, OpenApiParameter.QUERY, required=False,
                     description=f"Items per page (default {NewestFirst.page_size}, at most {NewestFirst.max_page_size})."),
]


class IdConverter:
    """Database ids: digits only, and short enough for a 64-bit column (a longer one is a 404, not a 500)."""

    regex = "[0-9]{1,18}"

    @classmethod
    def regex_matches(cls, value: str) -> bool:
        return re.fullmatch(cls.regex, value) is not None

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value) -> str:
        return str(value)


class NameConverter:
    """Tool names: anything but a slash or a control character."""

    regex = "[^/\x00-\x1f\x7f]{1,120}"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(IdConverter, "id")
register_converter(NameConverter, "name")


def absolute(request, path: str) -> str:
    return request.build_absolute_uri(path) if request is not None else path
