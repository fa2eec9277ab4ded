"""Issue 42 on PostgreSQL: audit events, attempts and checkpoints partitioned by month (ledger/db/partitions.py,
migration 0028).

What must hold: the migration converts a database that holds data (rows, ids, constraints and the audit chain kept);
every month's partition exists before its rows arrive, and a row that comes without one still lands (DEFAULT) and
moves to its month when that is made; an old month is detached only once nothing is left in it; the pages' and the
engine's reads of a run touch only the months since the run began; and the chain's sequence numbers stay unique
though the database's unique constraint now includes the month (the AuditHead lock is what serialises appends).
"""
from __future__ import annotations

import threading
import time
from datetime import date, datetime, timedelta, timezone as dt_timezone

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from ledger.audit.chain import ledger_transaction
from ledger.audit.verify import verify_chain
from ledger.db import partitions
from ledger.models import Action, AuditEvent, AuditHead, Checkpoint
from tests.conftest import needs_postgres
from tests.helpers import act, in_scratch_database, open_run
from tests.test_archive import signing  # noqa: F401 (a fixture: the archive's folder and signing key)
from tests.test_console_queue import client_for

pytestmark = needs_postgres
OLD = [date(2024, 1, 1), date(2024, 2, 1)]


def _partition_of(table: str, pk: int) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT tableoid::regclass::text FROM {table} WHERE id = %s", [pk])
        return cursor.fetchone()[0]


def _old_months():
    with transaction.atomic(), connection.cursor() as cursor:
        for table in partitions.PARTITIONED:
            for month in OLD:
                partitions.create_month(cursor, table, month)


def test_the_append_only_tables_are_partitioned_by_month_and_actions_are_not(tools):
    this_month = partitions.month_of(datetime.now(dt_timezone.utc))
    with connection.cursor() as cursor:
        for table in partitions.PARTITIONED:
            assert partitions.is_partitioned(cursor, table)
            months = [p.month for p in partitions.partitions(cursor, table)]
            assert months[-1] is None  # the DEFAULT partition
            ahead = settings.UNWIND_PARTITION_MONTHS_AHEAD
            assert [partitions.add_months(this_month, n) for n in range(ahead + 1)] == months[-ahead - 2:-1]
        assert not partitions.is_partitioned(cursor, "ledger_action")
    run = open_run(tools)
    step = act(run, "hr.create_user", {"email": "p@x.io", "name": "P"})
    month = partitions.partition_name
    assert _partition_of("ledger_auditevent", AuditEvent.objects.filter(action_ref=step.pk).first().pk) == \
        month("ledger_auditevent", this_month)
    assert _partition_of("ledger_attempt", step.attempt_set.get().pk) == month("ledger_attempt", this_month)


def test_a_month_without_a_partition_lands_in_default_and_moves_when_it_is_made(tools):
    run = open_run(tools)
    far = datetime.now(dt_timezone.utc).replace(day=15) + timedelta(days=31 * 14)
    checkpoint = Checkpoint.objects.create(tenant=tools.acme, run=run, label="later", state={})
    Checkpoint.objects.filter(pk=checkpoint.pk).update(created_at=far)
    assert _partition_of("ledger_checkpoint", checkpoint.pk) == "ledger_checkpoint_default"

    created = partitions.ensure(ahead=0, today=far.date())
    assert partitions.partition_name("ledger_checkpoint", partitions.month_of(far)) in created
    assert _partition_of("ledger_checkpoint", checkpoint.pk) == partitions.partition_name(
        "ledger_checkpoint", partitions.month_of(far))
    assert partitions.ensure(ahead=0, today=far.date()) == []  # made once


