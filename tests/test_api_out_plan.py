"""Issue 40: the hot path's output shapes (`OutSerializer`) answer from a plan made once per class, not from
fields bound again for every answer; what they answer is exactly what DRF's own `to_representation` answers, for
actions and runs in every state a run below reaches (succeeded, failed, compensated, undone, awaiting approval,
with errors, results and nulls)."""
from rest_framework import serializers
from django.test import RequestFactory

from ledger.api import base
from ledger.api.actions import ProposalOut
from ledger.api.serializers import ActionOut, RunDetailOut, RunOut, action_context
from ledger.models import Action, Run
from tests.helpers import act, fault, open_run


def drf(serializer, instance):
    """What DRF answers for `instance` with `serializer`'s class and context: every field bound for it."""
    return serializers.Serializer.to_representation(serializer, instance)


def test_every_shape_answers_what_drf_answers(tools):
    request = RequestFactory().get("/api/v1/runs")
    done = open_run(tools, goal="onboard")
    user = act(done, "hr.create_user", {"email": "ashu@company.com", "name": "Ashu Kumar"})
    act(done, "licenses.provision", {"user_id": user.result["id"]})
    undone = open_run(tools, goal="travel")
    act(undone, "hr.create_user", {"email": "a@x.io", "name": "A"})
    fault("travel.reserve_hotel", "status", status=422)
    act(undone, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})

    actions = list(Action.objects.select_related("run", "tool").order_by("id"))
    assert {a.status for a in actions} >= {"succeeded", "failed", "compensated"}
    for action in actions:
        context = {**action_context(request, [action]), "replayed": True, "matched_by": "key"}
        for shape in (ActionOut, ProposalOut):
            serializer = shape(action, context=context)
            assert serializer.data == drf(shape(action, context=context), action), (shape.__name__, action.status)
    for run in Run.objects.all():
        context = {"request": request, "actions": list(run.actions.select_related("tool").order_by("seq")),
                   "checkpoints": list(run.checkpoints.all())}
        for shape in (RunOut, RunDetailOut):
            assert shape(run, context=context).data == drf(shape(run, context=context), run), shape.__name__


def test_a_shape_with_a_field_the_plan_does_not_know_keeps_drfs_way():
    class Nested(base.OutSerializer):
        id = serializers.IntegerField()
        inner = serializers.DictField(child=serializers.DictField())  # plain
        other = ActionOut()  # a nested serializer: DRF binds it per answer

    class Flat(base.OutSerializer):
        id = serializers.IntegerField()
        name = serializers.CharField(source="tool.name", default="none")
        missing = serializers.CharField(required=False)

    assert base._plan(Nested) is None
    assert [name for name, *_ in base._plan(Flat)] == ["id", "name", "missing"]

    class Thing:
        id = 7
        tool = None

    # A missing attribute as DRF takes it: the default where there is one, skipped where not required.
    assert Flat(Thing()).data == {"id": 7, "name": "none"} == drf(Flat(Thing()), Thing())


def test_the_plain_reading_answers_what_drfs_reading_answers():
    """The plan reads attributes itself and converts aware datetimes with the current time zone read once an answer;
    every other case (a mapping, a callable, a missing link, a zone activated, another format) answers as DRF."""
    import datetime as dt
    import zoneinfo

    from django.test import override_settings
    from django.utils import timezone

    class Shape(base.OutSerializer):
        id = serializers.IntegerField()
        name = serializers.CharField(source="tool.name", default="none")
        label = serializers.CharField(source="label_of")
        at = serializers.DateTimeField()
        naive = serializers.DateTimeField(allow_null=True)
        fixed = serializers.DateTimeField(default_timezone=dt.timezone(dt.timedelta(hours=5)))
        text = serializers.DateTimeField()

    class Tool:
        name = "hr.create_user"

    class Thing:
        id = 7
        tool = Tool()
        at = dt.datetime(2026, 11, 28, 9, 30, 15, 123456, tzinfo=dt.timezone.utc)
        naive = dt.datetime(2026, 11, 28, 9, 30)
        fixed = at
        text = "2026-11-28"

        def label_of(self):
            return f"thing {self.id}"

    thing = Thing()
    as_dict = {"id": 8, "tool": {"name": "x.y"}, "label_of": "d", "at": Thing.at, "naive": None, "fixed": Thing.at,
               "text": "t"}
    detached = Thing()
    detached.tool = {"name": "from a mapping"}
    for instance in (thing, as_dict, detached):
        assert Shape(instance).data == drf(Shape(instance), instance)
    assert Shape(thing).data["at"] == "2026-11-28T09:30:15.123456Z"
    assert Shape(thing).data["label"] == "thing 7"
    with timezone.override(zoneinfo.ZoneInfo("Asia/Kolkata")):
        assert Shape(thing).data == drf(Shape(thing), thing)
        assert Shape(thing).data["at"] == "2026-11-28T15:00:15.123456+05:30"
    with override_settings(REST_FRAMEWORK={"DATETIME_FORMAT": "%Y-%m-%d %H:%M"}):
        assert Shape(thing).data == drf(Shape(thing), thing)
        assert Shape(thing).data["at"] == "2026-11-28 09:30"


def test_a_nested_input_validates_as_drfs_deep_copy_does():
    """`ShallowFields` copies a nested serializer still as built (a proposal's intent) shallowly: every answer,
    valid or not, is the one DRF's own deep-copied fields give; one already bound or read is deep-copied."""
    from ledger.api.actions import IntentIn, ProposeIn

    class Drf(ProposeIn):
        def get_fields(self):
            return serializers.Serializer.get_fields(self)

    bodies = [{"tool": "hr.create_user", "args": {"a": 1}},
              {"tool": "hr.create_user", "args": {}, "intent": {"goal": "g", "confidence": 0.5, "model": "m"}},
              {"tool": "hr.create_user", "args": {}, "intent": {"goal": 5, "confidence": 2, "typo": 1}},
              {"tool": "hr.create_user", "args": {}, "intent": "not an object"},
              {"tool": "hr.create_user", "args": {}, "intent": None},
              {"tool": "", "args": [], "intent": {"reasoning": "x" * 20001}, "repeat_of": "7"}]
    for body in bodies:
        ours, drfs = ProposeIn(data=body), Drf(data=body)
        assert ours.is_valid() == drfs.is_valid(), body
        assert ours.errors == drfs.errors and dict(ours.validated_data) == dict(drfs.validated_data), body
    first, second = ProposeIn(data=bodies[1]), ProposeIn(data=bodies[2])
    assert first.fields["intent"] is not second.fields["intent"]
    assert first.fields["intent"].parent is first and second.fields["intent"].parent is second
    assert first.fields["intent"].fields["goal"].root is first
    template = ProposeIn._declared_fields["intent"]
    assert template.parent is None and "fields" not in template.__dict__  # copies never bind it
    assert base._copy(template).__dict__.keys() == template.__dict__.keys()  # shallow: as built

    bound = IntentIn(required=False)
    bound.bind("intent", ProposeIn())
    assert base._copy(bound).parent is None  # not as built: DRF's deep copy, rebuilt unbound
