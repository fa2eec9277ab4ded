"""gunicorn settings for tests/test_http_worker.py (`-c python:tests.gunicorn_short_deadline`): the production worker
with a read deadline of DEADLINE seconds instead of 10, so that its tests wait for it in seconds."""
DEADLINE = 1.0


def post_fork(server, worker):
    from config import http_worker

    http_worker.REQUEST_READ_TIMEOUT = DEADLINE
