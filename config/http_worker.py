"""The production command's gunicorn worker (docs/production.md): uvicorn's ASGI worker, with a deadline for reading
each request.

An ASGI worker serves every connection on its event loop, so a client that sends its request slowly holds a socket,
not a worker: ten connections sending one header line a second no longer stop anyone else being served (they held
all four sync workers of the WSGI command, issue 39). Uvicorn on its own never gives up on such a client, though:
its keep-alive timeout counts only the silence between two requests, so a connection that trickles a request, or
sends nothing at all, stays open for as long as the client likes, and enough of them exhaust the process's file
descriptors. Here a request must arrive whole, head and body, within REQUEST_READ_TIMEOUT seconds (counted from the
connection for its first request, from the first byte for each later one); a slower client is disconnected.
Uvicorn already bounds a request's head to 16 KiB (h11's incomplete-event limit) and answers 400 past it.

Run as `gunicorn config.asgi -k config.http_worker.Worker`; the module imports nothing of Django, so gunicorn's
master can load it before forking the workers.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn_worker import UvicornWorker

REQUEST_READ_TIMEOUT = 10.0
STILL_READING = (h11.IDLE, h11.SEND_BODY)  # the client's side of the connection while its request is arriving


class ReadDeadlineProtocol(H11Protocol):
    """Uvicorn's h11 protocol, closing a connection whose request is not read whole within REQUEST_READ_TIMEOUT."""

    read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in STILL_READING:
            self._disarm()  # the request is in (or the connection is closing)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.read_deadline = self.loop.call_later(REQUEST_READ_TIMEOUT, self._too_slow)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _too_slow(self) -> None:
        self.read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("%s:%s did not send its request within %g s: disconnected",
                             *(self.client or ("?", "?")), REQUEST_READ_TIMEOUT)
            self.transport.close()


class Worker(UvicornWorker):
    CONFIG_KWARGS = {"loop": "auto", "http": ReadDeadlineProtocol}
