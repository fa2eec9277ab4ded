"""`$result` paths step into JSON-encoded string results (issue 14, finding 4.1).

LLM-style tools often answer `{"content": "{\"booking_id\": \"B1\"}"}`, or the whole result as a JSON string.
A compensation mapping must reach the id inside, over the wire: an HTTP tool books, a later step fails, and the
twin is called with the id taken out of the string. A string that is not a JSON object or array still ends the
path with the usual "missing path" error.
"""
import json

import pytest

from ledger.db import mapping
from tests.wire_support import tool_service, wired  # noqa: F401 - fixtures

pytest_plugins = ["tests.api_fixtures"]


def booking_policy(service, book_answer) -> dict:
    return {"tools": {
        "travel.book": {
            "executor": {"kind": "http", "url": service.answer("/book", book_answer)},
            "saga_role": "compensatable", "risk": "low", "approval": "auto",
            "args_schema": {"type": "object", "properties": {"hotel": {"type": "string"}}},
            "compensation": {"strategy": "twin", "tool": "travel.cancel",
                             "args": {"booking_id": "$result.content.booking_id"}},
        },
        "travel.book_whole": {
            "executor": {"kind": "http", "url": service.answer("/book_whole", json.dumps({"booking_id": "B2"}))},
            "saga_role": "compensatable", "risk": "low", "approval": "auto",
            "target": {"type": "booking", "from": "result.booking_id"},
            "compensation": {"strategy": "twin", "tool": "travel.cancel", "args": {"booking_id": "$result.booking_id"}},
        },
        "travel.cancel": {
            "executor": {"kind": "http", "url": service.answer("/cancel", {"cancelled": True})},
            "saga_role": "compensatable", "risk": "low", "approval": "auto",
            "args_schema": {"type": "object", "required": ["booking_id"]},
        },
        "travel.pay": {
            "executor": {"kind": "http", "url": service.answer("/pay", {"detail": "card declined"}, status=402)},
            "saga_role": "compensatable", "risk": "low", "approval": "auto", "on_refusal": "unwind",
        },
    }}


def test_compensation_reads_an_id_inside_a_json_string_field(wired, tool_service):
    loaded = wired.load(booking_policy(tool_service, {"content": json.dumps({"booking_id": "B1"})}))
    assert loaded.status_code == 200, loaded.text
    run = wired.open_run()
    booked = wired.propose(run["id"], "travel.book", {"hotel": "H"})
    assert booked.status_code == 201 and booked.json()["status"] == "succeeded", booked.text
    paid = wired.propose(run["id"], "travel.pay", {})
    assert paid.json()["status"] == "failed"

    assert wired.run(run["id"])["status"] == "compensated"
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B1"}]


def test_a_result_that_is_itself_a_json_string_is_reached_too(wired, tool_service):
    assert wired.load(booking_policy(tool_service, {})).status_code == 200
    run = wired.open_run()
    booked = wired.propose(run["id"], "travel.book_whole", {})
    assert booked.json()["result"] == json.dumps({"booking_id": "B2"})
    assert booked.json()["target"] == {"type": "booking", "id": "B2"}
    wired.propose(run["id"], "travel.pay", {})

    assert wired.run(run["id"])["status"] == "compensated"
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B2"}]


def test_a_plain_string_still_ends_the_path_and_the_undo_needs_a_person(wired, tool_service):
    assert wired.load(booking_policy(tool_service, {"content": "booked B1, enjoy"})).status_code == 200
    run = wired.open_run()
    wired.propose(run["id"], "travel.book", {"hotel": "H"})
    wired.propose(run["id"], "travel.pay", {})

    shown = wired.run(run["id"])
    assert shown["status"] == "needs_attention"
    assert shown["actions"][0]["status"] == "compensation_failed"
    assert tool_service.calls_to("/cancel") == []


@pytest.mark.parametrize("text", ["not json", "{broken", '"B1"', "12", "[NaN]", "{\"a\": Infinity}",
                                  "[" * 100_000 + "]" * 100_000])
def test_strings_that_are_not_a_json_object_or_array_are_not_entered(text):
    with pytest.raises(mapping.MappingError, match=r"\$result.content.booking_id is not present"):
        mapping.resolve("$result.content.booking_id", {"result": {"content": text}})


def test_json_arrays_inside_strings_are_indexed():
    result = {"content": json.dumps({"items": [{"id": "a"}, {"id": "b"}]})}
    assert mapping.resolve("$result.content.items.1.id", {"result": result}) == "b"
    assert mapping.resolve("$result.1", {"result": json.dumps(["x", "y"])}) == "y"
    # Without a path into it, the string is the value, exactly as the tool sent it.
    assert mapping.resolve("$result.content", {"result": result}) == result["content"]
