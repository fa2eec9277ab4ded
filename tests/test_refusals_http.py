"""Issue 14, finding 3: refusals the agent can answer, and the idle-run deadline.

A tool that answers "not carried out" (a 4xx but 408/425/429) did nothing: by default the agent is answered
with the tool's reason (422 tool_refused) and its run stays open, so it can propose again with other
arguments or cancel. `on_refusal: unwind` keeps the old behaviour. A run the agent walked away from is
unwound by the sweep once it has been idle past its deadline.

Everything goes over real HTTP: the agent and the people talk to a live server, and the tools are a real
stateful HTTP service on loopback (a seat-booking and card-charging world) that records every call.
"""
from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.utils import timezone

from ledger.policy import registry
from ledger.executors.call import ToolError, ToolRefused
from ledger.models import Action, AuditEvent, Run
from ledger.engine.sweep import sweep
from tests.quick_server import QUICK_SHUTDOWN

# In-process tools (registered in code, as a deployer would): a refusal is ToolRefused, or a ToolError with a 4xx.
PAY = "tests.test_refusals_http.pay"
PAID: list[dict] = []


@registry.tool(PAY)
def pay(args: dict, *, idempotency_key: str, target: str | None, tenant: str) -> dict:
    if args.get("card") == "declined":
        raise ToolRefused("insufficient funds: use another card")
    if args.get("card") == "blocked":
        raise ToolError("card blocked by the issuer", transient=False, status=403)
    if args.get("card") == "broken":
        raise ToolError("the issuer's switch is down", transient=False)
    PAID.append(args)
    return {"paid": args.get("card")}