def test_the_sweep_makes_a_missing_month_and_checks_once_an_hour(tools):
    from ledger.engine.sweep import sweep

    coming = partitions.add_months(partitions.month_of(datetime.now(dt_timezone.utc)), 1)
    name = partitions.partition_name("ledger_auditevent", coming)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE ledger_auditevent DETACH PARTITION {name}")
        cursor.execute(f"DROP TABLE {name}")
    partitions._ensured_at[0] = None  # this process has not checked yet
    sweep()
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        assert cursor.fetchone()[0]
    with CaptureQueriesContext(connection) as captured:
        assert partitions.ensure_now_and_then() == []
    assert not captured.captured_queries  # checked a moment ago: not again within the hour


def test_detach_drops_only_old_months_left_empty(tools):
    _old_months()
    run = open_run(tools)
    kept = Checkpoint.objects.create(tenant=tools.acme, run=run, label="old", state={})
    Checkpoint.objects.filter(pk=kept.pk).update(created_at=datetime(2024, 2, 10, tzinfo=dt_timezone.utc))
    before = Checkpoint.objects.count(), AuditEvent.objects.count()

    done = {d.name: d for d in partitions.detach_before(date(2030, 1, 1))}

    assert done["ledger_checkpoint_y2024m01"].dropped and done["ledger_auditevent_y2024m01"].dropped
    assert not done["ledger_checkpoint_y2024m02"].dropped and "still holds rows" in done[
        "ledger_checkpoint_y2024m02"].why
    assert done["ledger_auditevent_y2024m02"].dropped
    this_month = partitions.month_of(datetime.now(dt_timezone.utc))
    assert not any(d.name.endswith(f"y{this_month.year}m{this_month.month:02d}") for d in done.values())
    with connection.cursor() as cursor:
        names = {p.name for table in partitions.PARTITIONED for p in partitions.partitions(cursor, table)}
        cursor.execute("SELECT to_regclass('ledger_auditevent_y2024m01')")
        assert cursor.fetchone()[0] is None  # dropped, not left behind detached
    assert "ledger_checkpoint_y2024m02" in names and "ledger_auditevent_y2024m01" not in names
    assert (Checkpoint.objects.count(), AuditEvent.objects.count()) == before
    assert verify_chain(tools.acme.pk).ok


@pytest.mark.django_db(transaction=True)
def test_a_table_that_stays_busy_is_named_and_left_for_the_next_pass(tools, signing, capsys, settings):
    """A writer that keeps a table locked past UNWIND_PARTITION_LOCK_TIMEOUT: that table's emptied months stay, named
    as busy (not as holding rows), and the other tables' go; the next pass takes the busy one's."""
    import psycopg

    settings.UNWIND_PARTITION_LOCK_TIMEOUT = 0.2
    _old_months()
    db = connection.settings_dict
    writer = psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"])
    try:
        writer.execute("LOCK TABLE ledger_checkpoint IN ROW EXCLUSIVE MODE")  # as a step writing its checkpoint
        call_command("archive")
    finally:
        writer.rollback()
        writer.close()
    said = capsys.readouterr().out
    assert "ledger_checkpoint stayed busy past UNWIND_PARTITION_LOCK_TIMEOUT" in said, said
    assert "still hold rows" not in said and "ledger_auditevent_y2024m01" in said, said

    def months_left():
        with connection.cursor() as cursor:
            return {p.name for table in partitions.PARTITIONED for p in partitions.partitions(cursor, table)}

    assert "ledger_checkpoint_y2024m01" in months_left() and "ledger_auditevent_y2024m01" not in months_left()
    call_command("archive")
    assert "ledger_checkpoint_y2024m01" not in months_left()


