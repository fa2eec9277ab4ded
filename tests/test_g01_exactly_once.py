"""Guarantee 1: exactly one effect per logical action."""
import threading

import pytest
from django.db import connection

from ledger.errors import IdempotencyMismatch, StillInFlight
from ledger.models import Action
from ledger.engine.proposal import action_propose
from sandbox.selectors import call_list
from tests.conftest import needs_postgres
from tests.helpers import acme, act, open_run


def effects(tool):
    return [c for c in call_list(tenant=acme(), tool=tool)["results"] if c["effect_applied"]]


def test_same_key_same_args_replays_without_calling_the_tool(tools):
    run = open_run(tools)
    first = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"}, key="k-1")
    again = act(run, "hr.create_user", {"email": "a@x.io", "name": "A"}, key="k-1")
    assert again.pk == first.pk and again.result == first.result
    assert len(call_list(tenant=acme(), tool="hr.create_user")["results"]) == 1


def test_same_key_different_args_is_refused(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"}, key="k-1")
    with pytest.raises(IdempotencyMismatch) as refused:
        act(run, "hr.create_user", {"email": "b@x.io", "name": "B"}, key="k-1")
    assert refused.value.status == 422


def test_same_key_while_first_is_running_is_409(tools):
    run = open_run(tools)
    proposal = action_propose(run=run, tool_name="hr.create_user", args={"email": "a@x.io", "name": "A"},
                              actor="agent:booker", idempotency_key="k-1")
    assert proposal.action.status == "running"
    with pytest.raises(StillInFlight) as refused:
        action_propose(run=run, tool_name="hr.create_user", args={"email": "a@x.io", "name": "A"},
                       actor="agent:booker", idempotency_key="k-1")
    assert refused.value.status == 409
    assert call_list(tenant=acme(), tool="hr.create_user")["results"] == []


def test_resynthesised_request_without_key_is_the_same_action(tools):
    """Keys re-ordered, 2.0 for 2, another Unicode normal form: same content, same derived key."""
    run = open_run(tools)
    first = act(run, "travel.reserve_hotel", {"guest": "Zoë", "hotel": "Ritz", "nights": 2})
    again = act(run, "travel.reserve_hotel", {"nights": 2.0, "hotel": "Ritz", "guest": "Zoe\u0308"})
    assert again.pk == first.pk
    assert first.key_source == "derived" and first.idempotency_key.startswith("uw-")
    assert len(effects("travel.reserve_hotel")) == 1


def test_derived_key_does_not_depend_on_position(tools):
    run = open_run(tools)
    act(run, "hr.create_user", {"email": "a@x.io", "name": "A"})
    hotel = act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    # A restarted agent re-sends only the second step: it is recognised, not re-executed.
    again = act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    assert again.pk == hotel.pk
    assert Action.objects.filter(run=run).count() == 2


def test_a_changed_argument_is_a_new_action(tools):
    run = open_run(tools)
    a = act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    b = act(run, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 2})
    assert a.pk != b.pk and len(effects("travel.reserve_hotel")) == 2


@needs_postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicates_execute_exactly_once():
    from tests.conftest import World, in_process_policy
    from ledger.policy.versions import tools_load
    from tests.conftest import seed_sandboxes

    world = World()
    seed_sandboxes(world)
    tools_load(tenant=world.acme, document=in_process_policy(), actor="test")
    run = open_run(world)
    barrier = threading.Barrier(8)
    outcomes = []

    def duplicate():
        try:
            barrier.wait()
            outcomes.append(act(run.__class__.objects.get(pk=run.pk), "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1}, key="dup"))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            outcomes.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=duplicate) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Action.objects.filter(idempotency_key="dup").count() == 1
    assert len(call_list(tenant=acme(), tool="travel.reserve_hotel")["results"]) == 1
    assert all(isinstance(o, (Action, StillInFlight)) for o in outcomes), outcomes


def test_text_that_cannot_be_stored_is_refused_with_the_field(tools):
    from ledger.errors import ValidationFailed

    run = open_run(tools)
    with pytest.raises(ValidationFailed, match="args"):
        act(run, "hr.create_user", {"email": "a@x.io", "name": "A\x00B"})
    with pytest.raises(ValidationFailed, match="intent"):
        act(run, "hr.create_user", {"email": "a@x.io", "name": "A"}, intent={"goal": "\ud800"})
    assert not Action.objects.filter(run=run).exists()
