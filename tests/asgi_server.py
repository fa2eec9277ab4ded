"""An ASGI live server for the tests: `config.asgi` under uvicorn with the production worker's protocol
(config/http_worker.py), in a thread of the test process, on a free loopback port.

Like pytest-django's `live_server` (a WSGI server in a thread), it uses the test database, so what a transactional
test commits is what it serves; unlike it, waits on it are awaited on its event loop, as under the production
command (ledger/api/waits.py).
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from config.http_worker import ReadDeadlineProtocol


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def asgi_server(**config):
    """Serve config.asgi on http://127.0.0.1:<port>; yields its base URL, stops it on leaving."""
    from config.asgi import application

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, http=ReadDeadlineProtocol,
                                           lifespan="off", log_level="warning", **config))
    thread = threading.Thread(target=server.run, name="asgi-live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the ASGI server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
