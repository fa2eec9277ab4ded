"""The tool base URL follows the port a server is started on, or a mismatch is refused at start.

A server started on port N with the default base URL (port 8000) used to send its relative tool calls
(`/sandbox/...`) to whatever listened on 8000. These tests start real `manage.py runserver` processes on a
free port and look at where the tool calls went, and at the refusal.
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from config.serving import PortMismatch, follow_serving_port

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("UNWIND_BASE_URL", "UNWIND_TOOL_BASE_URL")}
    env.update(UNWIND_SANDBOX="1", UNWIND_INSECURE_DEV_KEY="1", UNWIND_TASKS_SYNC="1", PYTHONUNBUFFERED="1", **extra)
    return env


def manage(*args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


SEED = """
import yaml
from django.contrib.auth import get_user_model
from ledger.tenancy import agent_create, membership_set, tenant_create
from ledger.policy.versions import tools_load
from sandbox.services import sandbox_reset
tenant = tenant_create(slug="porty", name="Porty")
tools_load(tenant=tenant, document=yaml.safe_load(open("sandbox/policy.yaml")), actor="test")
sandbox_reset(tenant=tenant)
user = get_user_model().objects.create_user("olga", "olga@example.com", "pw-olga")
membership_set(tenant=tenant, user=user, role="operator")
print(agent_create(tenant=tenant, name="a")[1])
"""


def test_relative_tool_urls_go_to_the_port_the_server_listens_on(tmp_path):
    from unwind_client import Unwind

    env = environment(DATABASE_URL=f"sqlite:///{tmp_path / 'served.sqlite3'}")
    assert manage("migrate", "--noinput", env=env).returncode == 0
    seeded = manage("shell", "-c", SEED, env=env)
    assert seeded.returncode == 0, seeded.stderr
    key = seeded.stdout.strip().splitlines()[-1]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        run = Unwind(base, key).run(goal="Port check", on_behalf_of="p@example.com")
        user = run.act("hr.create_user", {"email": "p@example.com", "name": "Port Check"})
        calls = requests.get(f"{base}/sandbox/calls", auth=("olga", "pw-olga"), timeout=10).json()["results"]
        state = requests.get(f"{base}/sandbox/state", auth=("olga", "pw-olga"), timeout=10).json()
    finally:
        server.terminate()
        server.wait(timeout=15)
    assert user["id"].startswith("usr_")
    assert [u["email"] for u in state["users"]] == ["p@example.com"]  # this server's world, reached on its own port
    assert [c["tool"] for c in calls] == ["hr.create_user"]


def test_a_base_url_on_another_local_port_is_refused_at_start():
    port, other = free_port(), free_port()
    started = manage("runserver", f"127.0.0.1:{port}", "--noreload", timeout=60,
                     env=environment(UNWIND_BASE_URL=f"http://127.0.0.1:{other}"))
    assert started.returncode != 0
    assert (f"UNWIND_BASE_URL is http://127.0.0.1:{other}, but this server listens on port {port}" in started.stderr)
    assert f"Set UNWIND_BASE_URL=http://127.0.0.1:{port}" in started.stderr
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2)  # nothing was served


def test_explicit_settings_are_kept_when_they_say_where_things_live(settings):
    settings.UNWIND_BASE_URL = "https://unwind.example.com"
    settings.UNWIND_TOOL_BASE_URL = "https://unwind.example.com"
    # Behind a proxy: the public name is not this port, and that is fine.
    assert follow_serving_port("127.0.0.1", 8123, environ={"UNWIND_BASE_URL": "https://unwind.example.com"}) == \
        "https://unwind.example.com"
    # Tools on a server of their own, named: a local base URL on another port is then deliberate.
    settings.UNWIND_BASE_URL = "http://127.0.0.1:8000"
    environ = {"UNWIND_BASE_URL": "http://127.0.0.1:8000", "UNWIND_TOOL_BASE_URL": "http://127.0.0.1:9000"}
    assert follow_serving_port("127.0.0.1", 8123, environ=environ) == "http://127.0.0.1:8000"
    with pytest.raises(PortMismatch):
        follow_serving_port("127.0.0.1", 8123, environ={"UNWIND_BASE_URL": "http://localhost:8000"})
    environ = {}
    assert follow_serving_port("0.0.0.0", 8123, environ=environ) == "http://127.0.0.1:8123"
    assert settings.UNWIND_TOOL_BASE_URL == environ["UNWIND_TOOL_BASE_URL"] == "http://127.0.0.1:8123"


def test_the_development_server_sends_each_write_at_once():
    """runserver (and the tests' live server) turns Nagle's algorithm off on each connection it accepts (ledger/apps.py,
    dev_server_sends_at_once): a kept-alive answer's body is not held 40 ms for the client's ACK of its headers."""
    from django.core.servers.basehttp import WSGIRequestHandler

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            handler = WSGIRequestHandler.__new__(WSGIRequestHandler)
            handler.request = accepted
            handler.setup()  # socketserver's: the switch applied to the connection
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
