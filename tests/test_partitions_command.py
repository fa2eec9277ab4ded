"""`manage.py partitions` on either database: PostgreSQL lists the months; SQLite says it has none and succeeds."""
from django.core.management import CommandError, call_command
from django.db import connection

import pytest


@pytest.mark.django_db
def test_it_explains_itself_on_sqlite_and_lists_months_on_postgresql(capsys):
    call_command("partitions", "--ensure", "--detach-before", "2020-01")
    out = capsys.readouterr().out
    if connection.vendor == "postgresql":
        assert "ledger_auditevent_default\tdefault" in out and "ledger_checkpoint_y" in out
    else:
        assert out.startswith("sqlite: these tables are not partitioned") and "ledger_" not in out


@pytest.mark.django_db
@pytest.mark.parametrize("month", ["2026-13", "soon", "2026-1", ""])
def test_it_refuses_a_month_it_cannot_read(month):
    with pytest.raises(CommandError, match="YYYY-MM"):
        call_command("partitions", "--detach-before", month)
