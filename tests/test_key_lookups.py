"""An idempotency key is looked up on all three columns of its unique index (tenant, key scope, key), on both paths.

The one-call proposal asked `key_agent = ANY (<scopes>)`, the Python path `key_agent = <agent> OR (key_agent = 0 AND
<the run is the agent's>)`. On a table whose statistics are older than its rows (a new database, or one that
autovacuum has not analyzed yet: every database of the benchmark), PostgreSQL kept the scope as a filter and read
every key of the tenant, on every proposal: 1 ms at 4,000 actions, growing with the tenant. Here a tenant holds
3,000 steps nobody analyzed, and the plans of both look-ups are read: PostgreSQL's own (auto_explain, sent to this
session as notices) for the statement inside `unwind_propose`, EXPLAIN for the Python path's."""
from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from ledger.models import Action
from tests.conftest import needs_postgres
from tests.helpers import act, open_run

pytestmark = needs_postgres
INDEX = "idempotency_key_unique_per_agent"


@pytest.fixture
def busy_tenant(tools):
    """The tenant with 3,000 earlier steps in another run, and no statistics newer than them."""
    first = act(open_run(tools, goal="earlier"), "hr.create_user", {"email": "e0@x.io", "name": "E"})
    with connection.cursor() as cursor:
        cursor.execute("SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_attribute a"
                       " WHERE a.attrelid = 'ledger_action'::regclass AND a.attnum > 0 AND NOT a.attisdropped"
                       " AND a.attname NOT IN ('id', 'seq', 'idempotency_key')")
        columns = cursor.fetchone()[0]
        cursor.execute(f"INSERT INTO ledger_action (seq, idempotency_key, {columns})"
                       f" SELECT 1000 + g, 'busy-' || g, {columns} FROM ledger_action, generate_series(1, 3000) g"
                       " WHERE id = %s", [first.pk])
    assert Action.objects.filter(tenant=tools.acme).count() > 3000
    return tools


def index_scans(plan: str) -> list[str]:
    """The conditions of each scan of the key's index in a plan: its Index Cond line and any Filter after it."""
    found = []
    for match in re.finditer(rf"Scan(?: Backward)? using {INDEX} on ledger_action.*?\n((?:\s+(?:Index Cond|Filter)"
                             r":.*\n?)+)", plan):
        found.append(match.group(1))
    return found


def assert_whole_key(conditions: list[str]) -> None:
    assert conditions, "the key's index was not used"
    for condition in conditions:
        index_cond = next(line for line in condition.splitlines() if "Index Cond" in line)
        assert "key_agent" in index_cond and "idempotency_key" in index_cond, condition


def test_the_one_call_looks_the_key_up_on_the_whole_index(busy_tenant, settings):
    settings.UNWIND_FAST_PATH = True
    run = open_run(busy_tenant)
    notices = []
    raw = connection.connection  # the psycopg connection under Django's
    def heard(notice):
        notices.append(notice.message_primary or "")

    raw.add_notice_handler(heard)
    try:
        with connection.cursor() as cursor:
            cursor.execute("LOAD 'auto_explain'")
            for name, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                                ("log_level", "notice"), ("log_format", "text")):
                cursor.execute(f"SET auto_explain.{name} = {value}")
        step = act(run, "hr.create_user", {"email": "new@x.io", "name": "N"})
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET auto_explain.log_min_duration = -1")
        raw.remove_notice_handler(heard)
    assert step.status == "succeeded"
    lookups = [n for n in notices if "idempotency_key" in n and "unwind_propose" not in n.split("\n", 1)[0]
               and INDEX in n]
    assert lookups, "no plan of the key's look-up was seen"
    assert_whole_key([c for plan in lookups for c in index_scans(plan)])


def test_the_python_path_looks_the_key_up_on_the_whole_index(busy_tenant, settings):
    settings.UNWIND_FAST_PATH = False
    run = open_run(busy_tenant)
    with CaptureQueriesContext(connection) as captured:
        act(run, "hr.create_user", {"email": "new@x.io", "name": "N"})
    lookups = [q["sql"] for q in captured.captured_queries
               if q["sql"].lstrip().upper().startswith("SELECT") and "idempotency_key" in q["sql"]
               and "ledger_action" in q["sql"]]
    assert lookups
    conditions = []
    with connection.cursor() as cursor:
        for text in lookups:
            cursor.execute("EXPLAIN " + text)
            conditions += index_scans("\n".join(row[0] for row in cursor.fetchall()) + "\n")
    assert_whole_key(conditions)
