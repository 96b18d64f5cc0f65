"""The nats request plane: requests published to a subject per endpoint instance, responses
streamed back to the caller's inbox. For multi-host deployments where workers are not
directly reachable, or where NATS is already the event plane.

Subjects. A worker process subscribes once, at start(), to `dynrp.<process token>.>`; an
endpoint instance registered as `ns.comp.ep-<hex>` is served at
`dynrp.<process token>.ns.comp.ep-<hex>` (sanitized for NATS) and that whole subject is the
record, {"nats": subject}. One wildcard subscription makes `register` / `unregister` take
effect at once (they are synchronous), with no SUB round trip per endpoint.

A caller process subscribes once to `<inbox>.*` and sends each request with reply
`<inbox>.<n>`; frames for `<inbox>.<n>` belong to stream n.

Protocol, per request (frames of frames.py, msgpack):
- caller -> `subject`: `Request`, reply = its stream inbox.
- worker -> inbox: `Ack` at once, then `Data`..., then one `End` or `Error`.
  NATS cannot tell a caller that a worker died, so the worker also sends `Keepalive` every
  `keepalive_s` (1 s) to each stream, and the caller treats `silence_s` (3 s) without any
  frame as StreamBroken. Without a subscriber on the subject, the server answers with a
  "no responders" status: CannotConnect at once; no `Ack` within `ack_timeout_s` is
  CannotConnect too ("nobody took it", not "slow engine").
- caller -> `subject`: `Cancel`, reply = the same stream inbox, when its Context stops or
  it closes the stream; the worker finds the stream by that inbox.
- Keepalives are published with a reply subject of the worker's own (`<worker inbox>.<n>`):
  if the caller's process is gone its inbox has no subscriber, the server answers that reply
  with "no responders", and the worker kills the stream's Context, as tcp does on a lost
  connection.

Buffers are bounded: the caller's inbox subscription has `pending_msgs_limit`; a stream whose
consumer falls `stream_buffer` frames behind fails with StreamBroken (and is cancelled)
instead of growing memory. If nats-py reports the inbox subscription as a slow consumer,
frames were dropped, so every stream in flight fails with StreamBroken.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dynamo_graph.redact import redact_url
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.credentials import nats_connect_options
from dynamo_graph.runtime.transport.base import (
    CannotConnect,
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    RequestTimeout,
    StreamBroken,
)
from dynamo_graph.runtime.transport.frames import (
    Ack,
    Cancel,
    Data,
    End,
    Error,
    Frame,
    Keepalive,
    Request,
    decode,
    encode,
    error_from_frame,
)
from dynamo_graph.runtime.transport.streams import ClientStream, HandlerTasks, ServerStream, run_handler

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-.]")


def sanitize_subject(subject: str) -> str:
    """A valid NATS subject from an endpoint subject: no wildcards, spaces or empty tokens."""
    tokens = [token for token in _UNSAFE.sub("_", subject).split(".") if token]
    if not tokens:
        raise ValueError(f"subject {subject!r} has no usable characters")
    return ".".join(tokens)


def _is_no_responders(msg: Msg) -> bool:
    headers = msg.headers
    return headers is not None and headers.get("Status") == _NO_RESPONDERS


async def _connect(url: str, name: str, **options: Any) -> NatsClient:
    """Connect, failing within about a second when NATS is unreachable, then keep reconnecting
    forever once connected (nats-py applies one attempt limit to both phases)."""
    try:
        nc = await nats.connect(
            url,
            name=name,
            connect_timeout=2,
            reconnect_time_wait=0.5,
            max_reconnect_attempts=1,
            **nats_connect_options(),
            **options,
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise CannotConnect(f"cannot connect to NATS at {redact_url(url)}: {exc!r}") from exc
    nc.options["max_reconnect_attempts"] = -1
    return nc


# --------------------------------------------------------------------------- worker side


class _NatsServerStream(ServerStream):
    """A stream is addressed by the caller's inbox and probed through the worker's `probe`."""

    __slots__ = ("frame_id", "inbox", "probe")

    def __init__(self, context: Context, inbox: str, frame_id: int, probe: str) -> None:
        super().__init__(context)
        self.inbox = inbox
        self.frame_id = frame_id
        self.probe = probe


class NatsRequestPlaneServer(RequestPlaneServer):
    """Serves this process's endpoint instances on NATS subjects (see the module docstring)."""

    def __init__(
        self, url: str = "nats://127.0.0.1:4222", *, keepalive_s: float = 1.0, cancel_grace_s: float = 2.0
    ) -> None:
        self.url = url
        self.keepalive_s = keepalive_s
        self.cancel_grace_s = cancel_grace_s
        self.prefix = f"dynrp.{secrets.token_hex(8)}"
        self._nc: NatsClient | None = None
        self._subs: list[Subscription] = []
        self._handlers: dict[str, Handler] = {}
        self._streams: dict[str, _NatsServerStream] = {}  # by caller inbox
        self._probes: dict[str, _NatsServerStream] = {}  # by worker probe subject
        self._tasks = HandlerTasks()
        self._keepalive: asyncio.Task[None] | None = None
        self._probe_prefix = ""
        self._next_probe = 0
        self._stopping = False

    async def start(self) -> None:
        nc = self._nc = await _connect(self.url, f"dyngraph-worker-{self.prefix}")
        self._probe_prefix = nc.new_inbox()
        self._subs = [
            await nc.subscribe(f"{self.prefix}.>", cb=self._on_request, pending_msgs_limit=65536),
            await nc.subscribe(f"{self._probe_prefix}.*", cb=self._on_probe_reply, pending_msgs_limit=65536),
        ]
        await nc.flush()
        self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())

    def register(self, subject: str, handler: Handler) -> dict[str, Any]:
        if self._nc is None:
            raise RuntimeError("NatsRequestPlaneServer.register() before start()")
        full = f"{self.prefix}.{sanitize_subject(subject)}"
        self._handlers[full] = handler
        return {"nats": full}

    def unregister(self, subject: str) -> None:
        self._handlers.pop(f"{self.prefix}.{sanitize_subject(subject)}", None)

    async def stop(self, grace_s: float = 0.0) -> None:
        self._stopping = True
        nc = self._nc
        if nc is None:
            return
        if self._subs:
            await self._subs[0].unsubscribe()  # new requests now get "no responders"
        await self._tasks.wait(grace_s)
        doomed = list(self._streams.values())  # their tasks remove them as they end
        await self._tasks.end(doomed)
        if self._keepalive is not None:
            self._keepalive.cancel()
        for stream in doomed:  # tell callers now, rather than after silence_s (-> StreamBroken)
            if not stream.stopped:
                await nc.publish(
                    stream.inbox, encode(Error(stream.frame_id, "disconnected", "worker shut down"))
                )
        await nc.close()
        self._nc = None

    async def _on_request(self, msg: Msg) -> None:
        nc = self._nc
        inbox = msg.reply
        if nc is None or not inbox:
            return
        try:
            frame = decode(msg.data)
        except Exception:
            log.warning("dropping undecodable request-plane message on %s", msg.subject)
            return
        if type(frame) is Cancel:
            stream = self._streams.get(inbox)
            if stream is not None:
                stream.stop(self.cancel_grace_s, killed=False)
            return
        if type(frame) is not Request:
            return
        handler = self._handlers.get(msg.subject)
        if handler is None or self._stopping or inbox in self._streams:
            why = "is shutting down" if self._stopping else "is not served here"
            await nc.publish(inbox, encode(Error(frame.id, "not_found", f"endpoint {msg.subject!r} {why}")))
            return
        self._next_probe += 1
        probe = f"{self._probe_prefix}.{self._next_probe}"
        stream = _NatsServerStream(Context(frame.request_id or None), inbox, frame.id, probe)
        self._streams[inbox] = stream
        self._probes[probe] = stream
        await nc.publish(inbox, encode(Ack(frame.id)))
        self._tasks.start(stream, self._serve(nc, stream, handler, frame))

    async def _on_probe_reply(self, msg: Msg) -> None:
        stream = self._probes.get(msg.subject)
        if stream is not None and _is_no_responders(msg):
            stream.stop(self.cancel_grace_s, killed=True)  # the caller's inbox is gone

    async def _serve(
        self, nc: NatsClient, stream: _NatsServerStream, handler: Handler, frame: Request
    ) -> None:
        """Run one handler; the terminal frame is not sent to a caller that cancelled or is gone."""
        inbox = stream.inbox

        def send(frame: Frame) -> Awaitable[None]:
            return nc.publish(inbox, encode(frame))

        try:
            terminal = await run_handler(stream, handler, frame, send)
        finally:
            self._streams.pop(inbox, None)
            self._probes.pop(stream.probe, None)
        if not stream.stopped and not nc.is_closed:
            await nc.publish(inbox, encode(terminal))

    async def _keepalive_loop(self) -> None:
        """Every keepalive_s, one Keepalive per open stream (which also probes the caller)."""
        while True:
            await asyncio.sleep(self.keepalive_s)
            nc = self._nc
            if nc is None or not nc.is_connected:
                continue
            for stream in list(self._streams.values()):
                if not stream.stopped:
                    await nc.publish(stream.inbox, encode(Keepalive(stream.frame_id)), reply=stream.probe)


