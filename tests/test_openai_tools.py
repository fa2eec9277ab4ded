"""OpenAI-style function definitions as tool definitions (issue 14, finding 4.2).

A policy document's `tools` may be a list of OpenAI function definitions (Chat Completions style, nested under
`function`, or the flat Responses style) with Unwind's policy keys beside each; `PUT /api/v1/tools/{name}` takes
one the same way. Name, description and args schema come from the function. Malformed definitions are refused
with a problem naming the field, and nothing is registered.
"""
import io

import pytest
import yaml
from django.core.management import CommandError, call_command

from ledger.models import Tool
from tests.wire_support import tool_service, wired  # noqa: F401 - fixtures

BOOK_PARAMETERS = {"type": "object", "required": ["hotel", "nights"], "additionalProperties": False,
                   "properties": {"hotel": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}}}


def chat_style(service, **policy) -> dict:
    return {"type": "function",
            "function": {"name": "travel.book", "description": "Book a hotel room.", "parameters": BOOK_PARAMETERS,
                         "strict": True},
            "executor": {"kind": "http", "url": service.answer("/book", {"booking_id": "B1"})},
            "saga_role": "compensatable", "risk": "low", "approval": "auto",
            "compensation": {"strategy": "twin", "tool": "travel.cancel", "args": {"booking_id": "$result.booking_id"}},
            **policy}


def responses_style(service) -> dict:
    return {"type": "function", "name": "travel.cancel", "description": "Cancel a booking.",
            "parameters": {"type": "object", "required": ["booking_id"],
                           "properties": {"booking_id": {"type": "string"}}},
            "executor": {"kind": "http", "url": service.answer("/cancel", {"cancelled": True})},
            "risk": "medium", "approval": "auto"}


def test_a_list_of_function_definitions_registers_tools_the_agent_can_use(wired, tool_service):
    loaded = wired.load({"tools": [chat_style(tool_service), responses_style(tool_service)]})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["loaded"] == ["travel.book", "travel.cancel"]

    book = wired.agent.get(f"{wired.base}/api/v1/tools/travel.book", timeout=10).json()["policy"]
    assert book["description"] == "Book a hotel room." and book["args_schema"] == BOOK_PARAMETERS
    assert book["executor"] == "http" and book["compensation"]["tool"] == "travel.cancel"
    cancel = wired.agent.get(f"{wired.base}/api/v1/tools/travel.cancel", timeout=10).json()["policy"]
    assert cancel["description"] == "Cancel a booking." and cancel["risk"] == "medium"

    run = wired.open_run()
    refused = wired.propose(run["id"], "travel.book", {"hotel": "H", "nights": 0})
    assert refused.status_code == 400 and refused.json()["code"] == "validation_error", refused.text
    assert tool_service.calls_to("/book") == []
    booked = wired.propose(run["id"], "travel.book", {"hotel": "H", "nights": 2})
    assert booked.status_code == 201 and booked.json()["status"] == "succeeded", booked.text
    assert tool_service.calls_to("/book") == [{"hotel": "H", "nights": 2}]
    cancelled = wired.agent.post(f"{wired.base}/api/v1/runs/{run['id']}/cancel", json={}, timeout=30)
    assert cancelled.json()["status"] == "compensated"
    assert tool_service.calls_to("/cancel") == [{"booking_id": "B1"}]


def test_put_takes_one_function_definition_under_its_own_name(wired, tool_service):
    answer = wired.admin.put(f"{wired.base}/api/v1/tools/travel.cancel", json=responses_style(tool_service), timeout=30)
    assert answer.status_code == 201, answer.text
    assert answer.json()["policy"]["args_schema"]["required"] == ["booking_id"]

    other = wired.admin.put(f"{wired.base}/api/v1/tools/travel.refund", json=responses_style(tool_service), timeout=30)
    assert other.status_code == 400
    assert other.json()["field"] == "tools.travel.refund.name"
    assert "is 'travel.cancel', but this tool is 'travel.refund'" in other.json()["detail"]
    assert not Tool.objects.filter(name="travel.refund").exists()


