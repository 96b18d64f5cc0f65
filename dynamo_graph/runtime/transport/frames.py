"""Wire frames of the request plane, and the length-prefixed framing the tcp transport uses.

Every frame is a msgspec Struct in one tagged union, encoded as a msgpack array
(`[tag, id, ...]`): compact, and a few hundred ns to encode or decode. A response is a stream
of `Data` frames closed by exactly one terminal frame (`End` or `Error`). `Ack` and
`Keepalive` exist for nats only, where there is no connection to tell "nobody took the request"
or "the worker died" (see nats.py). On tcp each frame travels as a 4-byte big-endian length
followed by the msgpack bytes; `FrameWriter` coalesces the frames written in one event-loop
turn into one `send`, which matters more than anything else for CPU per token.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

import msgspec

from dynamo_graph.runtime.errors import RequestError, error_from_code
from dynamo_graph.runtime.transport.base import CannotConnect, RequestTimeout, StreamBroken


class Request(msgspec.Struct, tag="q", array_like=True):
    """Caller -> worker: open stream `id`. `request_id` is the caller's Context id, kept on the
    worker's Context so both sides log the same id."""

    id: int
    subject: str
    headers: dict[str, str]
    body: bytes
    request_id: str = ""


class Data(msgspec.Struct, tag="d", array_like=True):
    id: int
    body: bytes


class End(msgspec.Struct, tag="e", array_like=True):
    id: int


class Error(msgspec.Struct, tag="x", array_like=True):
    id: int
    code: str
    message: str
    param: str | None = None


class Cancel(msgspec.Struct, tag="c", array_like=True):
    """Caller -> worker: stop generating (the caller has already stopped reading)."""

    id: int


class Ack(msgspec.Struct, tag="a", array_like=True):
    """Worker -> caller (nats): a worker took the request; from now on silence means trouble."""

    id: int


class Keepalive(msgspec.Struct, tag="k", array_like=True):
    """Worker -> caller (nats): the stream is alive, the handler is just quiet."""

    id: int


Frame = Request | Data | End | Error | Cancel | Ack | Keepalive

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)

encode = _encoder.encode
decode = _decoder.decode

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
"""Largest frame accepted; a bigger length prefix means a broken or hostile peer."""


class EndpointNotFound(CannotConnect):
    """The instance does not serve this endpoint (unregistered, or shutting down). Nothing was
    generated, so this is a connect failure: the router may try another instance."""

    code = "not_found"


_TRANSPORT_ERRORS: dict[str, type[RequestError]] = {
    cls.code: cls for cls in (CannotConnect, StreamBroken, RequestTimeout, EndpointNotFound)
}


def error_from_frame(frame: Error) -> RequestError:
    """Rebuild the typed error the worker sent (engine errors and transport errors alike)."""
    cls = _TRANSPORT_ERRORS.get(frame.code)
    if cls is not None:
        return cls(frame.message, param=frame.param)
    return error_from_code(frame.code, frame.message, frame.param)


def error_frame(stream_id: int, exc: BaseException) -> Error:
    """The terminal frame for a handler that raised: its code if typed, else "internal"."""
    if isinstance(exc, RequestError):
        return Error(stream_id, exc.code, exc.message, exc.param)
    return Error(stream_id, "internal", f"{type(exc).__name__}: {exc}")


class FrameProtocolError(Exception):
    """The peer sent bytes that are not frames; the connection must be dropped."""


class FrameReader:
    """Splits a byte stream into frames; bytes of an incomplete frame wait for the next chunk."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes, on_frame: Callable[[Frame], None]) -> None:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        try:
            with memoryview(buf) as view:
                while end - pos >= 4:
                    (size,) = HEADER.unpack_from(view, pos)
                    if size > MAX_FRAME:
                        raise FrameProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
                    if end - pos - 4 < size:
                        break
                    frame = decode(view[pos + 4 : pos + 4 + size])
                    pos += 4 + size
                    on_frame(frame)
        except msgspec.DecodeError as exc:
            raise FrameProtocolError(str(exc)) from exc
        finally:
            del buf[:pos]


class FrameWriter:
    """Buffers frames for one asyncio transport and sends them once per loop turn.

    Flow control: the transport calls `pause_writing` / `resume_writing` (through the owning
    protocol) when its kernel-side buffer passes the high-water mark; producers then
    `await drain()` before the next frame, so a slow reader slows the handlers instead of
    growing memory. The local buffer itself is flushed at once beyond `flush_bytes`.
    """

    __slots__ = (
        "_buf",
        "_closed",
        "_drain_waiters",
        "_flush_bytes",
        "_loop",
        "_paused",
        "_scheduled",
        "_transport",
    )

    def __init__(self, transport: asyncio.WriteTransport, flush_bytes: int = 256 * 1024) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._flush_bytes = flush_bytes
        self._scheduled = False
        self._paused = False
        self._closed = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def writable(self) -> bool:
        """False while the transport asks producers to wait (they should `await drain()`)."""
        return not self._paused and not self._closed

    def write(self, frame: Frame) -> None:
        if self._closed:
            return
        buf = self._buf
        start = len(buf)
        buf += b"\0\0\0\0"
        _encoder.encode_into(frame, buf, start + 4)
        HEADER.pack_into(buf, start, len(buf) - start - 4)
        if len(buf) >= self._flush_bytes:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._buf and not self._closed:
            self._transport.write(bytes(self._buf))
            self._buf.clear()

    async def drain(self) -> None:
        """Wait until the transport takes data again (returns at once if it does, or if closed)."""
        if self._paused and not self._closed:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake()

    def close(self) -> None:
        """Stop writing (connection lost or closing); wakes every producer waiting in drain()."""
        self._closed = True
        self._buf.clear()
        self._wake()

    def _wake(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
