"""What every API view shares: problem responses, strict input serializers, paging, id converters."""
from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from copy import deepcopy
from functools import lru_cache
from operator import attrgetter

from django.core.exceptions import ObjectDoesNotExist
from django.urls import get_script_prefix, register_converter, reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.pagination import CursorPagination
from rest_framework.settings import ISO_8601, api_settings
from rest_framework.views import APIView

from ledger.api.problems import PROBLEM_JSON


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, with its usual case answered without parsing the Accept header: no format asked for and an
    Accept of */* (or none) or exactly the first renderer's media type (a parameterless one). DRF's own walk picks
    that renderer and that media type then; parsing the header and ranking the renderers cost 20-30 µs a request.
    Anything else (a list, a quality, another type, a format suffix or parameter) goes through DRF's walk."""

    def select_renderer(self, request, renderers, format_suffix=None):
        if renderers and not format_suffix:
            first = renderers[0]
            accept = request.META.get("HTTP_ACCEPT", "*/*")
            param = self.settings.URL_FORMAT_OVERRIDE
            if (accept == "*/*" or accept == first.media_type) and ";" not in first.media_type \
                    and not (param and request.query_params.get(param)):
                return first, first.media_type
        return super().select_renderer(request, renderers, format_suffix)


class ApiView(APIView):
    """An APIView whose refusals are served as application/problem+json (except in the browsable API)."""

    content_negotiation_class = ContentNegotiation

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        if getattr(response, "exception", False) and getattr(request, "accepted_renderer", None) is not None \
                and request.accepted_renderer.format != "api":
            response.content_type = PROBLEM_JSON
        return response


class ShallowFields:
    """Each serializer's fields as shallow copies of the declared ones.

    DRF gives each serializer its own fields by building them again from their arguments, deep-copied: for an
    action's thirty output fields that took 0.65 ms of the 1 ms an answer cost (the choice fields' choices, copied
    and indexed again each time). A declared field is a template nothing changes: binding sets attributes of the
    copy's own (its name, parent, label, source), and reading or writing a value reads its options, choices and
    validators (stateless ones: none of ours holds a queryset). A nested serializer binds fields of its own to
    itself, so each serializer gets its own copy of it (`_copy`)."""

    def get_fields(self):
        return {name: _copy(field) for name, field in self._declared_fields.items()}


# What binding, validating or answering sets on a serializer: a declared one holding any of them is not as built.
_USED = frozenset(("fields", "_errors", "_validated_data", "initial_data", "_data"))


def _copy(field: serializers.Field) -> serializers.Field:
    """A field as DRF would copy it for one serializer. A nested serializer (an intent in a proposal) is
    deep-copied by DRF, which builds it again from its arguments (20-30 µs); one still as built (never bound, read
    or given a context of its own) is that same state, so it is copied shallowly, with a context of its own as
    the rebuilt one would have. A list of serializers (its child is bound to it) is deep-copied as before."""
    if not isinstance(field, serializers.BaseSerializer):
        return _shallow(field)
    if type(field).__deepcopy__ is not serializers.Field.__deepcopy__ or isinstance(field, serializers.ListSerializer) \
            or "context" in field._kwargs or field.parent is not None or field.field_name is not None \
            or _USED.intersection(field.__dict__):
        return deepcopy(field)
    twin = _shallow(field)
    twin._context = {}
    return twin


# An output shape answers from a plan made once per class. DRF binds a copy of every field to each serializer and walks
# them through `_readable_fields`; for an action's thirty-odd fields that was 0.55 ms of CPU an answer, more than the
# proposal's own database call. Here the fields are bound once, to a template instance of the class, and each answer
# reads each field's attribute and converts it with that template field, as `Serializer.to_representation` does (a
# missing attribute, a null, a default alike); a method field calls this serializer's own method, so it reads this
# answer's context. A class with a field the plan does not know (a nested serializer, a related field reading the
# request) keeps DRF's way. (A comment, not the docstring: drf-spectacular publishes a serializer's docstring.)
class OutSerializer(ShallowFields, serializers.Serializer):
    """An output shape answered on the hot path (an action, a run)."""

    def to_representation(self, instance):
        plan = _plan(type(self))
        if plan is None:
            return super().to_representation(instance)
        answer = {}
        plainly = not isinstance(instance, Mapping)  # a mapping: DRF's reading of every field
        zone = _UNREAD
        for name, method, field, head, rest, kind in plan:
            if method is not None:
                answer[name] = getattr(self, method)(instance)
                continue
            try:
                if not plainly:
                    raise _Detour
                value = instance if head is None else getattr(instance, head)
                for attr in rest:
                    if isinstance(value, Mapping):
                        raise _Detour
                    value = getattr(value, attr)
                if callable(value):
                    raise _Detour
            except (_Detour, AttributeError, KeyError, ObjectDoesNotExist):
                # DRF's own reading decides: a default, a null, a skipped field, its error. Any other exception
                # propagates from the same read, as it would from DRF's.
                try:
                    value = field.get_attribute(instance)
                except serializers.SkipField:
                    continue
            if value is None:
                answer[name] = None
            elif kind is _DATETIME and type(value) is datetime.datetime and value.tzinfo is not None:
                if zone is _UNREAD:
                    zone = field.default_timezone()
                answer[name] = _iso(field, value, zone)
            else:
                answer[name] = field.to_representation(value)
        return answer


