"""The same transactions in a third of the statements: each of the engine's functions now runs its locks, its checks
and its writes as a few statements instead of one per row.

Inside PostgreSQL, on 0013's functions (`perf record` of the backend during ok sagas), most of a call's CPU went to
what each SQL statement costs before and after its work, not to the work: starting and ending an executor (12 %),
revalidating and locking the cached plan, and planning again on every call (5 %) the checks whose condition began
with an argument alone (`p_content_key <> '' AND EXISTS (...)`): for a plan made for the call's values that
condition folds away, so the plan made for any values never looked cheaper and was never kept. A proposal ran 16
statements, a step's success 8.

- The chain's head and the run are locked in one statement, in that order (the order of its FROM, as the Python
  path locks them), and the head's number and hash come with the lock: the chain's own read of the head goes.
- A function's checks are one statement, each check a subquery of it; none is gated by an argument alone, so one
  plan serves every call (an empty list of roles, say, finds nothing by itself).
- Its writes and the chain's events and head are one statement, the writes as data-modifying CTEs: they all see
  the locked rows and commit together. Where a write must move exactly one row, it moves it first on its own (the
  step's success) or the others are counted with it and an error rolls everything back (the unwind's moves).
- The chain's hashes are computed first, by `unwind_chain_hashes` (HMAC-SHA256 of each event's body as
  `verify_chain` checks it, the key's padded halves passed for the call and never stored), with no statement: it
  only computes. `unwind_chain_append` is gone.

Every function keeps its arguments and its answers, and decides every case as before; the Python side is unchanged.

The functions' text this migration once installed is gone from here (issue 40): migration 0017 installs the
engine's functions from ledger/engine/plpgsql/*.sql, on a fresh database and on one that ran the old text
alike, and git history keeps the old text. What stays is the schema.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0013_fastpath_fewer_entries"),
    ]

    operations = []
