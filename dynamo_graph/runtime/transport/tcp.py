"""The default request plane: direct TCP from caller to worker, many streams per connection.

Worker side: one listener per process (`TcpRequestPlaneServer`), endpoints registered by
subject. Each request runs its handler in a task that writes `Data` frames and then exactly
one terminal frame. A `Cancel` frame stops the request's Context; a lost connection kills it;
a handler that has not finished `cancel_grace_s` later is cancelled.

Caller side: one connection per worker address (`TcpRequestPlaneClient`), shared by every
concurrent stream. The protocol's `data_received` demultiplexes frames into per-stream deques.
Backpressure, reading: a deque holding `stream_buffer` frames pauses reading of the whole
connection until its consumer has taken half of them. That caps memory at about
`stream_buffer` frames per stream (plus one socket read), at the price that one stalled
consumer stalls the other streams of its connection; callers that stop reading must close the
stream (or stop its Context), which releases its frames at once. Writing, both sides: frames
written in one loop turn leave in one `send`; producers wait while the transport is paused.

With an `ssl` context on both sides (runtime/tls.py: a graph's `security.tls`) the same frames
go over TLS 1.3 and each end must show a certificate of the graph's CA: a peer without one
fails the handshake and never reaches a handler. Measured numbers: benchmarks/bench_transport.py,
and TLS against plain TCP: benchmarks/bench_tls.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable
from typing import Any, cast

from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.transport.base import (
    CannotConnect,
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    RequestTimeout,
    StreamBroken,
)
from dynamo_graph.runtime.transport.frames import (
    Cancel,
    Data,
    End,
    Error,
    Frame,
    FrameProtocolError,
    FrameReader,
    FrameWriter,
    Request,
    error_from_frame,
)
from dynamo_graph.runtime.transport.streams import ClientStream, HandlerTasks, ServerStream, run_handler

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
# Stopping: connections stay open until no request came for LINGER_QUIET_S, at most LINGER_MAX_S.
LINGER_QUIET_S = 0.3
LINGER_MAX_S = 2.0
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS peer that does not finish its handshake is dropped after this


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError names the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad tcp address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --------------------------------------------------------------------------- worker side


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: TcpRequestPlaneServer) -> None:
        self.server = server
        self.streams: dict[int, ServerStream] = {}
        self.reader = FrameReader()
        self.writer: FrameWriter
        self.transport: asyncio.Transport
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        _set_nodelay(transport)
        self.writer = FrameWriter(self.transport)
        self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data, self._on_frame)
        except FrameProtocolError as exc:
            peer = self.transport.get_extra_info("peername")
            log.warning("dropping request-plane connection from %s: %s", peer, exc)
            self.transport.abort()

    def _on_frame(self, frame: Frame) -> None:
        if type(frame) is Request:
            self.server._open(self, frame)
        elif type(frame) is Cancel:
            stream = self.streams.get(frame.id)
            if stream is not None:
                stream.stop(self.server.cancel_grace_s, killed=False)

    def send(self, frame: Frame) -> Awaitable[None] | None:
        """Write `frame` now; only while the transport is paused, hand back a wait-then-write."""
        if self.writer.writable:
            self.writer.write(frame)
            return None
        return self._send_when_writable(frame)

    async def _send_when_writable(self, frame: Frame) -> None:
        await self.writer.drain()
        self.writer.write(frame)

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writer.close()
        for stream in self.streams.values():
            stream.stop(self.server.cancel_grace_s, killed=True)
        self.server._connections.discard(self)
        if not self.lost.done():
            self.lost.set_result(None)


class TcpRequestPlaneServer(RequestPlaneServer):
    """One TCP listener serving every endpoint instance of this worker process.

    `host` is the bind address; `advertise_host` is what callers are told to dial (needed when
    binding a wildcard address; without it the machine's hostname is advertised).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        *,
        max_streams_per_connection: int = 4096,
        cancel_grace_s: float = 2.0,
        ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.ssl = ssl
        self.port = port
        self.advertise_host = advertise_host or (socket.gethostname() if host in _WILDCARD_HOSTS else host)
        self.max_streams_per_connection = max_streams_per_connection
        self.cancel_grace_s = cancel_grace_s
        self._handlers: dict[str, Handler] = {}
        self._connections: set[_ServerConnection] = set()
        self._tasks = HandlerTasks()
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._last_request = 0.0  # loop time of the last request frame

    @property
    def address(self) -> str:
        """The `host:port` callers dial (valid after start())."""
        return format_address(self.advertise_host, self.port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self),
            self.host,
            self.port,
            reuse_address=True,
            ssl=self.ssl,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.ssl else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def register(self, subject: str, handler: Handler) -> dict[str, Any]:
        if self._server is None:
            raise RuntimeError("TcpRequestPlaneServer.register() before start(): the port is not known yet")
        self._handlers[subject] = handler
        return {"tcp": self.address}

    def unregister(self, subject: str) -> None:
        self._handlers.pop(subject, None)

    async def stop(self, grace_s: float = 0.0) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._tasks.wait(grace_s)
        await self._tasks.end([stream for conn in self._connections for stream in conn.streams.values()])
        await self._linger()
        connections = list(self._connections)
        for conn in connections:
            conn.writer.flush()
            conn.transport.close()
        if connections:
            _, unclosed = await asyncio.wait([conn.lost for conn in connections], timeout=1.0)
            if unclosed:
                for conn in connections:
                    conn.transport.abort()

    async def _linger(self) -> None:
        """Keep the connections open, answering `not_found`, until callers stopped sending: a
        caller learns that this instance left from discovery (a moment after `unregister`) or
        from that answer, and a request already on the wire when a connection closes would be
        lost (a broken stream) where `not_found` lets the caller try another instance."""
        loop = asyncio.get_running_loop()
        until = loop.time() + LINGER_MAX_S
        while self._connections and loop.time() < until:
            quiet = loop.time() - self._last_request
            if quiet >= LINGER_QUIET_S:
                return
            await asyncio.sleep(LINGER_QUIET_S - quiet)

    def _open(self, conn: _ServerConnection, frame: Request) -> None:
        self._last_request = asyncio.get_running_loop().time()
        sid = frame.id
        handler = self._handlers.get(frame.subject)
        if handler is None or self._stopping:
            why = "is shutting down" if self._stopping else "is not served here"
            conn.writer.write(Error(sid, "not_found", f"endpoint {frame.subject!r} {why}"))
            return
        if sid in conn.streams:
            conn.writer.write(Error(sid, "invalid_argument", f"stream id {sid} is already open"))
            return
        if len(conn.streams) >= self.max_streams_per_connection:
            limit = self.max_streams_per_connection
            conn.writer.write(Error(sid, "overloaded", f"more than {limit} streams on one connection"))
            return
        stream = ServerStream(Context(frame.request_id or None))
        conn.streams[sid] = stream
        self._tasks.start(stream, self._serve(conn, stream, handler, frame))

    @staticmethod
    async def _serve(conn: _ServerConnection, stream: ServerStream, handler: Handler, frame: Request) -> None:
        """Run one handler; its terminal frame is written even after a Cancel (the caller drops
        it) and dropped by the writer if the connection is gone."""
        sid = frame.id
        try:
            terminal = await run_handler(stream, handler, frame, conn.send)
        finally:
            if conn.streams.get(sid) is stream:
                del conn.streams[sid]
        conn.writer.write(terminal)


# --------------------------------------------------------------------------- caller side


class _ClientStream(ClientStream):
    __slots__ = ("id",)

    def __init__(self, stream_id: int) -> None:
        super().__init__()
        self.id = stream_id


class _ClientConnection(asyncio.Protocol):
    def __init__(self, client: TcpRequestPlaneClient, address: str) -> None:
        self.client = client
        self.address = address
        self.streams: dict[int, _ClientStream] = {}
        self.reader = FrameReader()
        self.writer: FrameWriter
        self.transport: asyncio.Transport
        self.lost = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._next_id = 0
        self._full: set[_ClientStream] = set()
        self._cap = client.stream_buffer
        self._resume_at = client.stream_buffer // 2

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        _set_nodelay(transport)
        self.writer = FrameWriter(self.transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data, self._on_frame)
        except FrameProtocolError as exc:
            log.warning("dropping request-plane connection to %s: %s", self.address, exc)
            self.transport.abort()

    def _on_frame(self, frame: Frame) -> None:
        stream = self.streams.get(frame.id)
        if stream is None:
            return  # a stream the caller already closed (cancelled): its late frames are dropped
        frames = stream.frames
        frames.append(frame)
        if len(frames) >= self._cap and stream not in self._full:
            self._full.add(stream)
            self.transport.pause_reading()
        stream.wake()

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.closed.done():
            self.closed.set_result(None)
        self.writer.close()
        self.client._forget(self)
        why = f": {exc}" if exc else ""
        for stream in self.streams.values():
            stream.fail(StreamBroken(f"connection to {self.address} lost{why}"))

    def open(self, subject: str, headers: dict[str, str], payload: bytes, request_id: str) -> _ClientStream:
        self._next_id += 1
        stream = _ClientStream(self._next_id)
        self.streams[stream.id] = stream
        self.writer.write(Request(stream.id, subject, headers, payload, request_id))
        return stream

    def taken(self, stream: _ClientStream) -> None:
        """The consumer took a frame: resume reading once every full stream has drained to half."""
        if stream in self._full and len(stream.frames) <= self._resume_at:
            self._full.discard(stream)
            if not self._full and not self.lost:
                self.transport.resume_reading()

    def close_stream(self, stream: _ClientStream, *, cancel: bool) -> None:
        del self.streams[stream.id]
        stream.frames.clear()
        if stream in self._full:
            self._full.discard(stream)
            if not self._full and not self.lost:
                self.transport.resume_reading()
        if cancel and not self.lost:
            self.writer.write(Cancel(stream.id))


class TcpRequestPlaneClient(RequestPlaneClient):
    """Streams requests to workers over one shared TCP connection per worker address."""

    def __init__(
        self, *, connect_timeout_s: float = 5.0, stream_buffer: int = 256, ssl: ssl.SSLContext | None = None
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ssl = ssl
        self.stream_buffer = stream_buffer
        self._connections: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Future[_ClientConnection]] = {}

    async def stream(
        self,
        transport: dict[str, Any],
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        context: Context,
        timeout_s: float | None = None,
    ) -> AsyncIterator[bytes]:
        if context.is_stopped():
            return
        conn = self._connections.get(transport["tcp"]) or await self._connect(transport["tcp"])
        if not conn.writer.writable:
            await conn.writer.drain()
        stream = conn.open(subject, headers, payload, context.id)
        watcher = asyncio.ensure_future(context.stopped())
        watcher.add_done_callback(lambda _: stream.wake())
        loop = asyncio.get_running_loop()
        frames = stream.frames
        finished = False
        try:
            while True:
                if context.is_stopped():
                    return
                if not frames:
                    if stream.failure is not None:
                        finished = True
                        raise stream.failure
                    await self._wait(loop, stream, timeout_s)
                    continue
                frame = frames.popleft()
                conn.taken(stream)
                if type(frame) is Data:
                    yield frame.body
                elif type(frame) is End:
                    finished = True
                    return
                elif type(frame) is Error:
                    finished = True
                    raise error_from_frame(frame)
        finally:
            watcher.cancel()
            conn.close_stream(stream, cancel=not finished)

    @staticmethod
    async def _wait(loop: asyncio.AbstractEventLoop, stream: _ClientStream, timeout_s: float | None) -> None:
        waiter = stream.waiter = loop.create_future()
        timer = None
        if timeout_s is not None:
            timer = loop.call_later(
                timeout_s, stream.fail, RequestTimeout(f"no response frame within {timeout_s:g} s")
            )
        try:
            await waiter
        finally:
            stream.waiter = None
            if timer is not None:
                timer.cancel()

    async def _connect(self, address: str) -> _ClientConnection:
        """The live connection to `address`, dialled once however many streams ask at once."""
        pending = self._connecting.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._dial(address))
            self._connecting[address] = pending
            pending.add_done_callback(self._dialled)
        return await asyncio.shield(pending)

    async def _dial(self, address: str) -> _ClientConnection:
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, address), host, port, ssl=self.ssl
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError: a refused handshake
            raise CannotConnect(f"cannot connect to {address}: {exc or 'timed out'}") from exc
        finally:
            self._connecting.pop(address, None)
        self._connections[address] = conn
        return conn

    @staticmethod
    def _dialled(future: asyncio.Future[_ClientConnection]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here so an unawaited failure is not logged as lost

    def _forget(self, conn: _ClientConnection) -> None:
        if self._connections.get(conn.address) is conn:
            del self._connections[conn.address]

    async def close(self) -> None:
        for pending in list(self._connecting.values()):
            pending.cancel()
        conns = list(self._connections.values())
        for conn in conns:
            conn.transport.close()
        if conns:
            await asyncio.wait([conn.closed for conn in conns], timeout=1.0)
