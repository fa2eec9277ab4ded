"""CI's third run (PostgreSQL on the Python path) takes only the tests marked `engine_paths` (tests/conftest.py): a
module with tests that need PostgreSQL, or that switch the engine's path, must be among them, or its tests would never
run on the Python path against PostgreSQL; a module that needs PostgreSQL for what no path touches is named in
PATH_FREE_MODULES instead, and never switches the path."""
from pathlib import Path

from tests.conftest import ENGINE_PATH_MODULES, PATH_FREE_MODULES

TESTS = Path(__file__).parent
SIGNS = ("needs_postgres", "UNWIND_FAST_PATH", "fastpath.usable")
SWITCHES = ("UNWIND_FAST_PATH", "fastpath.usable")


def test_every_module_that_needs_postgresql_or_switches_the_path_is_marked():
    unmarked = sorted(path.stem for path in TESTS.glob("test_*.py")
                      if path.stem not in ENGINE_PATH_MODULES | PATH_FREE_MODULES
                      and path.name != Path(__file__).name and any(sign in path.read_text() for sign in SIGNS))
    assert not unmarked, f"add to ENGINE_PATH_MODULES (tests/conftest.py): {unmarked}"


def test_a_module_left_off_the_python_path_run_never_switches_the_path_and_exists():
    assert not ENGINE_PATH_MODULES & PATH_FREE_MODULES
    switching = sorted(name for name in PATH_FREE_MODULES if (TESTS / f"{name}.py").exists()
                       and any(switch in (TESTS / f"{name}.py").read_text() for switch in SWITCHES))
    missing = sorted(name for name in PATH_FREE_MODULES if not (TESTS / f"{name}.py").exists())
    assert not switching and not missing, f"in PATH_FREE_MODULES, switching the path: {switching}; gone: {missing}"
