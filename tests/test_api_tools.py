"""Tools and policy over the API: list, get, upsert by name, bulk load; who may change them.

Agents only read tools; ada (acme's admin) writes them here. Who may write is attacked in test_governance.py.
"""
import copy

from ledger.models import Tool
from tests.api_support import assert_problem
from tests.conftest import in_process_policy

pytest_plugins = ["tests.api_fixtures"]  # the api and api_db fixtures

TICKET = {"description": "Escalate a ticket.", "executor": "client", "saga_role": "compensatable", "risk": "medium",
          "args_schema": {"type": "object", "required": ["ticket_id"]}, "target": {"type": "ticket", "from": "args.ticket_id"},
          "compensation": {"strategy": "twin", "tool": "crm.update_ticket", "args": {"ticket_id": "$target"}}}


def test_list_and_get_show_the_policy(api_db):
    listed = api_db.agent.get("/api/v1/tools")
    assert listed.status_code == 200
    names = [tool["name"] for tool in listed.json()]
    assert names == sorted(names) and "hr.create_user" in names
    tool = api_db.agent.get("/api/v1/tools/hr.create_user").json()
    assert tool["policy"]["saga_role"] == "compensatable"
    assert tool["policy"]["compensation"]["tool"] == "hr.delete_user"
    assert tool["policy"]["target"] == {"type": "user", "from": "result.id"}
    assert tool["url"] == "http://testserver/api/v1/tools/hr.create_user"
    assert_problem(api_db.agent.get("/api/v1/tools/no.such"), 404, "not_found")


def test_put_registers_then_updates_and_get_round_trips(api_db):
    created = api_db.person("ada").put("/api/v1/tools/crm.escalate", TICKET, format="json")
    assert created.status_code == 201, created.content
    policy = created.json()["policy"]
    assert policy["executor"] == "client" and policy["risk"] == "medium"
    updated = api_db.person("ada").put("/api/v1/tools/crm.escalate", {**policy, "risk": "high"}, format="json")
    assert updated.status_code == 200 and updated.json()["policy"]["risk"] == "high"
    assert updated.json()["policy"] == {**policy, "risk": "high"}
    assert updated.json()["version"] == 2
    assert Tool.objects.get(tenant=api_db.world.acme, name="crm.escalate", is_current=True).risk == "high"
    # The first version is kept as it was: actions proposed under it still point at it.
    assert Tool.objects.get(tenant=api_db.world.acme, name="crm.escalate", version=1).risk == "medium"
    assert not Tool.objects.filter(tenant=api_db.world.globex, name="crm.escalate").exists()


def test_put_refuses_a_bad_policy_naming_the_field(api_db):
    refused = api_db.person("ada").put("/api/v1/tools/crm.escalate", {**TICKET, "risk": "extreme"}, format="json")
    assert assert_problem(refused, 400, "validation_error")["field"] == "tools.crm.escalate.risk"
    unknown = api_db.person("ada").put("/api/v1/tools/crm.escalate", {**TICKET, "colour": "red"}, format="json")
    assert assert_problem(unknown, 400, "validation_error")["field"] == "tools.crm.escalate.colour"
    orphan = {**TICKET, "executor": "python", "endpoint": "sandbox.crm.update_ticket",
              "compensation": {"strategy": "twin", "tool": "nope"}}
    assert "compensation.tool" in assert_problem(api_db.person("ada").put("/api/v1/tools/x", orphan, format="json"), 400,
                                                 "validation_error")["field"]
    assert_problem(api_db.person("ada").put("/api/v1/tools/x", ["not", "an", "object"], format="json"), 400, "validation_error")
    assert not Tool.objects.filter(name__in=["crm.escalate", "x"]).exists()


def test_policy_load_is_all_or_nothing(api_db):
    document = {"defaults": {"approval_threshold": "critical"}, "tools": {"crm.escalate": TICKET}}
    loaded = api_db.person("ada").post("/api/v1/policy", document, format="json")
    assert loaded.status_code == 200, loaded.content
    assert loaded.json()["loaded"] == ["crm.escalate"]
    api_db.world.acme.refresh_from_db()
    assert api_db.world.acme.approval_threshold == "critical"
    broken = copy.deepcopy(in_process_policy())
    broken["tools"]["zz.new"] = {"executor": "client"}
    broken["tools"]["payments.charge"]["saga_role"] = "keystone"
    refused = api_db.person("ada").post("/api/v1/policy", broken, format="json")
    assert assert_problem(refused, 400, "validation_error")["field"] == "tools.payments.charge.saga_role"
    assert not Tool.objects.filter(name="zz.new").exists()
    other = api_db.person("ada").post("/api/v1/policy", {"tenant": "globex", "tools": {}}, format="json")
    assert assert_problem(other, 400, "validation_error")["field"] == "tenant"


def test_people_read_tools_and_admins_change_them(api_db):
    victor = api_db.person("victor")
    assert victor.get("/api/v1/tools/hr.create_user").status_code == 200
    assert_problem(victor.put("/api/v1/tools/crm.escalate", TICKET, format="json"), 403, "permission_denied")
    mallory = api_db.person("mallory")
    assert mallory.put("/api/v1/tools/crm.escalate", TICKET, format="json").status_code == 201
    assert Tool.objects.get(name="crm.escalate").tenant == api_db.world.globex
    assert_problem(mallory.get("/api/v1/tools", {"tenant": "acme"}), 404, "not_found")
    assert_problem(api_db.person("oscar").post("/api/v1/policy", {"tools": {}}, format="json"), 403, "permission_denied")


def test_a_person_in_several_tenants_names_one(api_db):
    from ledger.tenancy import membership_set

    membership_set(tenant=api_db.world.globex, user=api_db.world.victor, role="admin")
    victor = api_db.person("victor")
    assert assert_problem(victor.get("/api/v1/tools"), 400, "validation_error")["field"] == "tenant"
    assert victor.get("/api/v1/tools", {"tenant": "globex"}).status_code == 200
    assert victor.put("/api/v1/tools/crm.escalate?tenant=globex", TICKET, format="json").status_code == 201
    assert_problem(victor.put("/api/v1/tools/crm.escalate?tenant=acme", TICKET, format="json"), 403, "permission_denied")
