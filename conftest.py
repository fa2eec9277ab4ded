"""Test-session defaults, read before Django's settings load."""
import os

# Background tasks run inline after commit in tests; the crash and chaos tests start real workers
# with this turned off in their own environment.
os.environ.setdefault("UNWIND_TASKS_SYNC", "1")
