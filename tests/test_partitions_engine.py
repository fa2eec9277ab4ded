"""Issue 42 on PostgreSQL: the engine's one-call path touches only recent partitions.

A step's writes find the rows they end or check (its attempt, its run's newer checkpoint) by their partition key too,
bounded by the step's or the run's creation (ledger/engine/attempts.py `started_after`), so a ledger kept hot for
years costs a step what a new one does. A module of its own, among ENGINE_PATH_MODULES (tests/conftest.py): CI runs
it on the engine's functions and, in its third run, on the Python path.
"""
from __future__ import annotations

from django.db import connection

from ledger.db import partitions
from ledger.engine.proposal import action_propose
from ledger.engine.runs import run_complete
from ledger.engine.sweep import sweep
from tests.conftest import needs_postgres
from tests.helpers import act, fault, open_run
from tests.test_g05_crash_safety import short_lease, wait_for_lease
from tests.test_partitions import _old_months

pytestmark = needs_postgres


def _scans_of_old_months() -> dict[str, int]:
    """Scans (sequential and by index) this transaction made of the old months' partitions, by partition."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname, seq_scan + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables"
                       " WHERE relname LIKE %s ORDER BY relname", ["%\\_y2024m%"])
        return dict(cursor.fetchall())


def test_the_engines_writes_and_reads_of_a_whole_saga_touch_no_old_month(tools, django_capture_on_commit_callbacks):
    """Every statement of a saga that succeeds (a step retried, a step sent once: a tool that ignores keys, a step
    whose worker was lost, taken over by the sweep), one that fails and is unwound (a compensation retried) and a
    completion, as PostgreSQL's own counters of this transaction's scans see them (statements inside the functions
    included): not one scan of an old month."""
    _old_months()
    before = _scans_of_old_months()
    assert len(before) == 2 * len(partitions.PARTITIONED)
    run = open_run(tools, goal="Onboard")
    user = act(run, "hr.create_user", {"email": "o@x.io", "name": "O"})
    fault("licenses.provision", "status", status=503, times=1)
    assert act(run, "licenses.provision", {"user_id": user.result["id"]}).attempts == 2  # retried inline
    short_lease(tools, "travel.book_flight")  # its worker dies before calling it: the sweep takes it over
    lost = action_propose(run=run, tool_name="travel.book_flight", actor="agent:booker",
                          args={"passenger": "O", "flight": "LH1", "date": "2026-12-01"}).action
    wait_for_lease(lost)
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep()["reclaimed"] == 1
    lost.refresh_from_db()
    assert lost.status == "succeeded" and lost.attempts == 2
    act(run, "email.send", {"to": "o@home.example", "subject": "Welcome", "body": "Hi"})
    assert run_complete(run=run, actor="agent:booker").status == "completed"
    failing = open_run(tools, goal="Onboard, then fail")
    user = act(failing, "hr.create_user", {"email": "f@x.io", "name": "F"})
    act(failing, "licenses.provision", {"user_id": user.result["id"]})
    fault("licenses.revoke", "status", status=503, times=1)
    fault("travel.reserve_hotel", "status", status=422)
    act(failing, "travel.reserve_hotel", {"guest": "G", "hotel": "H", "nights": 1})
    failing.refresh_from_db()
    assert failing.status == "compensated"
    assert _scans_of_old_months() == before
