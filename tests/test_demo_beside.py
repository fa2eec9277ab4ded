"""Issue 38, finding 5: a second `make demo` never destroys a running one, and what it suggests does not either.

With a demo serving, `make demo` on its port used to say "start this one on another port: make demo PORT=8001",
and that command, in the same clone, deleted the running demo's database and mail under it (each fresh demo
removes var/demo.sqlite3 and var/demo-mail/). Here the demo's server really runs (`manage.py demo --serve`, as
`make demo` starts it); `make demo` is run again on its port and on a free one, and the command it suggests is run
beside it: the running demo's database, mail, env file and key stay as they were, and it keeps serving.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.conf import settings

from sandbox.management.commands.demo import DEMO_DATABASE, VAR

# The demo runs on its own SQLite file, whatever the suite's database: the SQLite run of the suite tests it, and
# a PostgreSQL run would only start the same processes again.
pytestmark = pytest.mark.skipif(not settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"),
                                reason="the demo runs on its own SQLite file: the SQLite run tests it")

KEPT = ["demo.sqlite3", "demo.sqlite3-wal", "demo.sqlite3-shm", "demo.env", "demo-agent.key", "demo-web.log",
        "demo-worker.log", "demo-mail"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment() -> dict:
    """The shell a newcomer types `make demo` in: no test database, the suite's development key."""
    return {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}


def make(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`make -s ARGS` with this interpreter's environment (STAMP= : nothing is installed into it)."""
    return subprocess.run(["make", "-s", *args, f"BIN={Path(sys.executable).parent}", "STAMP="],
                          cwd=settings.BASE_DIR, env=environment(), capture_output=True, text=True, timeout=timeout)


def healthy(base_url: str) -> bool:
    try:
        return requests.get(f"{base_url}/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # the demo stops its web server and worker as on Ctrl-C
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@pytest.fixture
def var_as_it_was(tmp_path):
    """A user's own demo files are put back afterwards, whatever the demos here wrote."""
    env = VAR / "demo.env"
    address = re.search(r"UNWIND_URL=(\S+)", env.read_text()) if env.exists() else None
    if address and healthy(address.group(1)):
        pytest.skip("a demo of this clone is running; this test starts and stops demos of its own")
    saved = tmp_path / "var"
    saved.mkdir()
    for name in KEPT:
        path = VAR / name
        if path.is_dir():
            shutil.copytree(path, saved / name)
        elif path.exists():
            shutil.copy2(path, saved / name)
    yield
    for name in KEPT:
        path = VAR / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        if (saved / name).is_dir():
            shutil.copytree(saved / name, path)
        elif (saved / name).exists():
            shutil.copy2(saved / name, path)


@pytest.fixture
def first_demo(var_as_it_was):
    """`make demo`'s demo, serving on a port of its own until the test ends."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**environment(), "DATABASE_URL": "sqlite:///var/demo.sqlite3", "UNWIND_SANDBOX": "1"}
    log = open(VAR / f"first-demo-{port}.out", "w")
    process = subprocess.Popen([sys.executable, "manage.py", "demo", "--serve", "--port", str(port)],
                               cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not healthy(base_url):
            assert process.poll() is None, (VAR / f"first-demo-{port}.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first demo did not serve within 120 s"
            time.sleep(0.5)
        yield port
    finally:
        stop(process)
        log.close()
        (VAR / f"first-demo-{port}.out").unlink(missing_ok=True)


def what_it_has() -> dict:
    """What the running demo must keep: its database file (the same file, not a new one), env file and key."""
    return {"database": DEMO_DATABASE.stat().st_ino, "env": (VAR / "demo.env").read_text(),
            "key": (VAR / "demo-agent.key").read_text()}


def mail() -> set[str]:
    """The messages the running demo has sent so far (it goes on sending: a later look finds these and more)."""
    folder = VAR / "demo-mail"
    return {path.name for path in folder.iterdir()} if folder.exists() else set()


def test_a_second_demo_says_one_is_running_and_suggests_one_that_destroys_nothing(first_demo):
    port = first_demo
    base_url = f"http://127.0.0.1:{port}"
    before, sent = what_it_has(), mail()
    assert f"UNWIND_URL={base_url}" in before["env"]

    on_its_port = make("demo", f"PORT={port}")
    said = on_its_port.stdout + on_its_port.stderr
    assert on_its_port.returncode != 0, said
    assert f"port {port} is in use: this clone's demo is serving at {base_url} on var/demo.sqlite3" in said, said
    assert "nothing was changed" in said and "starting from a clean demo database" not in said, said
    suggested = said.split("with a database of its own: ", 1)[1].splitlines()[0].split()
    assert suggested[:2] == ["make", "demo"], said
    options = dict(word.split("=", 1) for word in suggested[2:])
    assert options["PORT"] != str(port) and options["DATABASE_URL"] != "sqlite:///var/demo.sqlite3", said
    # What main suggested (`make demo PORT=<the next port>`) is refused too: it would start afresh on this database.
    elsewhere = make("demo", f"PORT={free_port()}")
    assert elsewhere.returncode != 0 and "a fresh demo would delete its database and mail under it" in (
        elsewhere.stdout + elsewhere.stderr)
    kept = make("demo", f"PORT={free_port()}", "KEEP=1")
    assert kept.returncode != 0 and "would re-seed it under it" in kept.stdout + kept.stderr
    assert what_it_has() == before and mail() >= sent and healthy(base_url)

    # The suggestion, as printed: a second demo beside the first, with files of its own.
    second_port = int(options["PORT"])
    own = Path(settings.BASE_DIR) / options["DATABASE_URL"].removeprefix("sqlite:///")
    second = subprocess.Popen(["make", "-s", "demo", *suggested[2:], f"BIN={Path(sys.executable).parent}", "STAMP="],
                              cwd=settings.BASE_DIR, env=environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not healthy(f"http://127.0.0.1:{second_port}"):
            assert second.poll() is None, second.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the suggested demo did not serve within 120 s"
            time.sleep(0.5)
        folder = VAR / f"demo-{second_port}"
        assert f"UNWIND_URL=http://127.0.0.1:{second_port}" in (folder / "demo.env").read_text()
        assert (folder / "demo-agent.key").read_text() != before["key"]
        assert what_it_has() == before and mail() >= sent and healthy(base_url)
    finally:
        stop(second)
        for path in (own, Path(f"{own}-wal"), Path(f"{own}-shm")):
            path.unlink(missing_ok=True)
        shutil.rmtree(VAR / f"demo-{second_port}", ignore_errors=True)
    assert what_it_has() == before and mail() >= sent and healthy(base_url)
