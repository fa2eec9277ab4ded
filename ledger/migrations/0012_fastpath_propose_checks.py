"""`unwind_propose` checks what its caller may have taken from a cache, draws the caller's next action id, and runs
its ordering check from the run's actions whatever the statistics say.

A process keeps the tools it proposes with (ledger/engine/fastpath.py), so a proposal no longer reads its tool first. The
function now checks, under its locks and before writing, that the tool's version is still the current one, that the
compensation's twin is still the version the plan binds, and that the tenant's slug and approval threshold are
unchanged; otherwise it answers 'stale' having written nothing, and the caller decides again from a fresh read.
On success it also draws an id for the caller's next proposal.

0010's ordering check joined the run's actions with their tools; on a database without statistics yet (a new one)
the planner started from the tools and scanned every action of each (0.8 ms of a proposal's 0.9 inside
PostgreSQL). The tool's class is now looked up per action of the run, which leaves one plan.

The signature changes, so 0010's function is dropped first (the definitions are checked against `FUNCTIONS` here,
all of them by name).

The functions' text this migration once installed is gone from here (issue 40): migration 0017 installs the
engine's functions from ledger/engine/plpgsql/*.sql, on a fresh database and on one that ran the old text
alike, and git history keeps the old text. What stays is the schema.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0011_action_sweep_partial_indexes"),
    ]

    operations = []