@pytest.mark.django_db(transaction=True)
def test_an_emptied_month_goes_while_steps_write_the_tables_its_rows_point_to(tools, settings):
    """Steps write actions and runs all the time. Dropping an emptied month must not wait for them: DETACH would make
    the partition's foreign keys its own, taking ledger_action's (and ledger_run's) lock to create their triggers,
    and crossed a step that held ledger_action and waited for ledger_attempt (the bench's saga beside an archive
    pass: attempts and checkpoints kept every emptied month, "busy")."""
    import psycopg

    settings.UNWIND_PARTITION_LOCK_TIMEOUT = 0.2
    _old_months()
    db = connection.settings_dict
    writer = psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"])
    try:
        writer.execute("LOCK TABLE ledger_action, ledger_run, ledger_tenant IN ROW EXCLUSIVE MODE")  # as a step
        done = {d.name: d for d in partitions.detach_before(date(2030, 1, 1))}
    finally:
        writer.rollback()
        writer.close()
    for table in partitions.PARTITIONED:
        assert done[f"{table}_y2024m01"].dropped, done


def test_the_archive_command_drops_the_months_it_left_empty(tools, signing, capsys):
    """`manage.py archive` ends by detaching and dropping the old months that hold no row any more (issue 42: old
    partitions are detached, never rewritten); one that still holds a row stays and is counted."""
    _old_months()
    run = open_run(tools)
    kept = Checkpoint.objects.create(tenant=tools.acme, run=run, label="old", state={})
    Checkpoint.objects.filter(pk=kept.pk).update(created_at=datetime(2024, 2, 10, tzinfo=dt_timezone.utc))

    call_command("archive")

    said = capsys.readouterr().out
    assert "ledger_auditevent_y2024m01" in said and "ledger_checkpoint_y2024m01" in said, said
    assert "1 older month(s) still hold rows" in said, said
    with connection.cursor() as cursor:
        names = {p.name for table in partitions.PARTITIONED for p in partitions.partitions(cursor, table)}
    assert "ledger_checkpoint_y2024m02" in names and "ledger_checkpoint_y2024m01" not in names
    assert Checkpoint.objects.filter(pk=kept.pk).exists()


def test_the_command_lists_creates_and_refuses_a_bad_month(tools, capsys):
    call_command("partitions", "--ensure")
    out = capsys.readouterr().out
    assert "created: none (all there)" in out and "ledger_auditevent_default\tdefault" in out
    with pytest.raises(Exception) as refused:
        call_command("partitions", "--detach-before", "last year")
    assert "YYYY-MM" in str(refused.value)


def _plans(sqls: list[str]) -> list[str]:
    plans = []
    with connection.cursor() as cursor:
        for text in sqls:
            if any(table in text for table in partitions.PARTITIONED):
                cursor.execute("EXPLAIN " + text)
                plans.append("\n".join(row[0] for row in cursor.fetchall()))
    return plans


def test_a_runs_page_and_the_engines_reads_touch_only_recent_partitions(tools):
    from ledger.api import selectors
    from ledger.audit import sealed
    from ledger.engine import attempts, moves

    _old_months()
    run = open_run(tools)
    step = act(run, "hr.create_user", {"email": "q@x.io", "name": "Q"})
    with CaptureQueriesContext(connection) as captured:
        assert client_for(tools.oscar).get(f"/console/runs/{run.pk}/").status_code == 200
        list(selectors.run_attempts(run)), list(selectors.run_events(run)), selectors.run_checkpoints(run)
        moves.retry_steps(run, list(run.actions.all()))
        list(attempts.attempts_that_may_have_acted(step))
        sealed.recorded_seal(Action.objects.get(pk=step.pk))
        with sealed.one_seal_read_per_unwind(run.pk):  # an unwind's one read of its run's seals
            sealed._seals_of_the_unwind(Action(run=run, compensates=step), step)
    plans = _plans([q["sql"] for q in captured.captured_queries])
    assert len(plans) >= 9
    this_month = partitions.month_of(datetime.now(dt_timezone.utc))
    for plan in plans:
        assert "y2024m" not in plan, plan
        assert f"y{this_month.year}m{this_month.month:02d}" in plan, plan
    # Unbounded, the same read scans every month: the bound is what prunes.
    unbounded = _plans([str(AuditEvent.objects.filter(run_ref=run.pk).query)])
    assert "y2024m01" in unbounded[0] and "y2024m02" in unbounded[0]


