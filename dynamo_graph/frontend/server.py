"""The uvicorn server the frontend (app.py) runs in: TCP_NODELAY on every connection, a cap on
a request's head, and a clean exit after a graceful shutdown."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_graph.frontend.errors import error_body

if TYPE_CHECKING:
    from dynamo_graph.frontend.app import FrontendApp

MAX_HEAD_BYTES = 64 * 1024  # request line + headers; more is a 431 and the connection closes
_HEAD_TOO_LARGE = error_body(
    431, f"Request line and headers are larger than {MAX_HEAD_BYTES} bytes", code="headers_too_large"
)
_HEAD_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_HEAD_TOO_LARGE)
) + _HEAD_TOO_LARGE


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """Sets TCP_NODELAY on every accepted socket: without it small SSE writes on a kept-alive
    connection wait ~40 ms for the client's delayed ACK (seen in Dynamo 1.6.1, notes/DYNAMO.md).

    Also bounds a request's head: httptools gathers the URL and each header in memory with no
    limit of its own, so a client that keeps sending one would grow the frontend without end."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._in_head = True
        self._message_ended = False
        self._head_bytes = 0
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head
        self._message_ended = False
        super().data_received(data)
        # Count a chunk that began and ended inside one request's head (one that also ended a
        # message may hold body bytes: not counted, so a head can pass the limit by one read).
        if was_in_head and self._in_head and not self._message_ended:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.transport.write(_HEAD_TOO_LARGE_RESPONSE)
                self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True  # the next request on this connection starts with its head
        self._message_ended = True
        super().on_message_complete()


class GracefulServer(uvicorn.Server):
    """Exits normally after a graceful shutdown on SIGINT/SIGTERM. uvicorn re-raises the signal
    once it has shut down, so the process would die "killed by SIGTERM" and a supervisor could
    not tell a clean stop from a crash."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def make_server(app: FrontendApp, host: str, port: int) -> uvicorn.Server:
    cap = app.limits.max_concurrent
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=NoDelayHttpToolsProtocol,
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=30,
        # Connections (and tasks) at once: well above the request cap, so excess requests still
        # get the frontend's own 503, while a flood of idle connections stays bounded.
        limit_concurrency=4 * cap + 256 if cap else None,
    )
    return GracefulServer(config)