def test_an_object_of_tools_may_mix_both_forms(wired, tool_service):
    cancel = responses_style(tool_service)
    loaded = wired.load({"tools": {"travel.book": chat_style(tool_service), "travel.cancel": cancel}})
    assert loaded.status_code == 200, loaded.text
    assert Tool.objects.get(name="travel.book").description == "Book a hotel room."


BAD = [
    (lambda d: d.update(type="tool"), "tools[0].type", 'must be "function"'),
    (lambda d: d.update(function="travel.book"), "tools[0].function", "must be an object"),
    (lambda d: d["function"].pop("name"), "tools[0].function.name", "a function needs a name"),
    (lambda d: d["function"].update(name="travel book!"), "tools[0].function.name", "a function needs a name"),
    (lambda d: d["function"].update(returns={}), "tools[0].function.returns", "is not part of a function definition"),
    (lambda d: d["function"].update(strict="yes"), "tools[0].function.strict", "must be true or false"),
    (lambda d: d["function"].update(description=["x"]), "tools[0].function.description", "must be a string"),
    (lambda d: d["function"].update(parameters={"type": "nonsense"}), "tools[0].function.parameters",
     "is not a valid JSON Schema"),
    (lambda d: d["function"].update(parameters={"$ref": "https://evil.example/s.json"}),
     "tools[0].function.parameters.$ref", ""),
    (lambda d: d.update(description="twice"), "tools[0].description", "belongs inside function"),
    (lambda d: d.update(args_schema={}), "tools[0].args_schema", "comes from the function's parameters"),
    (lambda d: d.update(name="travel.book"), "tools[0].name", "belongs inside function"),
    (lambda d: d.update(saga_role="sometimes"), "tools[0].saga_role", "must be one of"),
    (lambda d: d.update(colour="red"), "tools[0].colour", "is not a tool setting"),
]


@pytest.mark.parametrize("spoil, field, says", BAD)
def test_malformed_definitions_are_refused_naming_the_field(wired, tool_service, spoil, field, says):
    entry = chat_style(tool_service)
    spoil(entry)
    before = Tool.objects.count()
    answer = wired.load({"tools": [entry, responses_style(tool_service)]})
    assert answer.status_code == 400, answer.text
    problem = answer.json()
    assert problem["code"] == "validation_error" and problem["field"] == field, problem
    assert says in problem["detail"]
    assert Tool.objects.count() == before


def test_a_name_defined_twice_is_refused(wired, tool_service):
    answer = wired.load({"tools": [responses_style(tool_service), responses_style(tool_service)]})
    assert answer.status_code == 400 and answer.json()["field"] == "tools[1].name"
    assert "'travel.cancel' is defined twice" in answer.json()["detail"]
    assert not Tool.objects.exists()


def test_load_tools_reads_function_definitions_from_yaml(wired, tool_service, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"tenant": "acme",
                                    "tools": [chat_style(tool_service), responses_style(tool_service)]}))
    out = io.StringIO()
    call_command("load_tools", str(path), stdout=out)
    assert "loaded 2 tool(s) into acme" in out.getvalue()
    assert Tool.objects.get(name="travel.book").args_schema == BOOK_PARAMETERS

    spoiled = chat_style(tool_service)
    del spoiled["function"]["name"]
    path.write_text(yaml.safe_dump({"tenant": "acme", "tools": [spoiled]}))
    with pytest.raises(CommandError, match=r"tools\[0\]\.function\.name: a function needs a name"):
        call_command("load_tools", str(path), stdout=io.StringIO())


def test_the_agent_safety_shape_takes_them_too(wired, tool_service):
    answer = wired.load({"agentSafety": {"policies": [responses_style(tool_service)]}})
    assert answer.status_code == 200, answer.text
    assert Tool.objects.get(name="travel.cancel").risk == "medium"
