"""The API tests' fixtures, loaded with `pytest_plugins = ["tests.api_fixtures"]`.

The agent API executes actions in a thread pool inside the request, so `api` uses a transactional
database: the pool's own connections must see what the request committed. `api_db` is the faster
rolled-back kind, for requests that execute nothing inline. Each starts with no agent key throttled: the
throttle counts in the database (ledger.AgentThrottle), emptied between tests like every table.
"""
import pytest

from tests.api_support import Clients


@pytest.fixture
def api(transactional_db, tools, settings):
    """acme and globex with the sandbox tools in-process, and clients for every persona."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    return Clients(tools)


@pytest.fixture
def api_db(db, tools, settings):
    """Like `api`, on a rolled-back transaction: for tests whose requests execute nothing inline."""
    settings.UNWIND_THROTTLE_RATE = "100000/min"
    return Clients(tools)
