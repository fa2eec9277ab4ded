"""What the README and the docs tell a newcomer to type runs as printed.

Every fenced block marked `runnable` (```` ```bash runnable ````) in README.md and docs/*.md runs, verbatim and in
order (one shell per file, as a reader pastes one block after another), in a second shell after `make demo`,
against that demo. The README's `create_agent` used to fail on a fresh checkout (no SECRET_KEY, not the demo's
database) and the examples ignored the demo's port; `. var/demo.env` now gives a second shell all of it.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
RUNNABLE = re.compile(r"^```bash runnable\n(.*?)^```", re.S | re.M)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(path: Path) -> list[str]:
    return RUNNABLE.findall(path.read_text())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_runnable_marks_are_found():
    """The extraction is not empty: the README and docs/demo.md each have blocks to run, each starting a shell."""
    marked = {path.name: runnable_blocks(path) for path in DOCS}
    assert marked["README.md"] and marked["demo.md"]
    assert all(blocks[0].lstrip().startswith(". var/demo.env") for blocks in marked.values() if blocks)


@pytest.mark.parametrize("example, extra", [("langgraph_agent.py", "langgraph"),
                                            ("openai_agents_agent.py", "openai-agents")])
def test_an_adapter_example_without_its_extra_names_the_extra(example, extra):
    """Run as a reader without the extra would: its framework cannot be imported (a None in sys.modules)."""
    hide = {"langgraph_agent.py": ["langchain_core", "langgraph"], "openai_agents_agent.py": ["agents", "openai"]}
    code = ("import runpy, sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hide[example])
            + f"sys.argv = [{example!r}]\nrunpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')\n")
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1
    assert f"pip install '.[{extra}]'" in ran.stderr and "Traceback" not in ran.stderr, ran.stderr


@pytest.mark.slow
def test_every_runnable_command_runs_as_printed_after_make_demo(tmp_path):
    if not settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        pytest.skip("the demo runs on a SQLite database of its own, whatever the suite's: the SQLite run covers it")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}", "UNWIND_INSECURE_DEV_KEY": "1",
           "UNWIND_SANDBOX": "1", "PYTHONUNBUFFERED": "1"}  # its lines reach the log as they are printed
    log = open(tmp_path / "demo.out", "w+")
    # What `make demo` runs (the Makefile's recipe), on a database of the test's own.
    demo = subprocess.Popen([sys.executable, "manage.py", "demo", "--serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Unwind is serving at" not in (tmp_path / "demo.out").read_text():
            assert demo.poll() is None and time.monotonic() < deadline, (tmp_path / "demo.out").read_text()[-3000:]
            time.sleep(1)
        second_shell = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": env["HOME"],
                        "LANG": "C.UTF-8"}  # nothing of the first shell's: demo.env must carry it all
        said = {}
        for path in DOCS:
            blocks = runnable_blocks(path)
            if not blocks:
                continue
            script = "set -euo pipefail\n" + "\n".join(blocks)
            ran = subprocess.run(["bash", "-c", script], cwd=ROOT, env=second_shell, capture_output=True, text=True,
                                 timeout=300)
            assert ran.returncode == 0, f"{path.name}:\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
            said[path.name] = ran.stdout
        assert re.search(r"^uw_\w+", said["README.md"], re.M)  # create_agent printed the new agent's key
        assert "as expected" in said["README.md"] and "expected completed" not in said["README.md"]
        assert "Everything the agent changed has been undone." in said["demo.md"]
    finally:
        os.killpg(demo.pid, signal.SIGINT)
        try:
            demo.wait(timeout=60)  # it stops its web server and worker first, each given 15 s to finish
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)  # its children are told to stop when it dies
            demo.wait()
        log.close()
        # Nothing the demo started outlives it: no web server, worker or cluster on the test's database.
        left = _processes_with(env["DATABASE_URL"], wait=20)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"the demo left processes running: {left}"


def _processes_with(value: str, *, wait: float) -> list[int]:
    """The processes whose environment holds `value`, once `wait` seconds pass without them all gone."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if value.encode() in (entry / "environ").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    pass  # gone, or not ours
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
