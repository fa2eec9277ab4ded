"""The agent-key throttle (ledger/api/throttle.py): a GCRA in the database, the same for every web process.

The decision at its edges, on the database the suite runs on (a burst of N, then one per interval; refused requests
move nothing; a clock a little behind), and the real thing: two gunicorn servers on one database, one key's requests
spread over both (and sent at once), counted as one.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.db import connection, transaction

from ledger.api.throttle import AgentKeyThrottle
from ledger.models import Agent, AgentThrottle
from ledger.tenancy import agent_create
from tests.live_processes import Served

pytest_plugins = ["tests.api_fixtures"]


class _Keyed:
    """A request as the throttle reads it: an agent's key."""

    def __init__(self, prefix: str):
        self.auth = Agent(key_prefix=prefix)


def _ask(at: float, key: str = "k1") -> tuple[bool, float | None]:
    """(let through, seconds to wait if not) for `key`'s request at `at` (seconds), a fresh throttle as per request."""
    throttle = AgentKeyThrottle()
    throttle.timer = lambda: at
    allowed = throttle.allow_request(_Keyed(key), None)
    return allowed, None if allowed else throttle.wait()


def _tat(key: str = "k1") -> int:
    return AgentThrottle.objects.get(key=key).tat


@pytest.fixture
def ten_a_minute(db, settings):
    settings.UNWIND_THROTTLE_RATE = "10/min"  # one every 6 s after a burst of 10


def test_a_key_makes_a_burst_of_n_then_one_each_interval(ten_a_minute):
    assert [_ask(1_000.0)[0] for _ in range(10)] == [True] * 10
    assert _ask(1_000.0) == (False, pytest.approx(6.0))
    assert _ask(1_005.999_999) == (False, pytest.approx(1e-6))
    assert _ask(1_006.0) == (True, None)
    assert _ask(1_006.0) == (False, pytest.approx(6.0))
    assert _ask(1_012.0) == (True, None)
    assert _ask(1_013.0) == (False, pytest.approx(5.0))


def test_refused_requests_do_not_move_it_on(ten_a_minute):
    for _ in range(10):
        _ask(1_000.0)
    full = _tat()
    assert [_ask(1_000.0 + n / 10)[0] for n in range(60)] == [False] * 60  # hammering for 6 s
    assert _tat() == full
    assert _ask(1_006.0)[0]


def test_an_idle_key_gets_one_burst_and_no_more(ten_a_minute):
    for _ in range(10):
        _ask(1_000.0)
    # An hour later: the key's time has long passed, and counts from now, not from an hour ago.
    assert [_ask(4_600.0)[0] for _ in range(11)] == [True] * 10 + [False]


def test_a_clock_a_little_behind_waits_a_little_longer(ten_a_minute):
    """Another machine's clock half a second behind: its request is refused for half a second more, and a request
    let through never moves the key's time back."""
    for _ in range(10):
        _ask(1_000.0)
    assert _ask(999.5) == (False, pytest.approx(6.5))
    assert _ask(1_006.0)[0]
    assert _ask(1_005.5) == (False, pytest.approx(6.5))
    # A fresh key first seen by a clock behind, then by one ahead: the burst is still ten.
    assert [_ask(999.5, "k2")[0] for _ in range(5)] + [_ask(1_000.0, "k2")[0] for _ in range(6)] == [True] * 10 + [False]


def test_keys_count_apart(ten_a_minute):
    for _ in range(10):
        _ask(1_000.0)
    assert not _ask(1_000.0)[0]
    assert [_ask(1_000.0, "k2")[0] for _ in range(10)] == [True] * 10


@pytest.mark.parametrize("rate", ["7/min", "3/s", "600/min", "1000/s"])
def test_the_burst_is_exactly_n_at_any_rate(db, settings, rate):
    """Whole microseconds compare exactly, even where D/N is no round number (7/min: 8.571429 s)."""
    settings.UNWIND_THROTTLE_RATE = rate
    burst = int(rate.split("/")[0])
    assert [_ask(1_000.0)[0] for _ in range(burst + 1)] == [True] * burst + [False]


def test_after_the_burst_the_rate_holds(db, settings):
    """3/s, a request every millisecond for three seconds after a burst: one each third of a second gets through."""
    settings.UNWIND_THROTTLE_RATE = "3/s"
    assert sum(_ask(1_000.0)[0] for _ in range(3)) == 3
    assert sum(_ask(1_000.0 + n / 1_000)[0] for n in range(1, 3_001)) == 9


def test_a_rate_of_zero_refuses_every_agent_request(db, settings):
    settings.UNWIND_THROTTLE_RATE = "0/min"
    assert _ask(1_000.0) == (False, 60.0)
    assert not AgentThrottle.objects.exists()


def test_the_throttle_will_not_run_inside_a_transaction(ten_a_minute):
    """Inside one, the key's row would stay locked until it ended, and every process's requests of the key with it."""
    with transaction.atomic(), pytest.raises(RuntimeError, match="autocommit"):
        _ask(1_000.0)


def test_atomic_requests_would_hold_the_row_for_the_request_and_is_refused(api_db, monkeypatch):
    assert not connection.settings_dict.get("ATOMIC_REQUESTS")  # production's settings: the request is not a transaction
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    with pytest.raises(RuntimeError, match="ATOMIC_REQUESTS"):
        api_db.agent.get("/api/v1/tools")


# --- two servers on one database -----------------------------------------------------------------------------

RATE = 10


@pytest.fixture
def two_servers(api, tmp_path):
    """Two gunicorn servers, two workers each, on the test database, at RATE a minute per agent key."""
    servers = [Served("gunicorn", tmp_path / f"gunicorn-{n}.log", workers=2, UNWIND_THROTTLE_RATE=f"{RATE}/min")
               for n in range(2)]
    try:
        for server in servers:
            server.start()
        yield api.world, servers
    finally:
        for server in servers:
            server.stop()


def _get(url: str, key: str) -> requests.Response:
    return requests.get(f"{url}/api/v1/tools", headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.slow
def test_two_servers_count_one_key_as_one(two_servers):
    world, (first, second) = two_servers
    _, sprayed = agent_create(tenant=world.acme, name="sprayer")
    started = time.monotonic()
    answers = [_get((first, second)[n % 2].url, world.key) for n in range(RATE + 1)]
    assert [a.status_code for a in answers] == [200] * RATE + [429]
    assert time.monotonic() - started < 60 / RATE  # no interval passed meanwhile: the 11th was over the burst
    refused = answers[-1]
    assert refused.json()["code"] == "throttled" and 1 <= int(refused.headers["Retry-After"]) <= 60 // RATE
    # The budget is the key's on every server and on MCP too; another key's is its own.
    mcp = requests.post(f"{second.url}/mcp", headers={"Authorization": f"Bearer {world.key}"}, json={}, timeout=30)
    assert mcp.status_code == 429 and int(mcp.headers["Retry-After"]) >= 1
    assert [_get(server.url, world.other_key).status_code for server in (first, second)] == [200, 200]

    # A fresh key's requests sent all at once, over both servers and their four processes: exactly RATE get through.
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda n: _get((first, second)[n % 2].url, sprayed).status_code, range(3 * RATE)))
    assert sorted(statuses) == [200] * RATE + [429] * (2 * RATE)
    for server in (first, second):
        log = server.log.read_text()
        assert "Traceback" not in log and "Internal Server Error" not in log, log[-3000:]
