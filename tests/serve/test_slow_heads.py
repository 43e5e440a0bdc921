"""A request whose line and headers never finish (slowloris) is cut off: uvicorn times out
only idle keep-alive connections, so each such client used to hold a connection for good.
`server.HeadDeadline` gives the head its own deadline (the body has `asgi.BodyLimit`'s)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from serving import LiveServer, live_server

from dynalm.models.loader import LoadedModel

DEADLINE_S = 1.5


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    with live_server(smollm2, head_timeout_s=DEADLINE_S) as s:
        yield s


def _connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _reply_after(sock: socket.socket, sent: bytes) -> tuple[str, float]:
    sock.sendall(sent)
    t0 = time.monotonic()
    reply = b""
    while chunk := sock.recv(65536):  # until the server closes the connection
        reply += chunk
    return reply.decode(), time.monotonic() - t0


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, nothing sent
        b"GET /health HTTP/1.1\r\n",  # a request line, no headers
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
    ],
    ids=["nothing", "request-line", "headers-unfinished"],
)
def test_unfinished_head_is_408_and_closed(server: LiveServer, sent: bytes) -> None:
    with _connect(server) as sock:
        reply, waited = _reply_after(sock, sent)
    assert reply.startswith("HTTP/1.1 408 Request Timeout"), reply
    assert reply.endswith("the request's headers did not arrive in time\n")
    assert DEADLINE_S * 0.5 < waited < DEADLINE_S + 10
    assert server.http().get("/health").status_code == 200


def test_a_slow_head_within_the_deadline_is_served(server: LiveServer) -> None:
    with _connect(server) as sock:
        for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
            sock.sendall(part)
            time.sleep(DEADLINE_S / 5)
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 200"), reply


def test_each_request_of_a_kept_alive_connection_gets_its_own_deadline(
    server: LiveServer,
) -> None:
    """The deadline starts at each request's first byte: a connection that served one
    request and then sends half a head is cut off like a new one."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536).decode()
        assert first.startswith("HTTP/1.1 200"), first
        reply, waited = _reply_after(sock, b"GET /health HTTP/1.1\r\nHost")
    assert reply.startswith("HTTP/1.1 408"), reply
    assert waited < DEADLINE_S + 10
