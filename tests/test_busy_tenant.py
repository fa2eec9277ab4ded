"""A busy tenant's saga reads what its run needs, not the tenant: an idempotency key is looked up on all three
columns of its unique index (tenant, key scope, key), and no statement of a saga, on either path, reads hundreds of
rows of the ledger's large tables.

The one-call proposal asked `key_agent = ANY (<scopes>)`, the Python path `key_agent = <agent> OR (key_agent = 0 AND
<the run is the agent's>)`. On a table whose statistics are older than its rows (a new database, or one that
autovacuum has not analyzed yet: every database of the benchmark), PostgreSQL kept the scope as a filter and read
every key of the tenant, on every proposal: 1 ms at 4,000 actions, growing with the tenant. Here a tenant holds
6,000 steps nobody analyzed, and the plans of both look-ups are read: PostgreSQL's own (auto_explain, sent to this
session as notices) for the statement inside `unwind_propose`, EXPLAIN for the Python path's."""
from __future__ import annotations

import re
from contextlib import contextmanager

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from ledger.models import Action
from tests.conftest import needs_postgres
from ledger.engine.runs import run_complete
from tests.helpers import act, fault, open_run

pytestmark = needs_postgres
INDEX = "idempotency_key_unique_per_agent"


@pytest.fixture
def busy_tenant(tools):
    """The tenant with 6,000 earlier steps in another run, 20,000 events in its chain, and no statistics newer than
    them."""
    first = act(open_run(tools, goal="earlier"), "hr.create_user", {"email": "e0@x.io", "name": "E"})
    with connection.cursor() as cursor:
        cursor.execute("SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_attribute a"
                       " WHERE a.attrelid = 'ledger_action'::regclass AND a.attnum > 0 AND NOT a.attisdropped"
                       " AND a.attname NOT IN ('id', 'seq', 'idempotency_key')")
        columns = cursor.fetchone()[0]
        cursor.execute(f"INSERT INTO ledger_action (seq, idempotency_key, {columns})"
                       f" SELECT 1000 + g, 'busy-' || g, {columns} FROM ledger_action, generate_series(1, 6000) g"
                       " WHERE id = %s", [first.pk])
        cursor.execute(  # not a chain that verifies: what the plans read only
            "INSERT INTO ledger_auditevent (seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash, hash,"
            " tenant_id, key_id) SELECT 1000000 + g, 'test.busy', 'test', %s, %s, '{}', now(), '', '', %s, ''"
            " FROM generate_series(1, 20000) g", [first.run_id, first.pk, first.tenant_id])
    assert Action.objects.filter(tenant=tools.acme).count() > 6000
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


BIG = ("ledger_action", "ledger_run", "ledger_auditevent", "ledger_attempt", "ledger_checkpoint")
NODE = re.compile(r"^\s*(?:->\s*)?(?P<node>[A-Z][A-Za-z ]+?)(?: using \S+)? on (?P<table>\w+)(?: \w+)?\s+"
                  r"(?:\(cost=[^)]*\)\s+)?\(actual rows=(?P<rows>\d+) loops=(?P<loops>\d+)\)")


@contextmanager
def plans_heard():
    """Every statement this session runs in the block, nested ones inside the engine's functions too, as PostgreSQL
    planned and ran it (auto_explain with ANALYZE, sent to this session as notices)."""
    heard = []

    def on_notice(notice):
        heard.append(notice.message_primary or "")

    raw = connection.connection
    raw.add_notice_handler(on_notice)
    with connection.cursor() as cursor:
        cursor.execute("LOAD 'auto_explain'")
        for name, value in (("log_min_duration", "0"), ("log_nested_statements", "on"), ("log_analyze", "on"),
                            ("log_timing", "off"), ("log_buffers", "on"), ("log_level", "notice"),
                            ("log_format", "text")):
            cursor.execute(f"SET auto_explain.{name} = {value}")
    try:
        yield heard
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET auto_explain.log_min_duration = -1")
        raw.remove_notice_handler(on_notice)