# --------------------------------------------------------------------------- caller side


class _NatsClientStream(ClientStream):
    __slots__ = ("acked", "last_any", "last_data")

    def __init__(self, now: float) -> None:
        super().__init__()
        self.acked = False
        self.last_any = now
        self.last_data = now


class NatsRequestPlaneClient(RequestPlaneClient):
    """Streams requests to workers through NATS (see the module docstring for the protocol)."""

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        ack_timeout_s: float = 2.0,
        silence_s: float = 3.0,
        stream_buffer: int = 4096,
    ) -> None:
        self.url = url
        self.ack_timeout_s = ack_timeout_s
        self.silence_s = silence_s
        self.stream_buffer = stream_buffer
        self._nc: NatsClient | None = None
        self._inbox = ""
        self._sub: Subscription | None = None
        self._connecting: asyncio.Lock | None = None
        self._streams: dict[str, _NatsClientStream] = {}
        self._next_id = 0

    async def _connection(self) -> NatsClient:
        if self._nc is not None:
            return self._nc
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._nc is None:
                nc = await _connect(self.url, "dyngraph-client", error_cb=self._on_error)
                inbox = nc.new_inbox()
                self._sub = await nc.subscribe(
                    f"{inbox}.*",
                    cb=self._on_frame,
                    pending_msgs_limit=65536,
                    pending_bytes_limit=64 * 1024 * 1024,
                )
                self._inbox = inbox
                self._nc = nc
        return self._nc

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError) and exc.sub is self._sub:
            for stream in self._streams.values():
                stream.fail(StreamBroken("response frames were dropped (slow consumer)"))
        else:
            log.warning("nats request plane: %r", exc)

    async def _on_frame(self, msg: Msg) -> None:
        stream = self._streams.get(msg.subject)
        if stream is None:
            return
        now = asyncio.get_running_loop().time()
        stream.last_any = now
        if _is_no_responders(msg):
            stream.fail(CannotConnect("no worker is subscribed to this endpoint (no responders)"))
            return
        try:
            frame = decode(msg.data)
        except Exception:
            stream.fail(StreamBroken(f"undecodable response frame on {msg.subject}"))
            return
        kind = type(frame)
        if kind is Keepalive:
            return
        if kind is Ack:
            stream.acked = True
            return
        stream.last_data = now
        if len(stream.frames) >= self.stream_buffer:
            stream.fail(StreamBroken(f"consumer fell {self.stream_buffer} frames behind"))
            return
        stream.frames.append(frame)
        stream.wake()

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
        target = transport["nats"]
        nc = await self._connection()
        loop = asyncio.get_running_loop()
        self._next_id += 1
        fid = self._next_id
        inbox = f"{self._inbox}.{fid}"
        stream = self._streams[inbox] = _NatsClientStream(loop.time())
        watcher = asyncio.ensure_future(context.stopped())
        watcher.add_done_callback(lambda _: stream.wake())
        frames = stream.frames
        finished = False
        try:
            await nc.publish(target, encode(Request(fid, subject, headers, payload, context.id)), reply=inbox)
            while True:
                if context.is_stopped():
                    return
                if not frames:
                    if stream.failure is not None:
                        raise stream.failure
                    await self._wait(loop, stream, timeout_s)
                    continue
                frame = frames.popleft()
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
            del self._streams[inbox]
            if not finished and nc.is_connected:
                await nc.publish(target, encode(Cancel(fid)), reply=inbox)

    def _wait(
        self, loop: asyncio.AbstractEventLoop, stream: _NatsClientStream, timeout_s: float | None
    ) -> asyncio.Future[None]:
        """A future set by the next frame, or by the first deadline that passes (no ack,
        silence, no data within timeout_s), which fails the stream."""
        waiter = stream.waiter = loop.create_future()
        ack_by = stream.last_any + self.ack_timeout_s if not stream.acked else None

        def check() -> None:
            if waiter.done():
                return
            now = loop.time()
            deadlines: list[float] = []
            if not stream.acked and ack_by is not None:
                if now >= ack_by:
                    return stream.fail(
                        CannotConnect(f"no worker took the request within {self.ack_timeout_s:g} s")
                    )
                deadlines.append(ack_by)
            if now - stream.last_any >= self.silence_s:
                return stream.fail(StreamBroken(f"worker silent for {self.silence_s:g} s (gone?)"))
            deadlines.append(stream.last_any + self.silence_s)
            if timeout_s is not None:
                if now - stream.last_data >= timeout_s:
                    return stream.fail(RequestTimeout(f"no response frame within {timeout_s:g} s"))
                deadlines.append(stream.last_data + timeout_s)
            timer = loop.call_at(min(deadlines), check)
            waiter.add_done_callback(lambda _: timer.cancel())

        check()
        return waiter

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            for stream in self._streams.values():
                stream.fail(StreamBroken("request plane client closed"))
            await nc.close()
