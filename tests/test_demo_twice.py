"""A second `make demo` on a port in use stops before it touches anything, and says what to do.

It used to delete and re-seed var/demo.sqlite3 under the first demo's server, run its scenarios against that
server, and only then fail with "a demo process stopped".
"""
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from sandbox.management.commands.demo import DEMO_DATABASE

# The demo runs on its own SQLite file, whatever the suite's database: the SQLite run of the suite tests it, and
# a PostgreSQL run would only start the same processes again.
pytestmark = pytest.mark.skipif(not settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"),
                                reason="the demo runs on its own SQLite file: the SQLite run tests it")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def first_demo(tmp_path):
    """The first demo as a second one meets it: its port taken and its database on disk (a user's own, if there
    is one, is put back afterwards)."""
    kept = None
    if DEMO_DATABASE.exists():
        kept = tmp_path / "kept.sqlite3"
        shutil.copy2(DEMO_DATABASE, kept)
    DEMO_DATABASE.parent.mkdir(exist_ok=True)
    DEMO_DATABASE.write_bytes(b"the first demo's decisions " + os.urandom(16))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        if kept is not None:
            shutil.copy2(kept, DEMO_DATABASE)
        else:
            DEMO_DATABASE.unlink(missing_ok=True)


def test_a_second_demo_on_the_same_port_changes_nothing_and_says_why(first_demo):
    port = first_demo
    before = digest(DEMO_DATABASE)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(PORT=str(port), PY=sys.executable)
    started = time.monotonic()
    # What `make demo` runs, with the Makefile's own defaults (the demo's database, the development key).
    second = subprocess.run(["make", "-s", "demo", f"PORT={port}", f"BIN={Path(sys.executable).parent}"],
                            cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    said = second.stdout + second.stderr
    assert second.returncode != 0, said
    assert took < 30, f"took {took:.1f} s"  # refused before migrating and seeding (a minute), on a loaded machine
    # The next port that was free when it looked: port + 1 unless another process on the machine held that one too
    # (CI runs three suites beside each other, each with servers on ports the kernel hands out).
    suggested = re.search(r"make demo PORT=(\d+)", said)
    assert f"port {port} is in use" in said and suggested and int(suggested.group(1)) > port, said
    assert "starting from a clean demo database" not in said and "seeded" not in said, said
    assert digest(DEMO_DATABASE) == before  # the first demo's database, byte for byte
