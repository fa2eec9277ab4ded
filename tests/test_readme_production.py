"""The README's "Running it for real" block, run as it is written: a fresh virtualenv made by `pip install .`,
docs/production.env filled in with test values, PostgreSQL, gunicorn and a worker that answer.

It started `gunicorn config.wsgi -w 4`, which `pip install .` did not install (gunicorn was only in the test and
bench extras), and `createsuperuser`, which cannot run from a script. Its database is the test run's own name with
`_readme` added, dropped and made afresh.
"""
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
POLICY = """tools:
  billing.charge:
    description: Charge a card.
    action_class: external_irreversible
    saga_role: pivot
    risk: high
    executor: {kind: http, url: "https://tools.example.com/charge"}
    args_schema: {type: object, required: [amount_cents], properties: {amount_cents: {type: integer}}}
    compensation: {strategy: none}
"""


def the_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running it for real", 1)[1]
    return re.search(r"^```sh\n(.*?)^```", section, re.S | re.M).group(1)


def filled_in(tmp_path: Path, database_url: str) -> str:
    """docs/production.env as a deployer fills it in, with this machine's paths and database."""
    values = {"UNWIND_AUDIT_SIGNING_KEY_FILE": str(tmp_path / "audit-signing.key"),
              "UNWIND_AUDIT_EXPORT_DIR": str(tmp_path / "audit-heads"), "DATABASE_URL": database_url}
    lines = []
    for line in (ROOT / "docs" / "production.env").read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            value = values.get(name, re.sub(r"<secret>", lambda _: secrets.token_urlsafe(50), value))
            line = f"{name}={value}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def postgres_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        pytest.skip("runs the production recipe on PostgreSQL: run with DATABASE_URL=postgres://…")
    return url


@pytest.mark.slow
def test_the_running_it_for_real_block_runs_verbatim(tmp_path):
    server = urlparse(postgres_url())
    database = f"{server.path.lstrip('/') or 'unwind'}_readme"
    admin = server._replace(path="/postgres").geturl()
    for statement in (f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)', f'CREATE DATABASE "{database}"'):
        subprocess.run(["psql", admin, "-q", "-c", statement], check=True, capture_output=True, timeout=60)
    checkout = tmp_path / "unwind"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes(source.read_bytes())
    (tmp_path / "audit-heads").mkdir()
    (checkout / "production.env").write_text(filled_in(tmp_path, server._replace(path=f"/{database}").geturl()))
    (checkout / "policy.yaml").write_text(POLICY)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:" + os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "LANG": "C.UTF-8", "DJANGO_SUPERUSER_PASSWORD": secrets.token_urlsafe(20),
           "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{port}",  # gunicorn's own variable: the block stays verbatim
           **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
    started = time.monotonic()
    out = open(tmp_path / "block.out", "w")  # a file, not a pipe: gunicorn and the worker outlive the shell
    shell = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + the_block()], cwd=checkout, env=env,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        shell.wait(timeout=240)
        said = (tmp_path / "block.out").read_text()
        assert shell.returncode == 0, said[-4000:]
        assert "System check identified no issues" in said and re.search(r"^uw_\w+", said, re.M), said[-4000:]
        assert re.search(r"^ok: \d+ events", said, re.M), said[-4000:]
        deadline = time.monotonic() + 30
        while True:  # gunicorn, started in the background by the block, answers as the documented host
            try:
                health = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5,
                                      headers={"Host": "unwind.example.com", "X-Forwarded-Proto": "https"})
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "gunicorn did not answer"
                time.sleep(0.5)
        assert health.status_code == 200
        workers = subprocess.run(["pgrep", "-g", str(shell.pid), "-f", "manage.py worker"], capture_output=True,
                                 text=True)
        assert workers.stdout.strip(), "the worker is not running"
        assert time.monotonic() - started < 180
    finally:
        try:
            os.killpg(shell.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        time.sleep(2)
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()
        subprocess.run(["psql", admin, "-q", "-c", f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'],
                       capture_output=True, timeout=60)