def test_a_steps_and_a_runs_events_are_found_by_their_own_index_in_a_busy_chain(tools):
    """An undo reads its step's success event (the undo seal), a run's page its events, each with the tenant. With an
    index on the reference alone, the planner ANDed it with the chain's (tenant, seq) index and read every event of
    the tenant in the months searched, once per undo: 0.25 ms at 5,600 events and growing with the chain (the unwind
    of nine, issue 40). The index on (run, tenant, seq) answers both conditions alone, and so does the one on (step,
    tenant), kept for events of a step only (issue 42: the busy events below, of no step, are not in it)."""
    from ledger.api import selectors
    from ledger.audit import sealed

    run = open_run(tools)
    step = act(run, "hr.create_user", {"email": "q@x.io", "name": "Q"})
    with connection.cursor() as cursor:  # a busy tenant's chain this month (not a chain that verifies: plans only)
        cursor.execute(
            "INSERT INTO ledger_auditevent (seq, kind, actor, run_ref, action_ref, data, created_at, prev_hash, hash,"
            " tenant_id, key_id) SELECT 1000000 + g, 'test.busy', 'test', NULL, NULL, '{}', now(), '', '', %s, ''"
            " FROM generate_series(1, 20000) g", [run.tenant_id])
    with CaptureQueriesContext(connection) as captured:
        sealed.recorded_undo_seal(Action.objects.get(pk=step.pk))
        list(selectors.run_events(run))
        with sealed.one_seal_read_per_unwind(run.pk):  # an unwind's one read of its run's seals
            undo = Action(run=run, compensates=step)
            assert sealed._seals_of_the_unwind(undo, step)
    plans = _plans([q["sql"] for q in captured.captured_queries if "ledger_auditevent" in q["sql"]])
    assert len(plans) == 3
    for plan, index in zip(plans, ("_action_ref_tenant_id_idx", "_run_ref_tenant_id_seq_idx",
                                   "_run_ref_tenant_id_seq_idx")):
        assert "tenant_id_seq_created_at" not in plan, plan
        assert index in plan, plan