class _Detour(Exception):
    """A value the plan's plain reading does not handle: DRF's `get_attribute` reads it instead."""


_UNREAD = object()
_DATETIME = "datetime"


def _iso(field: serializers.DateTimeField, value: datetime.datetime, zone) -> str:
    """`DateTimeField.to_representation` of an aware datetime, with the current time zone read once an answer
    (`field.default_timezone()` reads a context variable each time: three times an action's answer)."""
    output_format = getattr(field, "format", api_settings.DATETIME_FORMAT)
    if zone is None or output_format is None or output_format.lower() != ISO_8601:
        return field.to_representation(value)
    try:
        value = value.astimezone(zone)
    except OverflowError:
        return field.to_representation(value)  # DRF's own refusal
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


# What a plan may convert with a field bound to a template: fields whose conversion reads only their own options.
_PLAIN = (serializers.IntegerField, serializers.CharField, serializers.ChoiceField, serializers.JSONField,
          serializers.DateTimeField, serializers.BooleanField, serializers.ListField, serializers.DictField)


def _plain_datetime(field: serializers.Field) -> bool:
    """A DateTimeField converting as DRF's own does, in the current time zone (no `default_timezone` of its own)."""
    kind = type(field)
    return isinstance(field, serializers.DateTimeField) and not hasattr(field, "timezone") \
        and kind.to_representation is serializers.DateTimeField.to_representation \
        and kind.enforce_timezone is serializers.DateTimeField.enforce_timezone \
        and kind.default_timezone is serializers.DateTimeField.default_timezone


@lru_cache(maxsize=None)
def _plan(cls) -> tuple | None:
    """(name, method name or None, bound template field, its source's first attribute and the rest, kind) per
    readable field of `cls`, or None: DRF's way. A plain field's value is read attribute by attribute, as DRF's
    `get_attribute` reads an object's; anything else (a mapping on the way, a callable, an exception) goes through
    DRF's own reading."""
    plan = []
    for name, field in cls().fields.items():
        if field.write_only:
            continue
        if isinstance(field, serializers.SerializerMethodField):
            plan.append((name, field.method_name, None, None, (), None))
        elif isinstance(field, _PLAIN) and not isinstance(field, serializers.BaseSerializer) and (
                not isinstance(field, serializers.ListField | serializers.DictField)
                or isinstance(field.child, _PLAIN)) \
                and type(field).get_attribute is serializers.Field.get_attribute:
            attrs = tuple(field.source_attrs)  # () for source="*": the instance itself
            plan.append((name, None, field, attrs[0] if attrs else None, attrs[1:],
                         _DATETIME if _plain_datetime(field) else None))
        else:
            return None
    return tuple(plan)


def _shallow(field: serializers.Field) -> serializers.Field:
    """`copy.copy(field)` without the copy protocol's detour (a third of the cost)."""
    twin = object.__new__(field.__class__)
    twin.__dict__.update(field.__dict__)
    return twin


class StrictSerializer(ShallowFields, serializers.Serializer):
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


class InMemory:
    """Rows already read (an archived run's, from its segment) as much of a queryset as cursor paging uses: an
    ordering, a filter past the cursor's position on the ordering's field, and a slice. Pages and cursors are then
    those of the same rows read from the database."""

    def __init__(self, rows):
        self.rows = list(rows)

    def order_by(self, *fields):
        rows = self.rows
        for name in reversed(fields):
            rows = sorted(rows, key=attrgetter(name.lstrip("-")), reverse=name.startswith("-"))
        return InMemory(rows)

    def filter(self, **lookups):
        rows = self.rows
        for lookup, position in lookups.items():
            name, operator = lookup.rsplit("__", 1)
            bound = int(position)  # a cursor's position is an id (NewestFirst.decode_cursor checks it)
            if operator == "gt":
                rows = [row for row in rows if getattr(row, name) > bound]
            elif operator == "lt":
                rows = [row for row in rows if getattr(row, name) < bound]
            else:
                raise ValueError(f"{lookup!r} is not a cursor's filter")
        return InMemory(rows)

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self):
        return len(self.rows)


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


_ID = 987654321987654321  # an id no route holds: where a route's id goes, in `_route`


@lru_cache(maxsize=256)
def _route(name: str, script_prefix: str) -> tuple[str, str]:
    head, found, tail = reverse(name, args=[_ID]).partition(str(_ID))
    assert found, f"{name} does not take one id"
    return head, tail


def path_to(name: str, pk: int) -> str:
    """`reverse(name, args=[pk])` for a route with one id, from the route's form kept per script prefix: reverse
    takes 0.1 ms, and an action's answer links to three routes."""
    head, tail = _route(name, get_script_prefix())
    return f"{head}{int(pk)}{tail}"


def absolute(request, path: str) -> str:
    return request.build_absolute_uri(path) if request is not None else path
