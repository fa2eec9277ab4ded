"""`make bench`: Unwind measured side by side with DBOS Transact and the raw PostgreSQL floor."""
