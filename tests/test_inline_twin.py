"""Inline compensation twins (issue 14, finding 4.3), over HTTP: Unwind on a live server, tools on loopback.

`compensation: {tool: {…a tool's settings…}, args: {…}}` registers the twin as `<forward>.undo`, its own
immutable tool version whose args schema derives from the forward tool's schema and the mapping. It is versioned
with the forward tool: a step is undone by the twin written with the version the step was proposed under.
"""
import pytest

from ledger.models import Tool
from ledger.engine.proposal import compensation_plan_of
from tests.wire_support import tool_service, wired  # noqa: F401 - fixtures

BOOK_SCHEMA = {"type": "object", "required": ["hotel"],
               "properties": {"hotel": {"type": "string", "maxLength": 40}, "nights": {"type": "integer"}}}


def book_policy(service, *, cancel_path: str = "/cancel", **twin) -> dict:
    return {
        "executor": {"kind": "http", "url": service.answer("/book", {"booking_id": "B1"})},
        "approval": "auto", "args_schema": BOOK_SCHEMA,
        "compensation": {"strategy": "twin",
                         "tool": {"executor": {"kind": "http", "url": service.answer(cancel_path, {"ok": True})},
                                  "retry": {"max_attempts": 2, "backoff": 0}, **twin},
                         "args": {"booking_id": "$result.booking_id", "hotel": "$args.hotel"}},
    }


def pay_policy(service) -> dict:
    return {"executor": {"kind": "http", "url": service.answer("/pay", {"detail": "declined"}, status=402)},
            "approval": "auto", "on_refusal": "unwind"}


@pytest.fixture
def booked(wired, tool_service):
    loaded = wired.load({"tools": {"travel.book": book_policy(tool_service), "travel.pay": pay_policy(tool_service)}})
    assert loaded.status_code == 200, loaded.text
    return wired


def fail_after_booking(wired) -> dict:
    run = wired.open_run()
    booked = wired.propose(run["id"], "travel.book", {"hotel": "Ritz", "nights": 2})
    assert booked.status_code == 201 and booked.json()["status"] == "succeeded", booked.text
    return run


def test_the_twin_is_registered_with_a_schema_derived_from_the_mapping(booked):
    tools = {t["name"]: t for t in booked.agent.get(f"{booked.base}/api/v1/tools", timeout=10).json()}
    assert set(tools) == {"travel.book", "travel.book.undo", "travel.pay"}
    twin = tools["travel.book.undo"]["policy"]
    assert twin["args_schema"] == {"type": "object", "additionalProperties": False,
                                   "required": ["booking_id", "hotel"],
                                   "properties": {"booking_id": {}, "hotel": {"type": "string", "maxLength": 40}}}
    assert twin["saga_role"] == "compensatable" and twin["executor"] == "http" and twin["retry"]["max_attempts"] == 2
    forward = tools["travel.book"]["policy"]
    assert forward["compensation"]["tool"]["executor"]["url"].endswith("/cancel")


def test_a_later_failure_calls_the_inline_twin_over_http_with_the_mapped_args(booked, tool_service):
    run = fail_after_booking(booked)
    paid = booked.propose(run["id"], "travel.pay", {})
    assert paid.json()["status"] == "failed"

    shown = booked.run(run["id"])
    assert shown["status"] == "compensated"
    undo = [a for a in shown["actions"] if a["kind"] == "compensation"]
    assert [(a["tool"], a["status"], a["args"]) for a in undo] == [
        ("travel.book.undo", "succeeded", {"booking_id": "B1", "hotel": "Ritz"})]
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B1", "hotel": "Ritz"}]


def test_get_then_put_round_trips_and_changes_nothing(booked):
    url = f"{booked.base}/api/v1/tools/travel.book"
    policy = booked.admin.get(url, timeout=10).json()["policy"]
    again = booked.admin.put(url, json=policy, timeout=30)
    assert again.status_code == 200 and again.json()["version"] == 1, again.text
    assert Tool.objects.filter(name="travel.book.undo").count() == 1


def test_a_step_is_undone_by_the_twin_of_its_own_version(booked, tool_service):
    run = fail_after_booking(booked)  # proposed under travel.book v1, twin v1 (/cancel)

    changed = booked.admin.put(f"{booked.base}/api/v1/tools/travel.book",
                               json=book_policy(tool_service, cancel_path="/cancel-v2"), timeout=30)
    assert changed.status_code == 200 and changed.json()["version"] == 2, changed.text
    twins = Tool.objects.filter(name="travel.book.undo").order_by("version")
    assert [(t.version, t.is_current, t.endpoint.rsplit("/", 1)[1]) for t in twins] == [
        (1, False, "cancel"), (2, True, "cancel-v2")]

    booked.propose(run["id"], "travel.pay", {})
    assert booked.run(run["id"])["status"] == "compensated"
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B1", "hotel": "Ritz"}]
    assert tool_service.calls_to("/cancel-v2") == []

    later = fail_after_booking(booked)
    booked.propose(later["id"], "travel.pay", {})
    assert tool_service.calls_to("/cancel-v2") == [{"booking_id": "B1", "hotel": "Ritz"}]


