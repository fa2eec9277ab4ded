"""Issue 42 over MCP, against the live server: `unwind_status` answers for an archived run (2026-07-28, by its
handle) and an archived step (any revision, by its action_id) from the archive, marked `archived`, to the run's own
agent only (another agent or tenant is told what a run that never was is told); calls into an archived run answer
run_archived and change nothing; a segment that fails its hash answers archive_unavailable. A run or step whose
person's data was erased carries REST's `erased` marker, hot or archived."""
import requests

from ledger.models import ArchivedRun
from ledger.tenancy import agent_create
from recovery.erasure import subject_erase
from tests.helpers import archive_past_retention, as_if
from tests.test_archive_erasure import dana_run
from tests.test_archive_reads_http import NEVER, everything
from tests.test_erasure import DANA
from tests.test_mcp_modern import modern_body, modern_headers

pytest_plugins = ["tests.archive_fixtures"]  # the archived fixture: a live server, two archived runs

HANDSHAKE = "2025-06-18"


class Handshake:
    """An MCP session of a handshake revision over plain HTTP: initialize, then tools/call."""

    def __init__(self, world, key):
        self.url, self.headers = f"{world.url}/mcp", {
            "Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json"}
        opened = requests.post(self.url, headers=self.headers, timeout=10, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": HANDSHAKE, "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}})
        assert opened.status_code == 200, opened.text
        self.headers.update({"Mcp-Session-Id": opened.headers["Mcp-Session-Id"], "Mcp-Protocol-Version": HANDSHAKE})

    def call(self, name, arguments) -> requests.Response:
        return requests.post(self.url, headers=self.headers, timeout=10, json={
            "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": name, "arguments": arguments}})


def stateless(world, key, name, arguments) -> requests.Response:
    """A 2026-07-28 tools/call: no session, the run as a handle."""
    return requests.post(f"{world.url}/mcp", json=modern_body("tools/call", {"name": name, "arguments": arguments}),
                         headers=modern_headers(key, "tools/call", name), timeout=10)


def result(answer: requests.Response) -> tuple[bool, dict]:
    assert answer.status_code == 200, answer.text
    called = answer.json()["result"]
    return called.get("isError", False), called["structuredContent"]


def test_status_of_an_archived_step_answers_from_its_segment_to_its_agent_only(archived):
    step = archived.alpha_steps[0]
    segment = ArchivedRun.objects.get(pk=archived.alpha.pk).segment.sha256
    for answer in (Handshake(archived, archived.key).call("unwind_status", {"action_id": step}),
                   stateless(archived, archived.key, "unwind_status", {"action_id": step})):
        is_error, payload = result(answer)
        assert not is_error and payload["status"] == "succeeded" and payload["tool"] == "hr.create_user", payload
        assert payload["run_id"] == archived.alpha.pk and payload["run_status"] == "completed"
        assert payload["archived"]["segment"] == segment and payload["result"]["email"] == "alpha-secret@x.io"
        assert "erased" not in payload
    never = Handshake(archived, archived.key).call("unwind_status", {"action_id": NEVER})
    assert result(never)[0] and result(never)[1]["code"] == "not_found"
    _, second = agent_create(tenant=archived.acme, name="second")
    for key in (second, archived.other_key):
        refused = Handshake(archived, key).call("unwind_status", {"action_id": step})
        assert result(refused)[0] and "secret" not in refused.text
        assert as_if(refused, step, NEVER) == never.text


def test_status_of_an_archived_run_by_its_handle_answers_with_its_steps(archived):
    is_error, payload = result(stateless(archived, archived.key, "unwind_status", {"run_id": archived.alpha.pk}))
    assert not is_error and payload["run_id"] == archived.alpha.pk and payload["run_status"] == "completed", payload
    assert payload["goal"] == "onboard alpha-secret" and "archived" in payload["message"]
    assert [s["tool"] for s in payload["steps"]] == ["hr.create_user", "licenses.provision"]
    assert payload["archived"]["segment"] == ArchivedRun.objects.get(pk=archived.alpha.pk).segment.sha256
    never = stateless(archived, archived.key, "unwind_status", {"run_id": NEVER})
    assert result(never)[1]["code"] == "not_found"
    _, second = agent_create(tenant=archived.acme, name="second")
    for key in (second, archived.other_key):
        refused = stateless(archived, key, "unwind_status", {"run_id": archived.alpha.pk})
        assert result(refused)[0] and as_if(refused, archived.alpha.pk, NEVER) == never.text


def test_calls_into_an_archived_run_answer_run_archived_and_change_nothing(archived):
    _, second = agent_create(tenant=archived.acme, name="second")
    handshake = Handshake(archived, archived.key)
    before = everything(archived)
    run = archived.alpha.pk
    for name, arguments in (("unwind_commit", {"run_id": run}), ("unwind_rollback", {"run_id": run}),
                            ("unwind_begin", {"run_id": run}),
                            ("hr.create_user", {"email": "z@x.io", "name": "Z", "unwind_run": run})):
        is_error, payload = result(stateless(archived, archived.key, name, arguments))
        assert is_error and payload["code"] == "run_archived" and payload["run_id"] == run, (name, payload)
        assert payload["archived"]["segment"] and "archived" in payload["message"]
    is_error, payload = result(handshake.call("unwind_begin", {"run_id": run}))
    assert is_error and payload["code"] == "run_archived"
    refused = stateless(archived, second, "unwind_commit", {"run_id": run})
    assert result(refused)[1]["code"] == "not_found"
    assert everything(archived) == before


def test_a_segment_that_fails_its_hash_answers_archive_unavailable(archived):
    [segment] = archived.archive_dir.rglob("*.jsonl.zst")
    segment.write_bytes(segment.read_bytes()[:-1] + b"\0")
    for answer in (Handshake(archived, archived.key).call("unwind_status", {"action_id": archived.alpha_steps[0]}),
                   stateless(archived, archived.key, "unwind_status", {"run_id": archived.alpha.pk})):
        is_error, payload = result(answer)
        assert is_error and payload["code"] == "archive_unavailable" and "secret" not in answer.text, payload


def test_an_erased_run_and_its_steps_carry_the_erased_marker_hot_and_archived(archived,
                                                                              django_capture_on_commit_callbacks):
    run = dana_run(archived, django_capture_on_commit_callbacks)
    subject_erase(tenant=archived.acme, subject=DANA, reason="request #7", by="user:ada")
    rest = requests.get(f"{archived.url}/api/v1/runs/{run.pk}", headers={"Authorization": f"Bearer {archived.key}"},
                        timeout=10).json()
    assert rest["erased"]["why"] == "at the person's request"
    step = rest["actions"][0]["id"]

    def answers():
        _, by_run = result(stateless(archived, archived.key, "unwind_status", {"run_id": run.pk}))
        _, by_step = result(Handshake(archived, archived.key).call("unwind_status", {"action_id": step}))
        return by_run, by_step

    for payload in answers():
        assert payload["erased"] == rest["erased"] and "archived" not in payload, payload
    archive_past_retention(archived, [run])
    for payload in answers():
        assert payload["erased"] == rest["erased"] and payload["archived"], payload