class SeatWorld:
    """Seats and cards over HTTP on 127.0.0.1:<free port>. Seat 12A is taken; card "declined" has no funds;
    /status/<code> always answers that status. Every call is recorded as (path, body)."""

    def __init__(self):
        world = self
        self.calls: list[tuple[str, dict]] = []
        self.taken = {"12A"}
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with world.lock:
                    world.calls.append((self.path, body))
                    status, answer = world.answer(self.path, body)
                payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/seats/book":
            seat = body.get("seat")
            if seat in self.taken:
                return 409, {"detail": f"seat {seat} is taken: choose another seat"}
            self.taken.add(seat)
            return 201, {"booking_id": f"bk-{seat}", "seat": seat}
        if path == "/seats/cancel":
            self.taken.discard(str(body.get("booking_id", "")).removeprefix("bk-"))
            return 200, {"cancelled": body.get("booking_id")}
        if path == "/cards/charge":
            if body.get("card") == "declined":
                return 402, {"detail": "insufficient funds: use another card"}
            return 200, {"charge_id": f"ch-{body.get('card')}"}
        if path == "/cards/refund":
            return 200, {"refunded": body.get("charge_id")}
        if path.startswith("/status/"):
            return int(path.rsplit("/", 1)[1]), {"detail": "try again later"}
        return 404, {"detail": "no such tool"}

    def called(self, path: str) -> list[dict]:
        return [body for seen, body in self.calls if seen == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def policy(origin: str, *, on_refusal: str | None = None) -> dict:
    """The seat world's tools. `on_refusal` (when given) is set on every forward tool."""
    forward = {} if on_refusal is None else {"on_refusal": on_refusal}
    return {"tools": {
        "seats.cancel": {"endpoint": f"{origin}/seats/cancel", "approval": "auto", "compensation": "none",
                         "args_schema": {"type": "object"}, "retry": {"max_attempts": 2, "backoff": 0}},
        "seats.book": {"endpoint": f"{origin}/seats/book", "approval": "auto", "args_schema": {"type": "object"},
                       "compensation": {"strategy": "twin", "tool": "seats.cancel",
                                        "args": {"booking_id": "$result.booking_id"}}, **forward},
        "seats.book_gated": {"endpoint": f"{origin}/seats/book", "approval": "manual",
                             "args_schema": {"type": "object"},
                             "compensation": {"strategy": "twin", "tool": "seats.cancel",
                                              "args": {"booking_id": "$result.booking_id"}}, **forward},
        "cards.refund": {"endpoint": f"{origin}/cards/refund", "saga_role": "retriable", "approval": "auto",
                         "compensation": "none", "args_schema": {"type": "object"}},
        "cards.charge": {"endpoint": f"{origin}/cards/charge", "saga_role": "pivot", "approval": "auto",
                         "args_schema": {"type": "object"},
                         "compensation": {"strategy": "twin", "tool": "cards.refund",
                                          "args": {"charge_id": "$result.charge_id"}, "approval": "auto"}, **forward},
        **{f"flaky.s{code}": {"endpoint": f"{origin}/status/{code}", "approval": "auto", "compensation": "none",
                              "args_schema": {"type": "object"}, "retry": {"max_attempts": 3, "backoff": 0},
                              **forward}
           for code in (408, 429, 503)},
        "flaky.after503": {"endpoint": f"{origin}/status/503", "approval": "auto", "compensation": "none",
                           "saga_role": "retriable", "args_schema": {"type": "object"},
                           "retry": {"max_attempts": 2, "backoff": 0}},
        "flaky.slow503": {"endpoint": f"{origin}/status/503", "approval": "auto", "compensation": "none",
                          "args_schema": {"type": "object"}, "retry": {"max_attempts": 3, "backoff": 3000}},
        "notes.post": {"executor": "client", "approval": "auto", "args_schema": {"type": "object"},
                       "compensation": "none", **forward},
    }}


@pytest.fixture
def seats(http_tools, settings):
    world = SeatWorld()
    settings.UNWIND_TOOL_ORIGINS = [world.origin]
    http_tools.seats = world
    yield http_tools
    world.close()


def person(world, username: str) -> requests.Session:
    session = requests.Session()
    session.auth = (username, f"pw-{username}")
    session.base = world.live_server.url
    return session


def agent(world) -> requests.Session:
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {world.key}"
    session.base = world.live_server.url
    return session


def load(world, **kwargs) -> None:
    admin = person(world, "ada")
    loaded = admin.post(f"{admin.base}/api/v1/policy", json=policy(world.seats.origin, **kwargs), timeout=30)
    assert loaded.status_code == 200, loaded.text


def open_run(client, **body) -> int:
    opened = client.post(f"{client.base}/api/v1/runs", json={"goal": "book a trip", "on_behalf_of": "carol@example.com",
                                                           **body}, timeout=30)
    assert opened.status_code == 201, opened.text
    return opened.json()["id"]


def propose(client, run_id: int, tool: str, args: dict, *, key: str | None = None) -> requests.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(f"{client.base}/api/v1/runs/{run_id}/actions", json={"tool": tool, "args": args},
                       headers=headers, timeout=30)


def run_status(client, run_id: int) -> str:
    return client.get(f"{client.base}/api/v1/runs/{run_id}", timeout=30).json()["status"]


def assert_tool_refused(response: requests.Response, *, reason: str, run_state: str = "running") -> dict:
    assert response.status_code == 422, (response.status_code, response.text[:800])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["code"] == "tool_refused", problem
    assert reason in problem["reason"] and reason in problem["detail"], problem
    assert problem["run_status"] == run_state, problem
    assert problem["action"]["id"] == problem["action_id"]
    assert problem["action"]["status"] == "failed" and problem["action"]["error"]["error_class"] == "refused"
    return problem


# --- refusals ------------------------------------------------------------------------------------------------

def test_a_refusal_answers_the_agent_and_the_run_goes_on_to_complete(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    first = propose(client, run_id, "seats.book", {"seat": "3C"})
    assert first.status_code == 201 and first.json()["status"] == "succeeded", first.text

    refused = propose(client, run_id, "seats.book", {"seat": "12A"})
    problem = assert_tool_refused(refused, reason="seat 12A is taken")
    assert problem["replayed"] is False
    assert run_status(client, run_id) == "running"
    assert seats.seats.called("/seats/cancel") == [], "a refusal must compensate nothing"
    refused_action = Action.objects.get(pk=problem["action_id"])
    assert (refused_action.status, refused_action.error_class) == ("failed", "refused")
    event = AuditEvent.objects.get(kind="forward.refused", action_ref=refused_action.pk)
    assert event.data["status"] == 409 and "seat 12A is taken" in event.data["reason"]

    again = propose(client, run_id, "seats.book", {"seat": "12B"})
    assert again.status_code == 201 and again.json()["status"] == "succeeded", again.text
    completed = client.post(f"{client.base}/api/v1/runs/{run_id}/complete", timeout=30)
    assert completed.status_code == 200 and completed.json()["status"] == "completed", completed.text
    assert [body["seat"] for body in seats.seats.called("/seats/book")] == ["3C", "12A", "12B"]
    assert seats.seats.called("/seats/cancel") == []


def test_the_same_refused_call_replays_its_refusal_and_a_new_key_is_a_new_attempt(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    first = assert_tool_refused(propose(client, run_id, "seats.book", {"seat": "12A"}), reason="12A is taken")

    replay = propose(client, run_id, "seats.book", {"seat": "12A"})
    replayed = assert_tool_refused(replay, reason="12A is taken")
    assert replayed["replayed"] is True and replay.headers["Idempotent-Replayed"] == "true"
    assert replayed["action_id"] == first["action_id"]
    assert len(seats.seats.called("/seats/book")) == 1, "a replay must not call the tool again"

    seats.seats.taken.discard("12A")  # the seat was freed meanwhile: a new attempt, under a new key, may succeed
    retried = propose(client, run_id, "seats.book", {"seat": "12A"}, key="seat-12A-second-try")
    assert retried.status_code == 201 and retried.json()["status"] == "succeeded", retried.text
    assert retried.json()["id"] != first["action_id"]
    assert len(seats.seats.called("/seats/book")) == 2


def test_on_refusal_unwind_keeps_the_old_behaviour(seats):
    load(seats, on_refusal="unwind")
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    failed = propose(client, run_id, "seats.book", {"seat": "12A"})
    assert failed.status_code == 201, failed.text
    body = failed.json()
    assert body["status"] == "failed" and body["error"]["error_class"] == "http_409", body
    assert body["run_status"] in ("unwinding", "compensated"), body
    action = client.get(f"{client.base}/api/v1/actions/{body['id']}/wait?timeout=10", timeout=30).json()
    assert action["run_status"] == "compensated", action
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3C"}]
    assert not AuditEvent.objects.filter(kind="forward.refused").exists()


@pytest.mark.parametrize("code", [408, 429, 503])
def test_transient_answers_still_retry_then_unwind_after_an_answered_refusal(seats, code):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    # A refusal first: answered, the run open. Then a tool that only ever asks to try later: retried, then unwound.
    assert_tool_refused(propose(client, run_id, "seats.book", {"seat": "12A"}), reason="12A is taken")
    failed = propose(client, run_id, f"flaky.s{code}", {"n": 1})
    assert failed.status_code == 201, failed.text
    body = failed.json()
    assert body["status"] == "failed" and body["error"]["error_class"] == f"http_{code}", body
    assert len(seats.seats.called(f"/status/{code}")) == 3, "max_attempts: 3"
    client.get(f"{client.base}/api/v1/actions/{body['id']}/wait?timeout=10", timeout=30)
    assert run_status(client, run_id) == "compensated"
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3C"}]


def test_a_refused_pivot_leaves_room_for_a_second_pivot_and_is_never_compensated(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    assert_tool_refused(propose(client, run_id, "cards.charge", {"card": "declined", "amount": 4900}),
                        reason="insufficient funds")
    run = Run.objects.get(pk=run_id)
    assert run.pivot_committed is False

    charged = propose(client, run_id, "cards.charge", {"card": "visa-4242", "amount": 4900})
    assert charged.status_code == 201 and charged.json()["status"] == "succeeded", charged.text
    run.refresh_from_db()
    assert run.pivot_committed is True
    # The law still holds: a third pivot after the committed one is refused at proposal.
    third = propose(client, run_id, "cards.charge", {"card": "amex-1", "amount": 1})
    assert third.status_code == 409 and third.json()["rule"] == "one_pivot", third.text
    assert third.json()["conflicts_with"]["seq"] == charged.json()["seq"]


def test_a_refused_pivot_before_a_cancel_is_not_compensated(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    assert_tool_refused(propose(client, run_id, "cards.charge", {"card": "declined", "amount": 4900}),
                        reason="insufficient funds")
    cancelled = client.post(f"{client.base}/api/v1/runs/{run_id}/cancel", json={"reason": "no card works"}, timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    assert run_status(client, run_id) == "compensated"
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3C"}]
    assert seats.seats.called("/cards/refund") == [], "the refused charge did nothing: nothing to refund"


def test_an_operator_resume_retries_the_failed_step_not_the_refused_one(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert_tool_refused(propose(client, run_id, "cards.charge", {"card": "declined", "amount": 1}), reason="funds")
    assert propose(client, run_id, "cards.charge", {"card": "visa-4242", "amount": 1}).status_code == 201
    failed = propose(client, run_id, "flaky.after503", {"n": 1})
    assert failed.status_code == 201 and failed.json()["run_status"] == "needs_attention", failed.text
    oscar = person(seats, "oscar")
    item = oscar.get(f"{oscar.base}/api/v1/recovery-items?run={run_id}", timeout=30).json()["results"][0]
    resumed = oscar.post(f"{oscar.base}/api/v1/recovery-items/{item['id']}/resume", json={"reason": "try again"},
                         timeout=30)
    assert resumed.status_code == 200, resumed.text
    assert len(seats.seats.called("/status/503")) == 4, "the failed step is retried (2 more attempts)"
    assert [body["card"] for body in seats.seats.called("/cards/charge")] == ["declined", "visa-4242"], \
        "the refused charge did nothing and is no operator's to retry"


def test_a_refusal_in_the_worker_shows_as_failed_refused_and_the_run_stays_open(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    gated = propose(client, run_id, "seats.book_gated", {"seat": "12A"})
    assert gated.status_code == 202 and gated.json()["status"] == "awaiting_approval", gated.text
    alice = person(seats, "alice")
    approval_id = gated.json()["approval"]["id"]
    approved = alice.post(f"{alice.base}/api/v1/approvals/{approval_id}/approve", json={"reason": "ok"}, timeout=30)
    assert approved.status_code == 200, approved.text
    action = client.get(f"{client.base}/api/v1/actions/{gated.json()['id']}/wait?timeout=10", timeout=30)
    assert action.status_code == 200, action.text
    body = action.json()
    assert body["status"] == "failed" and body["error"]["error_class"] == "refused", body
    assert "seat 12A is taken" in body["error"]["message"]
    assert body["run_status"] == "running"
    assert propose(client, run_id, "seats.book", {"seat": "12C"}).status_code == 201


def test_a_client_reported_refusal_follows_the_same_rule(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    proposed = propose(client, run_id, "notes.post", {"text": "hello"})
    assert proposed.status_code == 202, proposed.text
    report = client.post(proposed.json()["links"]["report"], json={"ok": False, "error": "channel is archived",
                                                                   "refused": True}, timeout=30)
    assert report.status_code == 200, report.text
    assert report.json()["error"]["error_class"] == "refused" and report.json()["run_status"] == "running"
    assert seats.seats.called("/seats/cancel") == []

    # A refusal with a result is no refusal: refused without ok: false is bad input, nothing changes.
    bad = client.post(proposed.json()["links"]["report"], json={"ok": True, "refused": True}, timeout=30)
    assert bad.status_code == 400 and bad.json()["field"] == "refused", bad.text

    # A plain reported failure still unwinds, as before.
    other = propose(client, run_id, "notes.post", {"text": "again"})
    failed = client.post(other.json()["links"]["report"], json={"ok": False, "error": "crashed"}, timeout=30)
    assert failed.status_code == 200 and failed.json()["error"]["error_class"] == "permanent", failed.text
    assert run_status(client, run_id) == "compensated"
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3C"}]


def test_the_python_client_raises_refused_and_the_run_goes_on(seats):
    from unwind_client import Refused, Unwind

    load(seats)
    unwind = Unwind(seats.live_server.url, api_key=seats.key)
    with unwind.run(goal="book a seat", on_behalf_of="carol@example.com") as run:
        with pytest.raises(Refused) as refused:
            run.act("seats.book", {"seat": "12A"})
        assert refused.value.code == "tool_refused" and "12A is taken" in refused.value.problem["reason"]
        assert refused.value.problem["run_status"] == "running"
        assert run.act("seats.book", {"seat": "12B"})["booking_id"] == "bk-12B"
    assert run.refresh().data["status"] == "completed"


def test_an_in_process_tool_refuses_with_tool_refused_or_a_4xx(seats):
    load(seats)
    admin = person(seats, "ada")
    created = admin.put(f"{admin.base}/api/v1/tools/cards.pay", json={
        "executor": {"kind": "python", "path": PAY}, "approval": "auto", "compensation": "none",
        "saga_role": "retriable", "args_schema": {"type": "object"}}, timeout=30)
    assert created.status_code == 201, created.text
    PAID.clear()
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3C"}).status_code == 201
    assert_tool_refused(propose(client, run_id, "cards.pay", {"card": "declined"}), reason="insufficient funds")
    assert_tool_refused(propose(client, run_id, "cards.pay", {"card": "blocked"}), reason="card blocked")
    paid = propose(client, run_id, "cards.pay", {"card": "visa-4242"})
    assert paid.status_code == 201 and paid.json()["result"] == {"paid": "visa-4242"}, paid.text
    assert PAID == [{"card": "visa-4242"}]
    assert client.post(f"{client.base}/api/v1/runs/{run_id}/complete", timeout=30).json()["status"] == "completed"
    # A failure that is no refusal (a plain permanent error) still fails the step and unwinds, as before.
    run_id = open_run(client)
    assert propose(client, run_id, "seats.book", {"seat": "3D"}).status_code == 201
    broken = propose(client, run_id, "cards.pay", {"card": "broken"})
    assert broken.status_code == 201 and broken.json()["error"]["error_class"] == "permanent", broken.text
    assert run_status(client, run_id) == "compensated"
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3D"}]


def test_on_refusal_is_part_of_the_tools_immutable_version(seats):
    load(seats)
    admin = person(seats, "ada")
    tool = admin.get(f"{admin.base}/api/v1/tools/seats.book", timeout=30).json()
    assert tool["policy"]["on_refusal"] == "answer" and tool["version"] == 1
    spec = dict(tool["policy"], on_refusal="unwind")
    changed = admin.put(f"{admin.base}/api/v1/tools/seats.book", json=spec, timeout=30)
    assert changed.status_code == 200 and changed.json()["version"] == 2, changed.text
    assert changed.json()["policy"]["on_refusal"] == "unwind"
    bad = admin.put(f"{admin.base}/api/v1/tools/seats.book", json=dict(spec, on_refusal="ignore"), timeout=30)
    assert bad.status_code == 400 and bad.json()["field"] == "tools.seats.book.on_refusal", bad.text
    # An agent cannot loosen it: tools are governed by people.
    sneaky = agent(seats).put(f"{admin.base}/api/v1/tools/seats.book", json=dict(spec, on_refusal="answer"), timeout=30)
    assert sneaky.status_code == 403 and sneaky.json()["code"] == "agents_cannot_govern", sneaky.text
    assert admin.get(f"{admin.base}/api/v1/tools/seats.book", timeout=30).json()["policy"]["on_refusal"] == "unwind"


# --- the idle deadline ---------------------------------------------------------------------------------------

def walk_away(run_id: int, *, hours: float) -> None:
    """Move the run's clock back: its last activity (and its deadline with it) `hours` ago, as if the agent left."""
    then = timezone.now() - timedelta(hours=hours)
    run = Run.objects.get(pk=run_id)
    Run.objects.filter(pk=run_id).update(updated_at=then, created_at=then,
                                         idle_deadline=then + timedelta(seconds=run.idle_timeout_seconds))
    Action.objects.filter(run_id=run_id).update(updated_at=then, created_at=then)


def test_the_sweep_unwinds_a_run_whose_agent_went_away_and_leaves_an_active_one(seats):
    load(seats)
    client = agent(seats)
    gone, active = open_run(client), open_run(client)
    assert propose(client, gone, "seats.book", {"seat": "3C"}).status_code == 201
    assert propose(client, active, "seats.book", {"seat": "4D"}).status_code == 201
    walk_away(gone, hours=2)
    # The active run's stored deadline has passed too, but its agent acted a moment ago: the sweep measures again.
    Run.objects.filter(pk=active).update(idle_deadline=timezone.now() - timedelta(minutes=1))

    counts = sweep()
    assert counts["idle"] == 1, counts
    assert run_status(client, gone) == "compensated"
    assert seats.seats.called("/seats/cancel") == [{"booking_id": "bk-3C"}]
    assert run_status(client, active) == "running"
    assert Run.objects.get(pk=active).idle_deadline > timezone.now() + timedelta(minutes=50)
    assert AuditEvent.objects.filter(kind="run.idle", run_ref=gone).count() == 1

    late = propose(client, gone, "seats.book", {"seat": "5E"})
    assert late.status_code == 409, late.text
    problem = late.json()
    assert problem["code"] == "run_not_active" and problem["run_status"] == "compensated", problem
    assert "idle for 1h: the agent went away" in problem["detail"], problem
    assert propose(client, active, "seats.book", {"seat": "5E"}).status_code == 201
    assert sweep()["idle"] == 0


def test_a_run_waiting_for_a_person_or_a_step_is_not_idle(seats, settings):
    load(seats)
    client = agent(seats)
    waiting = open_run(client)
    gated = propose(client, waiting, "seats.book_gated", {"seat": "7F"})
    assert gated.status_code == 202, gated.text
    # A step whose retry is scheduled far ahead: the run is running, but it waits for its step, not its agent.
    settings.UNWIND_MAX_BACKOFF = 3600
    retrying = open_run(client)
    scheduled = propose(client, retrying, "flaky.slow503", {"n": 1})
    assert scheduled.status_code == 202 and scheduled.json()["status"] == "retry_scheduled", scheduled.text
    walk_away(waiting, hours=2)
    walk_away(retrying, hours=2)
    assert sweep()["idle"] == 0
    assert run_status(client, waiting) == "awaiting_approval"
    assert run_status(client, retrying) == "running"


def test_an_idle_run_after_its_pivot_goes_to_the_recovery_queue(seats):
    load(seats)
    client = agent(seats)
    run_id = open_run(client)
    assert propose(client, run_id, "cards.charge", {"card": "visa-4242", "amount": 100}).status_code == 201
    walk_away(run_id, hours=2)
    assert sweep()["idle"] == 1
    oscar = person(seats, "oscar")
    run = oscar.get(f"{oscar.base}/api/v1/runs/{run_id}", timeout=30).json()
    assert run["status"] == "needs_attention" and run["attention"]["reason"] == "idle_after_pivot", run
    assert seats.seats.called("/cards/refund") == []
    items = oscar.get(f"{oscar.base}/api/v1/recovery-items?run={run_id}", timeout=30).json()["results"]
    assert [item["reason"] for item in items] == ["idle_after_pivot"]
    # Resumed by a person, the run is running again with a fresh idle clock; left alone again, it is idle again.
    resumed = oscar.post(f"{oscar.base}/api/v1/recovery-items/{items[0]['id']}/resume", json={"reason": "agent back"},
                         timeout=30)
    assert resumed.status_code == 200 and run_status(client, run_id) == "running", resumed.text
    assert sweep()["idle"] == 0
    walk_away(run_id, hours=2)
    assert sweep()["idle"] == 1 and run_status(client, run_id) == "needs_attention"


def test_the_idle_timeout_is_the_tenants_policy_and_a_run_may_only_shorten_it(seats):
    admin = person(seats, "ada")
    loaded = admin.post(f"{admin.base}/api/v1/policy", json={"defaults": {"run_idle_timeout": "30m"}}, timeout=30)
    assert loaded.status_code == 200, loaded.text
    client = agent(seats)
    opened = client.post(f"{client.base}/api/v1/runs", json={"goal": "g"}, timeout=30)
    assert opened.status_code == 201 and opened.json()["idle_timeout"] == 1800, opened.text
    shorter = client.post(f"{client.base}/api/v1/runs", json={"goal": "g", "idle_timeout": 120}, timeout=30)
    assert shorter.status_code == 201 and shorter.json()["idle_timeout"] == 120, shorter.text

    before = Run.objects.count()
    for asked in (7200, 1801, 10, "1h", True):
        longer = client.post(f"{client.base}/api/v1/runs", json={"goal": "g", "idle_timeout": asked}, timeout=30)
        assert longer.status_code == 400, (asked, longer.text)
        assert longer.json()["field"] == "idle_timeout", longer.text
    assert Run.objects.count() == before, "a refused open leaves no run"

    for bad in ("10s", "31d", "soon"):
        refused = admin.post(f"{admin.base}/api/v1/policy", json={"defaults": {"run_idle_timeout": bad}}, timeout=30)
        assert refused.status_code == 400 and refused.json()["field"] == "defaults.run_idle_timeout", refused.text
    # An agent cannot lengthen its leash through the policy endpoint either.
    sneaky = client.post(f"{client.base}/api/v1/policy", json={"defaults": {"run_idle_timeout": "30d"}}, timeout=30)
    assert sneaky.status_code == 403, sneaky.text
    seats.acme.refresh_from_db()
    assert seats.acme.run_idle_timeout_seconds == 1800
