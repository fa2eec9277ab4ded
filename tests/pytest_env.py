"""Loaded with `-p tests.pytest_env` (pyproject) before pytest-django reads the settings.

Background tasks run inline after commit in tests; the crash tests start real workers with this
turned off in their own environment. The tests run on the public development key, asked for by name; the
processes they start (web servers, workers, commands) inherit it with the rest of this environment.
"""
import os

os.environ.setdefault("UNWIND_TASKS_SYNC", "1")
os.environ.setdefault("UNWIND_INSECURE_DEV_KEY", "1")
os.environ.setdefault("UNWIND_SANDBOX", "1")