def wide_reads(plans: list[str], rows: int = 300, pages: int = 20) -> list[str]:
    """Each scan of a large table that read `rows` rows or more (returned and filtered out), or `pages` pages or more
    of it and its indexes (an index scan that checks a later column of the index inside it filters nothing out that
    EXPLAIN counts, but reads the pages): what grows with the tenant instead of the run."""
    found = []
    for plan in plans:
        lines = plan.splitlines()
        query = next((text for text in lines if "Query Text" in text), lines[0]).strip()[:160]
        for i, line in enumerate(lines):
            match = NODE.match(line)
            if not match or not match["table"].startswith(BIG) or "Scan" not in match["node"]:
                continue
            read, touched = int(match["rows"]) * int(match["loops"]), 0
            for detail in lines[i + 1:]:
                if "->" in detail or NODE.match(detail):
                    break
                removed = re.search(r"Rows Removed by (?:Filter|Index Recheck): (\d+)", detail)
                if removed:
                    read += int(removed.group(1))
                buffers = re.search(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?", detail)
                if buffers:
                    touched = int(buffers.group(1) or 0) + int(buffers.group(2) or 0)
            if read >= rows or touched >= pages:
                found.append(f"{line.strip()} [{read} rows, {touched} pages] in: {query}")
    return found


@pytest.mark.parametrize("fast_path", [True, False], ids=["functions", "python"])
def test_a_busy_tenants_saga_reads_its_run_not_the_tenant(busy_tenant, settings, fast_path):
    """Open, two steps, one that fails and unwinds the first two; then a run that completes. Every statement of them
    (and of the functions they call) reads fewer than 300 rows of the large tables, in a tenant with 6,000 steps and
    20,000 events nobody analyzed."""
    settings.UNWIND_FAST_PATH = fast_path
    with plans_heard() as plans:
        run = open_run(busy_tenant, goal="onboard")
        user = act(run, "hr.create_user", {"email": "b1@x.io", "name": "B"})
        act(run, "licenses.provision", {"user_id": user.result["id"]})
        fault("email.send", "status", status=504, times=0)
        act(run, "email.send", {"to": "b1@home.example", "subject": "Welcome", "body": "Hi"})
        done = open_run(busy_tenant, goal="completes")
        act(done, "hr.create_user", {"email": "b2@x.io", "name": "C"})
        run_complete(run=done, actor="agent:booker")
    run.refresh_from_db()
    done.refresh_from_db()
    assert (run.status, done.status) == ("compensated", "completed")
    assert len(plans) > 20
    assert not wide_reads(plans), "\n".join(wide_reads(plans))


def test_the_check_sees_a_read_of_the_whole_tenant(busy_tenant):
    """The check above can fail: a read of every step of the tenant is found."""
    with plans_heard() as plans, connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM ledger_action WHERE tenant_id = %s AND args_hash <> ''",
                       [busy_tenant.acme.pk])
    assert any("ledger_action" in read for read in wide_reads(plans))



def test_the_sweep_in_a_busy_tenant_reads_what_is_due(busy_tenant):
    """The worker's sweep (every few seconds, every tenant) reads what is due, not the ledger: in the busy tenant,
    with a run that unwound and one left running, no scan of it reads 300 rows or 20 pages."""
    from ledger.engine.sweep import sweep

    run = open_run(busy_tenant, goal="onboard")
    act(run, "hr.create_user", {"email": "s1@x.io", "name": "S"})
    open_run(busy_tenant, goal="left running")
    with plans_heard() as plans:
        sweep()
    assert any(re.search(r"Scan.* on ledger_action", plan) for plan in plans)
    assert not wide_reads(plans), "\n".join(wide_reads(plans))


def test_the_agent_api_in_a_busy_tenant_reads_its_run(busy_tenant, settings):
    """The agent's calls over the API around a step (open, read the run and the step, complete): the
    authentication and the selectors read what the call names, not the tenant. (The step itself is taken as the
    engine takes it; the tests above read its statements.)"""
    from django.test import Client

    from ledger.models import Run

    settings.UNWIND_FAST_PATH = True
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {busy_tenant.key}")
    with plans_heard() as plans:
        opened = agent.post("/api/v1/runs", {"goal": "api"}, content_type="application/json")
        assert opened.status_code == 201, opened.content
        run = Run.objects.get(pk=opened.json()["id"])
        step = act(run, "hr.create_user", {"email": "api@x.io", "name": "A"})
        assert agent.get(f"/api/v1/runs/{run.pk}").status_code == 200
        assert agent.get(f"/api/v1/actions/{step.pk}").status_code == 200
        done = agent.post(f"/api/v1/runs/{run.pk}/complete", {}, content_type="application/json")
        assert done.status_code == 200, done.content
    assert len(plans) > 10
    assert not wide_reads(plans), "\n".join(wide_reads(plans))


def test_a_limit_reads_its_run_and_its_first_minute_not_every_step_of_its_tool(busy_tenant):
    """A limit per run reads the run's steps, and a 24-hour limit per tenant the steps of its window's first partial
    minute (then running totals): neither reads every step of its tool. PostgreSQL had joined both reads with the
    index of the steps by tool, which holds all the tool's steps (0.9 ms a proposal at 20,000 of them, in
    bench/rules.py's busy tenant). Here the tool has 6,000 steps in another run, 20 of them in the window's first
    minute, and the count is the one both paths make (on the one call inside unwind_propose)."""
    from datetime import timedelta

    from ledger.policy import limits

    tenant = busy_tenant.acme
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(days=1)
    with connection.cursor() as cursor:  # 20 of the earlier steps fall 45 s into a minute a day ago
        cursor.execute("UPDATE ledger_action SET created_at = %s WHERE id IN (SELECT id FROM ledger_action"
                       " WHERE tenant_id = %s AND idempotency_key LIKE 'busy-%%' ORDER BY id LIMIT 20)",
                       [minute + timedelta(seconds=45), tenant.pk])
    run = open_run(busy_tenant, goal="limited")
    act(run, "hr.create_user", {"email": "l1@x.io", "name": "L"})
    policy = [{"per": "run", "count": 10**6}, {"per": "tenant", "count": 10**6, "window": 86400}]
    at = minute + timedelta(days=1, seconds=30)  # the window starts 30 s into that minute: its first part holds them
    limits.used_by(policy, tool_name="hr.create_user", run=run, now=at)  # the totals built, as a policy write does
    with plans_heard() as plans:
        used = limits.used_by(policy, tool_name="hr.create_user", run=run, now=at)
    assert used[0] == 1 and used[1] >= 20, used
    assert any("ledger_action" in plan and "run_id" in plan for plan in plans), "the run's count was not seen"
    assert not wide_reads(plans), "\n".join(wide_reads(plans))