def _append(tenant_id: int, errors: list):
    try:
        with ledger_transaction(tenant_id) as log:
            time.sleep(0.2)  # every append overlaps the others in time
            log.record("test.append", actor="test")
    except Exception as exc:  # noqa: BLE001 (reported by the test)
        errors.append(exc)
    finally:
        connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_never_share_a_sequence_number(world):
    """(tenant, seq) is unique in the database only with the month (PostgreSQL requires the partition key in every
    unique constraint): the AuditHead row lock that `ledger_transaction` takes first is what keeps two writers from
    taking the same number, and `verify_chain` names a duplicate that got in behind the services' back."""
    tenant = world.acme.pk
    first = AuditHead.objects.get(pk=tenant).seq
    errors: list = []
    threads = [threading.Thread(target=_append, args=(tenant, errors)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    seqs = sorted(AuditEvent.objects.filter(tenant_id=tenant, kind="test.append").values_list("seq", flat=True))
    assert seqs == list(range(first + 1, first + 7))
    assert verify_chain(tenant).ok

    # The database alone would take a second event #n in another month: the chain's walk names it.
    event = AuditEvent.objects.filter(tenant_id=tenant, kind="test.append").order_by("seq").first()
    AuditEvent.objects.create(tenant_id=tenant, seq=event.seq, kind=event.kind, actor=event.actor, data=event.data,
                              created_at=event.created_at + timedelta(days=62), prev_hash=event.prev_hash,
                              hash=event.hash, key_id=event.key_id)
    assert not verify_chain(tenant).ok


_CONVERT = """
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from bench import years
from bench.engine import Saga, tenant_with_tools
from ledger.audit.verify import verify_chain
from ledger.db import partitions
from ledger.models import Action, Attempt, AuditEvent, Checkpoint

executor = MigrationExecutor(connection)
graph = executor.loader.graph
target = ("ledger", "0028_partitions")
before = [parent for parent in graph.node_map[target].parents]
others = [leaf for leaf in graph.leaf_nodes() if leaf[0] != "ledger" and target not in graph.forwards_plan(leaf)]
executor.migrate(before + others)
with connection.cursor() as cursor:  # the hashes as this code writes them (0032), for the saga below to run
    cursor.execute("ALTER TABLE ledger_auditevent ALTER COLUMN prev_hash TYPE bytea USING decode(prev_hash, 'hex'),"
                   " ALTER COLUMN hash TYPE bytea USING decode(hash, 'hex')")
tenant, agent, _ = tenant_with_tools("convert")
Saga(tenant, agent).onboard(0, False)
years.load(tenant, 600, months=4)

def state():
    with connection.cursor() as cursor:
        out = {}
        for table in partitions.PARTITIONED:
            cursor.execute(f"SELECT count(*), coalesce(sum(id), 0), max(id) FROM {table}")
            out[table] = [int(v) for v in cursor.fetchone()]
            cursor.execute(f"SELECT count(DISTINCT id), (SELECT last_value FROM {table}_id_seq) FROM {table}")
            out[table + ":ids"] = [int(v) for v in cursor.fetchone()]
            cursor.execute("SELECT conname, contype FROM pg_constraint WHERE conrelid = to_regclass(%s)"
                           " ORDER BY conname", [table])
            out[table + ":constraints"] = cursor.fetchall()
            out[table + ":partitioned"] = partitions.is_partitioned(cursor, table)
            out[table + ":months"] = [str(p.month) for p in partitions.partitions(cursor, table)] \\
                if out[table + ":partitioned"] else []
    out["verify"] = verify_chain(tenant.pk).ok
    return out

old = state()
call_command("migrate", verbosity=0)
new = state()
Saga(tenant, agent).onboard(1, False)
after = state()
print(json.dumps({"old": old, "new": new, "after": after}))
"""


@pytest.mark.django_db(transaction=True)
def test_the_migration_converts_a_database_that_holds_data():
    """A fresh database migrated to just before 0028, filled with four months of runs (bench/years.py: steps,
    attempts, checkpoints and a chain that verifies), then migrated: the same rows, ids and constraints (checks kept, unique ones
    now with the month), one partition per month, the chain still verifying, and new steps numbered on."""
    found = in_scratch_database(_CONVERT, "convert")
    old, new, after = found["old"], found["new"], found["after"]
    assert old["verify"] and new["verify"] and after["verify"]
    for table, key in partitions.PARTITIONED.items():
        assert not old[table + ":partitioned"] and new[table + ":partitioned"]
        assert old[table][0] > 100 and new[table] == old[table]  # every row, with its id
        assert len(new[table + ":months"]) >= 6  # four months back, this one and ahead, then the DEFAULT
        assert new[table + ":months"][-1] == "None"
        # Ids go on from where they were: the sequence is past every old id, and none is taken twice. (A new row's
        # id may still be below the old maximum: the engine draws a run's next checkpoint id ahead, before 0028.)
        assert new[table + ":ids"][1] >= old[table][2], (table, old, new)
        assert after[table][0] > old[table][0] and after[table + ":ids"][0] == after[table][0], (table, after)
        assert {n for n, _ in new[table + ":constraints"]} == {n for n, _ in old[table + ":constraints"]}


def test_the_years_bench_counts_plain_and_partitioned_tables(tools):
    from bench import years

    run = open_run(tools)
    act(run, "hr.create_user", {"email": "y@x.io", "name": "Y"})
    found = years.sizes(1)["bytes"]
    assert set(found) == set(years.TABLES) and all(size > 0 for size in found.values()), found

