"""The production command's gunicorn worker (docs/production.md): uvicorn's ASGI worker on its httptools protocol,
with a deadline for reading each request and a bound on a request's head.

An ASGI worker serves every connection on its event loop, so a client that sends its request slowly holds a socket,
not a worker: ten connections sending one header line a second no longer stop anyone else being served (they held
all four sync workers of the WSGI command, issue 39). Uvicorn on its own never gives up on such a client, though:
its keep-alive timeout counts only the silence between two requests, so a connection that trickles a request, or
sends nothing at all, stays open for as long as the client likes, and enough of them exhaust the process's file
descriptors. Here a request must arrive whole, head and body, within REQUEST_READ_TIMEOUT seconds (counted from the
connection for its first request, from the first byte for each later one); a slower client is disconnected.

The protocol is uvicorn's httptools one (llhttp, in C) rather than its h11 one (pure Python), which took about a
third of the event loop's time under load (issue 40). llhttp buffers a head of any size, where h11 answered 400 past
16 KiB: MAX_HEAD keeps that bound (400, and the connection closed), counting both the bytes received while a head is
incomplete and the head's parts once it is whole, so a large head is refused however it is split into packets.

Run as `gunicorn config.asgi -k config.http_worker.Worker`; the module imports nothing of Django, so gunicorn's
master can load it before forking the workers.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker

REQUEST_READ_TIMEOUT = 10.0
MAX_HEAD = 16 * 1024  # h11's bound on a request head, which uvicorn's h11 protocol answered 400 past


class ReadDeadlineProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol, closing a connection whose request is not read whole within
    REQUEST_READ_TIMEOUT, and answering 400 to a head larger than MAX_HEAD.

    llhttp reports a request's progress through callbacks: a request is being read from its first byte (or
    `on_message_begin`, for one that came in the same packet as the previous one) until `on_message_complete`; its
    head until `on_headers_complete`."""

    read_deadline: asyncio.TimerHandle | None = None
    reading_head = True  # from the end of the previous request (or the connection) to the end of this one's head
    head_received = 0  # bytes received while reading_head
    head_parts = 0  # the head's request target, header names and values as llhttp hands them over

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        if self.reading_head:
            self.head_received += len(data)
        super().data_received(data)  # a HeadTooLarge in a callback is a parser error: uvicorn answers 400 and closes
        if self.reading_head and self.head_received > MAX_HEAD and not self.transport.is_closing():
            self._refuse_head()  # more than MAX_HEAD received and still no end of the head

    def on_message_begin(self) -> None:
        if self.read_deadline is None:
            self._arm()  # a request that followed the previous one in the same packet
        super().on_message_begin()
        self.head_parts = 0

    def on_url(self, url: bytes) -> None:
        self.head_parts += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_parts += len(name) + len(value)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.head_parts > MAX_HEAD:
            raise HeadTooLarge
        self.reading_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self.reading_head, self.head_received = True, 0
        super().on_message_complete()

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

    def _refuse_head(self) -> None:
        self.logger.warning("%s:%s sent a request head over %d bytes: 400", *(self.client or ("?", "?")), MAX_HEAD)
        self._disarm()
        self.send_400_response("Invalid HTTP request received.")  # what uvicorn answers any request it cannot parse


class HeadTooLarge(Exception):
    """Raised in llhttp's callbacks to stop parsing a head past MAX_HEAD: llhttp makes it a parser error, which
    uvicorn answers 400 before closing the connection."""


class Worker(UvicornWorker):
    CONFIG_KWARGS = {"loop": "auto", "http": ReadDeadlineProtocol}
