"""Helpers shared by the API tests (test_api_*.py): clients per persona over the WSGI handler, problem checks.

The fixtures that build them are in `tests.api_fixtures` (a plugin the test modules load).
"""
import base64
import time

from rest_framework.test import APIClient

from sandbox.selectors import call_list
from tests.helpers import acme


def basic(username: str, password: str | None = None) -> str:
    raw = f"{username}:{password or 'pw-' + username}".encode()
    return "Basic " + base64.b64encode(raw).decode()


class Clients:
    """An API client per persona: `agent` (acme's key), `intruder` (globex's key), and people by name."""

    def __init__(self, world):
        self.world = world
        self.agent = self.bearer(world.key)
        self.intruder = self.bearer(world.other_key)
        self.anonymous = APIClient()

    @staticmethod
    def bearer(key: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        return client

    def person(self, username: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=basic(username))
        return client

    def open_run(self, **body) -> dict:
        body = {"goal": "test run", "on_behalf_of": "carol@example.com", **body}
        response = self.agent.post("/api/v1/runs", body, format="json")
        assert response.status_code == 201, response.content
        return response.json()

    def propose(self, run_id: int, tool: str, args: dict, *, key: str | None = None, client=None, **body):
        headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
        return (client or self.agent).post(f"/api/v1/runs/{run_id}/actions", {"tool": tool, "args": args, **body},
                                           format="json", **headers)

    def wait(self, action_id: int, timeout: float = 10):
        return self.agent.get(f"/api/v1/actions/{action_id}/wait", {"timeout": timeout})


def assert_problem(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/problem+json"), response["Content-Type"]
    body = response.json()
    assert body["code"] == code, body
    assert body["status"] == status and body["type"] == f"urn:unwind:problem:{code}"
    assert body["title"] and body["detail"]
    return body


def effects(tool: str) -> list:
    return [call for call in call_list(tenant=acme(), tool=tool)["results"] if call["effect_applied"]]


def settle(clients: Clients, action_id: int, timeout: float = 10.0) -> dict:
    """Wait until an action (started in a background thread) has settled; leaves no thread behind."""
    deadline = time.monotonic() + timeout
    while True:
        response = clients.wait(action_id, timeout=5)
        if response.status_code == 200 or time.monotonic() > deadline:
            return response.json()

