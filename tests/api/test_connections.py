"""Connections are bounded (docs/api.md, "Limits"): a request head that does not arrive in time closes
its connection (`api.connections`), and connections past ``limit_concurrency`` are answered 503.

A real uvicorn server on a loopback port and raw sockets: a test client cannot send half a request head.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import uvicorn

from api.connections import HeaderTimeoutH11Protocol
from api.main import create_app
from jobs.config import Settings

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


class _ShortHeaderTimeout(HeaderTimeoutH11Protocol):
    header_read_timeout_s = 1.0


@contextmanager
def _serve(settings: Settings, *, limit_concurrency: int | None = None) -> Iterator[int]:
    """``create_app(settings)`` served as `batchinfer api` serves it, on a free port; yields the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=_ShortHeaderTimeout,
        limit_concurrency=limit_concurrency,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def _closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``timeout_s``; what it sends before is dropped."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
    return False


def test_half_sent_request_heads_are_closed_while_health_answers(service_settings: Settings) -> None:
    with _serve(service_settings) as port, ExitStack() as stack:
        sockets = []
        for _ in range(50):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            sock.sendall(HALF_HEAD)
            sockets.append(sock)
        started = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert all(_closed_by_server(sock, timeout_s=10) for sock in sockets)
        assert time.monotonic() - started < 8
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_kept_alive_connection_must_send_its_next_head_in_time(service_settings: Settings) -> None:
    with _serve(service_settings) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(HALF_HEAD)  # the next request, half sent: the keep-alive timer no longer runs
        assert _closed_by_server(sock, timeout_s=10)


def test_a_complete_head_is_not_cut_while_its_body_is_read(service_settings: Settings) -> None:
    with _serve(service_settings) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
        )
        assert not _closed_by_server(sock, timeout_s=2)  # past the 1 s head timeout: the body's own limits apply
        sock.sendall(b"{}")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400")


def test_connections_past_the_cap_are_answered_503(service_settings: Settings) -> None:
    with _serve(service_settings, limit_concurrency=5) as port, ExitStack() as stack:
        for _ in range(5):
            stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10)).sendall(HALF_HEAD)
        time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