def test_the_by_name_form_still_works_beside_it(wired, tool_service):
    loaded = wired.load({"tools": {
        "travel.book": {**book_policy(tool_service), "compensation": {
            "strategy": "twin", "tool": "travel.cancel", "args": {"booking_id": "$result.booking_id"}}},
        "travel.cancel": {"executor": {"kind": "http", "url": tool_service.answer("/cancel", {})}, "approval": "auto"},
        "travel.pay": pay_policy(tool_service)}})
    assert loaded.status_code == 200, loaded.text
    run = fail_after_booking(wired)
    wired.propose(run["id"], "travel.pay", {})
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B1"}]
    assert not Tool.objects.filter(name="travel.book.undo").exists()


REFUSED = [
    ({"args_schema": {}}, "tools.travel.book.compensation.tool.args_schema", "derived from the forward tool"),
    ({"compensation": "none"}, "tools.travel.book.compensation.tool.compensation", "an undo has no undo"),
    ({"saga_role": "pivot"}, "tools.travel.book.compensation.tool.saga_role", "cannot be a pivot"),
    ({"executor": {"kind": "http", "url": "http://169.254.169.254/latest"}},
     "tools.travel.book.compensation.tool.executor.url", ""),
    ({"colour": "red"}, "tools.travel.book.compensation.tool.colour", "is not a tool setting"),
]


@pytest.mark.parametrize("twin, field, says", REFUSED)
def test_a_malformed_inline_twin_is_refused_naming_the_field(wired, tool_service, twin, field, says):
    answer = wired.admin.put(f"{wired.base}/api/v1/tools/travel.book", json=book_policy(tool_service, **twin),
                             timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["code"] == "validation_error" and answer.json()["field"] == field, answer.json()
    assert says in answer.json()["detail"]
    assert not Tool.objects.exists()


def test_the_twin_cannot_take_the_name_of_a_tool_of_its_own(wired, tool_service):
    own = {"executor": {"kind": "http", "url": tool_service.answer("/own", {})}, "approval": "auto"}
    assert wired.admin.put(f"{wired.base}/api/v1/tools/travel.book.undo", json=own, timeout=30).status_code == 201
    answer = wired.admin.put(f"{wired.base}/api/v1/tools/travel.book", json=book_policy(tool_service), timeout=30)
    assert answer.status_code == 400 and answer.json()["field"] == "tools.travel.book.compensation.tool"
    assert "already a tool of its own" in answer.json()["detail"]
    assert list(Tool.objects.values_list("name", "version")) == [("travel.book.undo", 1)]

    both = wired.load({"tools": {"travel.book": book_policy(tool_service), "travel.book.undo": own}})
    assert both.status_code == 400 and "defined here too" in both.json()["detail"]


def test_the_twin_is_changed_through_its_forward_tool_only(booked, tool_service):
    url = f"{booked.base}/api/v1/tools/travel.book.undo"
    twin = booked.admin.get(url, timeout=10).json()["policy"]
    twin["endpoint"] = tool_service.url + "/elsewhere"
    answer = booked.admin.put(url, json=twin, timeout=30)
    assert answer.status_code == 400 and answer.json()["field"] == "tools.travel.book.undo"
    assert "inline compensation twin of 'travel.book'" in answer.json()["detail"]
    assert Tool.objects.filter(name="travel.book.undo").count() == 1
    assert booked.agent.put(url, json=twin, timeout=30).status_code == 403


def test_a_proposal_that_read_the_old_version_binds_the_old_twin(booked, tool_service):
    """The race the twin's recorded version closes: a proposal loads travel.book v1, the policy changes, and only
    then is the compensation bound. It must bind twin v1 (the one written with v1), not the current v2."""
    old = Tool.objects.get(name="travel.book", version=1)
    changed = booked.admin.put(f"{booked.base}/api/v1/tools/travel.book",
                               json=book_policy(tool_service, cancel_path="/cancel-v2"), timeout=30)
    assert changed.json()["version"] == 2
    plan = compensation_plan_of(old, booked.world.acme.pk)
    bound = Tool.objects.get(pk=plan["tool_id"])
    assert (bound.name, bound.version, plan["tool_version"]) == ("travel.book.undo", 1, 1)
    assert bound.endpoint.endswith("/cancel")
    current = compensation_plan_of(Tool.objects.get(name="travel.book", is_current=True), booked.world.acme.pk)
    assert current["tool_version"] == 2
