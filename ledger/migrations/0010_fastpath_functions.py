"""PostgreSQL functions for the engine's transactions, each in one round trip (ledger/engine/fastpath.py).

Each function locks the tenant's chain head first and the run second (the lock order of every ledger writer),
reads what it checks after it holds the locks (a PL/pgSQL statement sees everything committed before it), and
answers 'fallback' before writing anything whenever the step is not the plain case it handles: the caller then
takes the Python path, which decides it under the same locks. The events' HMAC chain is computed here exactly as
`ledger.audit.chain.event_hash` does, from the head the function locked, with the key's padded halves passed by the
caller for that call only (HMAC-SHA256 = sha256(okey || sha256(ikey || message))): the key is never stored.

SQLite has no such functions: it keeps the Python path, which PostgreSQL also takes for everything else.

The functions' text this migration once installed is gone from here (issue 40): migration 0017 installs the
engine's functions from ledger/engine/plpgsql/*.sql, on a fresh database and on one that ran the old text
alike, and git history keeps the old text. What stays is the schema.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0009_h_mcpproxy_executor_mcp"),
    ]

    operations = []
