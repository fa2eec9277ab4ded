"""The production worker's guards (config/http_worker.py) against a live gunicorn worker serving config.asgi, over raw
sockets as a hostile client sends: a request must arrive whole within the read deadline (shortened to
tests/gunicorn_short_deadline.py's DEADLINE here), and a request head is at most MAX_HEAD bytes (400 past it),
however it is split into packets. Others are served meanwhile. tests/test_production_server.py runs the slow clients
against the full production command with its 10 s deadline.
"""
from __future__ import annotations

import re
import select
import socket
import time

import pytest
import requests

from config.http_worker import MAX_HEAD
from tests.gunicorn_short_deadline import DEADLINE
from tests.live_processes import Served, read_until_closed

# The worker reads the test database (/healthz asks it), so the tests take it, committed as a live server needs.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """One process of the production worker on the test database, with a read deadline of DEADLINE."""
    served = Served("gunicorn", tmp_path_factory.mktemp("http-worker") / "gunicorn.log", workers=1,
                    GUNICORN_CMD_ARGS="-c python:tests.gunicorn_short_deadline")
    try:
        yield served.start()
    finally:
        served.stop()


def connect(worker: Served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", worker.port), timeout=10)


def head(worker: Served, method: str = "GET", *lines: str) -> bytes:
    """A request head without its final blank line."""
    return "".join([f"{method} /healthz HTTP/1.1\r\n", f"Host: 127.0.0.1:{worker.port}\r\n",
                    *(f"{line}\r\n" for line in lines)]).encode()


def closed(client: socket.socket) -> bool:
    """Whether the server closed the connection (without answering: anything it sent fails the test)."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        received = client.recv(65536)
    except ConnectionResetError:
        return True
    assert received == b"", received[:200]
    return True


def trickle(worker: Served, client: socket.socket, piece: bytes, *, for_seconds: float) -> tuple[float | None, list]:
    """Send `piece` every 0.2 s, asking /healthz over another connection in between, until the server closes
    `client` or `for_seconds` pass: the seconds until it was closed (None if it never was), and the statuses the
    other client got."""
    started, served = time.monotonic(), []
    while time.monotonic() - started < for_seconds:
        if closed(client):
            return time.monotonic() - started, served
        try:
            client.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started, served
        served.append(requests.get(f"{worker.url}/healthz", timeout=5).status_code)
        time.sleep(0.2)
    return None, served


def test_a_head_trickled_past_the_deadline_is_cut_off_while_others_are_served(worker):
    with connect(worker) as silent, connect(worker) as slow:
        slow.sendall(head(worker))
        took, served = trickle(worker, slow, b"X-Slow: 1\r\n", for_seconds=DEADLINE + 3)
        silent.settimeout(3)
        assert read_until_closed(silent) == b""  # a connection that never sends a byte is closed too
    assert took is not None and took <= DEADLINE + 1, took  # counted from the connection
    assert served and all(status == 200 for status in served), served


def test_a_body_trickled_past_the_deadline_is_cut_off(worker):
    with connect(worker) as slow:
        slow.sendall(head(worker, "POST", "Content-Type: application/json", "Content-Length: 100") + b"\r\n")
        took, served = trickle(worker, slow, b" ", for_seconds=DEADLINE + 3)
    assert took is not None and took <= DEADLINE + 1, took
    assert all(status == 200 for status in served), served


def one_answer(client: socket.socket) -> bytes:
    """One whole answer on a kept-alive connection (its head and its Content-Length of body, in however many
    packets they come)."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += client.recv(65536)
    head_part, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head_part).group(1))
    while len(body) < length:
        body += client.recv(65536)
    return head_part + b"\r\n\r\n" + body


def test_the_deadline_of_a_later_request_counts_from_its_first_byte(worker):
    with connect(worker) as kept_alive:
        kept_alive.sendall(head(worker) + b"\r\n")
        assert one_answer(kept_alive).startswith(b"HTTP/1.1 200")
        time.sleep(DEADLINE * 0.8)  # idle within the keep-alive timeout: no deadline runs between requests
        kept_alive.sendall(head(worker))  # its next request, never finished
        took, _ = trickle(worker, kept_alive, b"X-Slow: 1\r\n", for_seconds=DEADLINE + 3)
    assert took is not None and DEADLINE - 0.3 <= took <= DEADLINE + 1, took


def test_blank_lines_between_requests_do_not_keep_a_connection_open(worker):
    """llhttp skips blank lines before a request line, and any byte stops uvicorn's keep-alive timeout: they start
    the read deadline like the first byte of a request."""
    with connect(worker) as kept_alive:
        kept_alive.sendall(head(worker) + b"\r\n")
        assert one_answer(kept_alive).startswith(b"HTTP/1.1 200")
        took, _ = trickle(worker, kept_alive, b"\r\n", for_seconds=DEADLINE + 3)
    assert took is not None and took <= DEADLINE + 1, took


def test_requests_sent_in_one_packet_are_all_answered(worker):
    with connect(worker) as client:
        client.sendall(head(worker) + b"\r\n" + head(worker, "GET", "Connection: close") + b"\r\n")
        answers = read_until_closed(client)
    assert answers.count(b"HTTP/1.1 200") == 2, answers[:500]


def test_a_head_within_the_bound_is_served(worker):
    with connect(worker) as client:
        client.sendall(head(worker, "GET", f"X-Large: {'a' * (MAX_HEAD - 1024)}", "Connection: close") + b"\r\n")
        assert read_until_closed(client).startswith(b"HTTP/1.1 200")


def test_a_head_past_the_bound_in_one_packet_is_refused(worker):
    with connect(worker) as client:
        client.sendall(head(worker, "GET", f"X-Large: {'a' * MAX_HEAD}") + b"\r\n")
        assert read_until_closed(client).startswith(b"HTTP/1.1 400")  # and closed
    assert requests.get(f"{worker.url}/healthz", timeout=5).status_code == 200


def test_a_header_line_that_never_ends_is_refused_once_past_the_bound(worker):
    """llhttp hands a header over only when its line ends: the bytes received while the head is incomplete count.
    The connection is closed as soon as they pass the bound, long before the read deadline."""
    with connect(worker) as client:
        started = time.monotonic()
        client.sendall(head(worker) + b"X-Endless: ")
        try:
            for _ in range(MAX_HEAD // 1024 + 4):
                client.sendall(b"a" * 1024)
                time.sleep(0.005)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed already
        client.settimeout(5)
        answer = read_until_closed(client)
        took = time.monotonic() - started
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]  # unread bytes may reset the 400
    assert took < DEADLINE * 0.8, took
    assert f"sent a request head over {MAX_HEAD} bytes" in worker.log.read_text()
