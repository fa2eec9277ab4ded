"""Issue 27: the engine's PostgreSQL functions live in files (ledger/engine/plpgsql/*.sql), installed by `migrate`.

A database migrated from nothing and one that ran the old migrations first end with the same definitions, the files';
a file changed and `migrate` run again installs it; whatever the database holds that is not the files' (another
body, another argument list, a function without a file) is replaced or dropped, and until then the fast path's
guard refuses the functions (tests/test_fastpath.py: a function edited in the database is never called).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from ledger.db import sql
from ledger.engine import fastpath, plpgsql
from tests.conftest import needs_postgres

ROOT = Path(__file__).resolve().parent.parent
# What migrations 0010 to 0016 left in a database deployed before the files (issue 27), frozen here since issue 40
# took that text out of the migrations: a database of then is one at 0016 with these functions.
AT_0016 = {name: plpgsql.parse(name, text)
           for name, text in json.loads((ROOT / "tests/data/plpgsql_at_0016.json").read_text()).items()}

# Every engine function as PostgreSQL would recreate it, with its settings.
DEFINITIONS = (
    "SELECT p.proname, pg_catalog.pg_get_functiondef(p.oid), pg_catalog.array_to_string(p.proconfig, ',')"
    " FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'public'::regnamespace"
    " AND p.proname >= 'unwind_' AND p.proname < 'unwind`'"
    " ORDER BY p.proname, p.oid"
)


def definitions(cursor) -> list[tuple]:
    cursor.execute(DEFINITIONS)
    return cursor.fetchall()


def installed_fingerprint() -> str:
    return sql.fetch_one(fastpath.TRUST, [])[0]


def edited(tmp_path: Path, name: str, before: str, after: str) -> dict:
    """A copy of the files with `before` replaced by `after` in `name`'s."""
    folder = tmp_path / "plpgsql"
    shutil.copytree(plpgsql.FOLDER, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = folder / f"{name}.sql"
    text = path.read_text()
    assert text.count(before) == 1
    path.write_text(text.replace(before, after))
    return plpgsql.functions(folder)


# --- a fresh database and an upgraded one ----------------------------------------------------------------------

def _scratch_url(name: str) -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{name}"


def _manage(url: str, *args) -> None:
    env = {**os.environ, "DATABASE_URL": url, "UNWIND_INSECURE_DEV_KEY": "1"}
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


def _install(url: str, wanted: dict) -> None:
    """Create `wanted`'s functions in the database at `url` (one that holds none)."""
    with psycopg.connect(url) as db:
        for function in wanted.values():
            db.execute(function.text)  # no parameters: the bodies hold "%"


@pytest.fixture
def scratch_databases():
    """Two empty databases beside the test database, dropped afterwards."""
    base = connection.settings_dict["NAME"]
    names = [f"{base}_fresh", f"{base}_upgraded"]
    admin = _scratch_url("postgres")
    with psycopg.connect(admin, autocommit=True) as server:
        for name in names:
            server.execute(f'DROP DATABASE IF EXISTS "{name}"')
            server.execute(f'CREATE DATABASE "{name}"')
    try:
        yield [_scratch_url(name) for name in names]
    finally:
        with psycopg.connect(admin, autocommit=True) as server:
            for name in names:
                server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# Issue 28: the limits counted in the proposal's call, and the running totals per agent and per tenant they read.
# Issue 40: the chain's one append (0010 to 0013 had one of that name, which 0014 dropped), and the run's guards
# the writers compare, once (the run as decided from, its steps). And a step's outcome, one writer for its success
# and its failure (0016's `unwind_succeed` and `unwind_failed`, whose files are gone: the upgrade drops them).
ADDED_SINCE_0016 = ["unwind_chain_append", "unwind_limit_bucket", "unwind_limit_measure", "unwind_limit_share",
                    "unwind_limit_totals_forget", "unwind_limit_totals_keep", "unwind_limits_used", "unwind_outcome",
                    "unwind_run_held", "unwind_run_steps"]


@needs_postgres
@pytest.mark.slow
def test_a_fresh_database_and_an_upgraded_one_end_with_the_files_definitions(scratch_databases):
    fresh, upgraded = scratch_databases
    _manage(fresh, "migrate", "--noinput")
    _manage(upgraded, "migrate", "--noinput", "ledger", "0016")  # as a database deployed before the files
    with psycopg.connect(upgraded) as db:
        assert definitions(db.cursor()) == []  # the migrations before 0017 install no function any more
    _install(upgraded, AT_0016)  # what they installed then
    with psycopg.connect(upgraded) as db:
        before = definitions(db.cursor())
    _manage(upgraded, "migrate", "--noinput")

    with psycopg.connect(fresh) as a, psycopg.connect(upgraded) as b:
        ends = definitions(a.cursor()), definitions(b.cursor())
        fingerprints = [db.execute(fastpath.TRUST).fetchone()[0] for db in (a, b)]
    assert ends[0] == ends[1]
    assert [name for name, *_ in ends[0]] == sorted(plpgsql.functions())  # each once: no other argument list
    assert fingerprints == [plpgsql.expected_fingerprint()] * 2
    # 0016 installed the same functions but those added since, which the upgrade installs from their files.
    assert sorted({name for name, *_ in ends[0]} - {name for name, *_ in before}) == ADDED_SINCE_0016

    _manage(fresh, "migrate", "--noinput", "ledger", "0016")  # back past 0017: no engine function left
    with psycopg.connect(fresh) as db:
        assert definitions(db.cursor()) == []


@needs_postgres
def test_the_files_fingerprint_is_what_the_migrated_database_holds(db):
    """What `migrate` left in the test database is exactly the files: the guard's fingerprint of pg_proc is theirs,
    and installing again changes nothing."""
    assert installed_fingerprint() == plpgsql.expected_fingerprint()
    assert plpgsql.install(connection) == []


# --- a file changed, then installed --------------------------------------------------------------------------------

@needs_postgres
def test_a_changed_file_is_installed_by_migrate_and_only_then_trusted(db, tmp_path, monkeypatch):
    """A function's file is edited (here: a comment in `unwind_outcome`'s body); `migrate`, with no migration to
    run, installs it. The fingerprint the guard reads from pg_proc is then the edited files', not what this process
    was started with: the fast path refuses them until the process runs with the same files."""
    changed = edited(tmp_path, "unwind_outcome", "BEGIN\n", "BEGIN\n    -- edited in its file\n")
    monkeypatch.setattr(plpgsql, "FOLDER", tmp_path / "plpgsql")
    with connection.cursor() as cursor:
        before = dict((name, text) for name, text, _ in definitions(cursor))

    call_command("migrate", verbosity=0)  # nothing to migrate: the post_migrate step installs the file

    with connection.cursor() as cursor:
        after = dict((name, text) for name, text, _ in definitions(cursor))
    assert "-- edited in its file" in after["unwind_outcome"] and after["unwind_outcome"] != before["unwind_outcome"]
    assert {name for name in after if after[name] != before[name]} == {"unwind_outcome"}
    assert installed_fingerprint() == plpgsql.fingerprint(changed) != plpgsql.expected_fingerprint()
    fastpath._trusted.pop(connection.connection, None)
    assert fastpath._trust(connection) is None  # this process's files are not what the database holds

    monkeypatch.undo()
    assert plpgsql.install(connection) == ["unwind_outcome"]  # the files again
    assert installed_fingerprint() == plpgsql.expected_fingerprint()
    assert fastpath._trust(connection) is not None
    fastpath._trusted.pop(connection.connection, None)  # checked rows the test's rollback takes away


@needs_postgres
def test_a_changed_setting_is_installed(db, tmp_path):
    changed = edited(tmp_path, "unwind_outcome", "SET plan_cache_mode = force_generic_plan",
                     "SET plan_cache_mode = force_custom_plan")
    assert plpgsql.install(connection, changed) == ["unwind_outcome"]
    assert sql.fetch_one("SELECT array_to_string(proconfig, ',') FROM pg_proc WHERE proname = 'unwind_outcome'",
                         []) == ("plan_cache_mode=force_custom_plan",)
    assert installed_fingerprint() == plpgsql.fingerprint(changed)


@needs_postgres
def test_a_file_that_changes_the_arguments_replaces_the_function(db, tmp_path):
    """CREATE OR REPLACE alone would add a second `unwind_chain_hashes` beside the old one (another argument list),
    and the guard, which fingerprints every one, would never trust the functions again."""
    changed = edited(tmp_path, "unwind_chain_hashes", "p_events jsonb\n", "p_events jsonb, p_step integer DEFAULT 1\n")
    text = changed["unwind_chain_hashes"].text.replace("p_seq := p_seq + 1;", "p_seq := p_seq + p_step;")
    changed["unwind_chain_hashes"] = plpgsql.parse("unwind_chain_hashes", text)
    assert plpgsql.install(connection, changed) == ["unwind_chain_hashes"]
    assert sql.fetch_one("SELECT count(*), max(pronargs) FROM pg_proc WHERE proname = 'unwind_chain_hashes'",
                         []) == (1, 6)
    assert installed_fingerprint() == plpgsql.fingerprint(changed)


@needs_postgres
def test_migrate_replaces_a_completion_that_took_status_lists(db):
    """Issue 40 changed `unwind_complete`'s arguments: it is handed the plan Python decided and its guards, no longer
    the status lists it sorted the run's steps by. A database holding the old one (as 0016 left it) ends, after
    `migrate`, with the file's alone, and the guard trusts the functions again."""
    args = "SELECT pg_catalog.pg_get_function_identity_arguments(oid) FROM pg_proc WHERE proname = 'unwind_complete'"
    with connection.cursor() as cursor:
        cursor.execute(f"DROP FUNCTION public.unwind_complete({sql.fetch_one(args, [])[0]})")
        cursor.execute(AT_0016["unwind_complete"].text)
    assert "p_busy text[]" in sql.fetch_one(args, [])[0]
    assert installed_fingerprint() != plpgsql.expected_fingerprint()
    call_command("migrate", verbosity=0)  # nothing to migrate: the post_migrate step installs the file
    (found,), = sql.fetch_all(args, [])  # one argument list: the file's
    assert "p_steps jsonb" in found and "text[]" not in found
    assert installed_fingerprint() == plpgsql.expected_fingerprint()


@needs_postgres
def test_migrate_drops_the_two_outcome_writers_a_file_no_longer_defines(db):
    """A step's success and its failure were written by two functions, `unwind_succeed` and `unwind_failed` (0016's
    decided whether the run still takes steps; issue 40's were handed the plan); one writes both now,
    `unwind_outcome`, and their files are gone. A database that holds them (here: as 0016 left them) ends, after
    `migrate`, without them, `unwind_outcome` once, and the guard trusts the functions again."""
    names = "SELECT proname FROM pg_proc WHERE proname IN ('unwind_succeed', 'unwind_failed', 'unwind_outcome')"
    with connection.cursor() as cursor:
        for old in ("unwind_succeed", "unwind_failed"):
            cursor.execute(AT_0016[old].text)
    assert sorted(sql.fetch_all(names, [])) == [("unwind_failed",), ("unwind_outcome",), ("unwind_succeed",)]
    assert installed_fingerprint() != plpgsql.expected_fingerprint()
    call_command("migrate", verbosity=0)  # nothing to migrate: the post_migrate step drops what has no file
    assert sql.fetch_all(names, []) == [("unwind_outcome",)]
    assert installed_fingerprint() == plpgsql.expected_fingerprint()


@needs_postgres
def test_a_triggers_changed_function_is_replaced_and_its_triggers_stay(db, tmp_path):
    """Dropping a trigger's function would fail (or, with CASCADE, drop the trigger that keeps the limits' totals):
    an edited `unwind_limit_totals_keep` is replaced in place, and its triggers call the new body."""
    changed = edited(tmp_path, "unwind_limit_totals_keep", "BEGIN\n", "BEGIN\n    -- edited in its file\n")
    assert changed["unwind_limit_totals_keep"].trigger and not changed["unwind_outcome"].trigger
    triggers = "SELECT count(*) FROM pg_trigger WHERE tgfoid = 'public.unwind_limit_totals_keep'::regproc"
    assert sql.fetch_one(triggers, []) == (3,)  # insert, update (0022) and delete (0029)
    assert plpgsql.install(connection, changed) == ["unwind_limit_totals_keep"]
    assert sql.fetch_one(triggers, []) == (3,)  # insert, update (0022) and delete (0029)
    assert "-- edited in its file" in sql.fetch_one(
        "SELECT prosrc FROM pg_proc WHERE proname = 'unwind_limit_totals_keep'", [])[0]
    assert installed_fingerprint() == plpgsql.fingerprint(changed)


@needs_postgres
def test_what_has_no_file_is_dropped(db):
    """A function named like the engine's that no file defines (planted, or one a file no longer holds), and a second
    argument list of one that a file defines: both dropped, the file's own left alone."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE FUNCTION public.unwind_planted() RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$")
        cursor.execute("CREATE FUNCTION public.unwind_outcome(integer) RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$")
    assert installed_fingerprint() != plpgsql.expected_fingerprint()
    assert plpgsql.install(connection) == ["unwind_outcome", "unwind_planted"]
    assert installed_fingerprint() == plpgsql.expected_fingerprint()
    assert sql.fetch_one("SELECT count(*) FROM pg_proc WHERE proname IN ('unwind_planted', 'unwind_outcome')",
                         []) == (1,)


def test_each_file_defines_the_function_it_is_named_for(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    text = (plpgsql.FOLDER / "unwind_outcome.sql").read_text()
    (folder / "unwind_other.sql").write_text(text)
    with pytest.raises(ValueError, match="unwind_other"):
        plpgsql.functions(folder)
    (folder / "unwind_other.sql").unlink()
    (folder / "unwind_outcome.sql").write_text(text.replace("SET plan_cache_mode = force_generic_plan",
                                                           "SET plan_cache_mode TO 'force_generic_plan'"))
    with pytest.raises(ValueError, match="SET"):
        plpgsql.functions(folder)
