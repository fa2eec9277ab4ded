"""Loaded with `-p tests.pytest_env` (pyproject) before pytest-django reads the settings.

Background tasks run inline after commit in tests; the crash tests start real workers with this
turned off in their own environment. The tests run on the public development key, asked for by name; the
processes they start (web servers, workers, commands) inherit it with the rest of this environment.
"""
import os

os.environ.setdefault("UNWIND_TASKS_SYNC", "1")
os.environ.setdefault("UNWIND_INSECURE_DEV_KEY", "1")
os.environ.setdefault("UNWIND_SANDBOX", "1")
# An undo or a never-sent step is retried for minutes before a person is asked (UNWIND_RETRY_PATIENCE): the tests of
# that wait ask for it (tests/test_retry_patience.py); every other test sees a failing tool's attempts end at once.
os.environ.setdefault("UNWIND_RETRY_PATIENCE", "0")


def pytest_configure(config):
    """A transactional test's database is emptied with DELETE, not TRUNCATE, on PostgreSQL.

    pytest-django empties every table after each test that commits (`transactional_db`, a live server); Django
    does it with one TRUNCATE of all of them, which PostgreSQL pays for with new files for each table: about
    0.3 s a test here, 160 s of a 13-minute suite. The tables hold a few rows by then, and every foreign key
    Django makes on PostgreSQL is deferred to the commit, so one DELETE per table in the flush's transaction
    empties them in any order, in milliseconds. Flushes that reset sequences or cascade keep Django's TRUNCATE.
    """
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or allow_cascade or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return [f"{style.SQL_KEYWORD('DELETE FROM')} {style.SQL_FIELD(self.quote_name(table))};" for table in tables]

    DatabaseOperations.sql_flush = sql_flush
