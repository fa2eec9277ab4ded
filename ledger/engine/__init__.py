"""The engine: runs, actions, execution, transitions, the sweep, and the PostgreSQL fast path with its SQL."""
