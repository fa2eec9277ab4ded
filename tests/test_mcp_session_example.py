"""Issue 38, finding 5: examples/mcp_session.py reaches the server `. var/demo.env` names, and says in one line
why it cannot.

It used to ignore UNWIND_URL (always http://127.0.0.1:8000/mcp, where a `make demo PORT=8123` is not) and to end
in an exception-group traceback when nothing answered or the key was wrong. Run here as a newcomer runs it, as a
process of its own, against the live server or a port where nothing listens.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

from ledger.models import Run
from mcp_gateway.models import McpSession
from tests.test_mcp_gateway import gateway  # noqa: F401 - the api world served by the live server

pytest_plugins = ["tests.api_fixtures"]
ROOT = Path(__file__).resolve().parent.parent


def example(*args: str, url: str, key: str) -> subprocess.CompletedProcess:
    """The example as `. var/demo.env` then `.venv/bin/python examples/mcp_session.py` runs it."""
    env = {**os.environ, "UNWIND_URL": url, "UNWIND_AGENT_KEY": key}
    return subprocess.run([sys.executable, "examples/mcp_session.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def nothing_listens() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def one_line(ended: subprocess.CompletedProcess) -> str:
    assert ended.returncode == 1, (ended.returncode, ended.stdout[-2000:], ended.stderr[-2000:])
    assert "Traceback" not in ended.stderr and "Exception" not in ended.stderr, ended.stderr[-3000:]
    lines = ended.stderr.strip().splitlines()
    assert len(lines) == 1, ended.stderr
    return lines[0]


def test_unreachable_server_is_one_line_naming_the_url(db):
    url = nothing_listens()
    said = one_line(example(url=url, key="uw_anything"))
    assert said.startswith(f"cannot reach Unwind at {url} ") and "make demo" in said and "--url" in said


def test_a_wrong_key_is_one_line_and_opens_nothing(gateway):  # noqa: F811
    base = gateway.url.rsplit("/mcp", 1)[0]
    said = one_line(example(url=base, key="uw_notakey_000000000000000000000000000000000000"))
    assert said.startswith(f"Unwind at {base} refused the agent key (401: ") and "--key" in said
    assert McpSession.objects.count() == 0 and Run.objects.count() == 0  # no session, no run, nothing called


def test_unwind_url_is_where_it_connects(gateway):  # noqa: F811
    """UNWIND_URL as `. var/demo.env` writes it (the base URL; /mcp is added), with no --url."""
    base = gateway.url.rsplit("/mcp", 1)[0]
    ended = example("--approver", "alice:pw-alice", "--operator", "oscar:pw-oscar", url=base, key=gateway.world.key)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert "Traceback" not in ended.stderr and "Exception in callback" not in ended.stderr, ended.stderr[-3000:]
    assert "alice approved approval" in ended.stdout and "still holds that user: False" in ended.stdout
    assert list(Run.objects.order_by("pk").values_list("status", flat=True)) == [
        "completed", "compensated", "compensated"]
