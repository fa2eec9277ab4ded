"""The engine: runs, actions, execution, transitions, the sweep, and the PostgreSQL fast path with its SQL (the
statements it shares with the rest of the ledger are in ledger/db/)."""
