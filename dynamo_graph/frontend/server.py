"""The uvicorn server the frontend (app.py) runs in: TCP_NODELAY on every connection, a cap on
a request's head, and a clean exit after a graceful shutdown.

A graph replaces its frontend without failing a request (the supervisor's rolling update): the
new process binds the same port beside the old one (SO_REUSEPORT: the kernel spreads new
connections over both), and once it is ready the old one gets SIGTERM and drains. It closes its
listener first, so new connections go to the new process; serves every request that still
arrives on a connection it holds, answered `Connection: close` so the client reconnects to the
new one; leaves idle connections to its keep-alive timeout, as always (closing one early races
a request the client is sending on it, which a client without retries sees as an error); lets
in-flight streams finish within the grace; then exits 0.

Closing a listener resets the connections still in its accept queue (the kernel hands them to
the port's other listener only where the host sets net.ipv4.tcp_migrate_req=1). So the server
keeps a duplicate of each listener, and on shutdown, once the event loop stopped accepting, it
accepts what is queued there and closes it in one step: the race left is the microseconds
between that last accept and the close (measured: benchmarks/bench_frontend_handover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dynamo_graph.frontend.coalesce import CoalescingTransport
from dynamo_graph.frontend.errors import error_body

if TYPE_CHECKING:
    from dynamo_graph.frontend.app import FrontendApp
    from dynamo_graph.frontend.settings import HttpTlsSettings

SHUTDOWN_GRACE_S = 30.0  # in-flight requests' time to finish once SIGTERM came (DYN_SHUTDOWN_GRACE_S)
MAX_HEAD_BYTES = 64 * 1024  # request line + headers; more is a 431 and the connection closes
_HEAD_TOO_LARGE = error_body(
    431, f"Request line and headers are larger than {MAX_HEAD_BYTES} bytes", code="headers_too_large"
)
_HEAD_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_HEAD_TOO_LARGE)
) + _HEAD_TOO_LARGE


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """Writes what one turn of the event loop sent in one call (coalesce.py). TCP_NODELAY, without
    which small SSE writes on a kept-alive connection wait ~40 ms for the client's delayed ACK
    (seen in Dynamo 1.6.1), is set on every accepted socket by the event loop
    itself (uvloop and asyncio both; test_http_openai.py's keep-alive test holds it to that).

    Also bounds a request's head: httptools gathers the URL and each header in memory with no
    limit of its own, so a client that keeps sending one would grow the frontend without end.

    A new connection costs no system call here: its addresses come from the transport, which
    has them from the accept (uvicorn asks the socket again, five calls and two socket objects
    per connection: about a tenth of what a new connection adds to its request's CPU)."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        self._in_head = True
        self._message_ended = False
        self._head_bytes = 0
        self.connections.add(self)
        self.transport = CoalescingTransport(transport, self.loop)  # type: ignore[assignment]
        self.flow = FlowControl(self.transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))  # type: ignore[assignment]
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"

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


def _address(name: object) -> tuple[str, int] | None:
    """(host, port) of a socket address as ASGI's scope gives it (IPv6's has two more fields)."""
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) else None


class DrainingHttpToolsProtocol(NoDelayHttpToolsProtocol):
    """Drains a connection on shutdown without cutting it under a client. uvicorn's own
    `shutdown` closes an idle kept-alive connection at once: a client sending its next request
    on it at that moment gets "server disconnected". Here the request in flight, and any that
    arrives later, is served and answered `Connection: close`; an idle connection closes once
    idle for the keep-alive timeout (the normal rule: a client's pool expects that)."""

    _draining = False

    def shutdown(self) -> None:
        self._draining = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        elif self.timeout_keep_alive_task is None and not self.transport.is_closing():
            # Connected but no request yet: uvicorn arms no timer for that; it gets the same.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False


# The serving process's first collector generation: collected after this many more container
# objects were made than freed (Python's default 700). A request makes a few hundred that live
# until it ends, so at 700 the collector ran every few requests and, through the older
# generations, scanned the whole heap every thousand or so: ~50 µs of CPU per streamed request,
# ~7% of it at c=32 (docs/frontend-scaling.md). At 10,000 it runs every few hundred requests and
# costs ~3 µs per request; what cyclic garbage waits meanwhile is a few MB at most.
GC_YOUNG_THRESHOLD = 10_000

MAX_BACKLOG_TAKEN = 4096  # queued connections a shutting-down server still takes from its listener
TLS_HANDSHAKE_S = 5.0  # what one of those gets to finish its handshake (shutdown waits on it)


class GracefulServer(uvicorn.Server):
    """Exits normally after a graceful shutdown on SIGINT/SIGTERM (uvicorn re-raises the signal
    once it has shut down, so the process would die "killed by SIGTERM" and a supervisor could
    not tell a clean stop from a crash), and serves what its listeners had queued when it stopped
    accepting (see the module docstring)."""

    _held: list[socket.socket]
    _gc_thresholds: tuple[int, int, int] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._held = [sock.dup() for sock in sockets or []]
        self._gc_thresholds = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *self._gc_thresholds[1:])
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await asyncio.sleep(0)  # the loop lets go of its listening handles
        queued = take_backlog(self._held)
        self._held = []
        if queued:
            await asyncio.gather(*(self._serve_accepted(conn) for conn in queued), return_exceptions=True)
        await super().shutdown()  # the connections, these too, drain as any other
        if self._gc_thresholds is not None:
            gc.set_threshold(*self._gc_thresholds)

    async def _serve_accepted(self, conn: socket.socket) -> None:
        def protocol() -> asyncio.Protocol:
            return self.config.http_protocol_class(  # type: ignore[call-arg]
                config=self.config, server_state=self.server_state, app_state=self.lifespan.state
            )

        try:
            loop = asyncio.get_running_loop()
            tls = self.config.ssl
            await loop.connect_accepted_socket(
                protocol, conn, ssl=tls, ssl_handshake_timeout=TLS_HANDSHAKE_S if tls else None
            )
        except Exception:
            conn.close()
            raise


def take_backlog(listeners: list[socket.socket]) -> list[socket.socket]:
    """The connections queued on `listeners`, accepted without waiting, then the listeners
    closed straight after, so that no connection arrives in between to be reset."""
    taken: list[socket.socket] = []
    for listener in listeners:
        listener.setblocking(False)
        with contextlib.suppress(OSError):  # BlockingIOError: the queue is empty
            while len(taken) < MAX_BACKLOG_TAKEN:
                conn, _ = listener.accept()
                conn.setblocking(False)
                taken.append(conn)
        listener.close()
    return taken


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `host:port` (each address it resolves to, as uvicorn would bind them)
    with SO_REUSEPORT, so the graph's next frontend can bind the same port while this one still
    serves (and SO_REUSEADDR, past connections in TIME_WAIT)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # as asyncio binds it: IPv4 gets its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def make_server(
    app: FrontendApp, grace_s: float = SHUTDOWN_GRACE_S, tls: HttpTlsSettings | None = None
) -> uvicorn.Server:
    """The server for `app`, to serve the sockets of `listen`; on SIGTERM in-flight requests
    get `grace_s` to finish; HTTPS with `tls`'s files."""
    cap = app.limits.max_concurrent
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=DrainingHttpToolsProtocol,
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=grace_s,
        # Connections (and tasks) at once: well above the request cap, so excess requests still
        # get the frontend's own 503, while a flood of idle connections stays bounded.
        limit_concurrency=4 * cap + 256 if cap else None,
        ssl_certfile=tls.cert_file if tls else None,
        ssl_keyfile=tls.key_file if tls else None,
    )
    return GracefulServer(config)
