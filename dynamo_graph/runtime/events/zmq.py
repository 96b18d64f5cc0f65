"""Event plane over ZeroMQ PUB/SUB (the single-host default: no services to run).

Each publisher binds a PUB socket on a random port of one interface (127.0.0.1 unless told
otherwise; never all interfaces) and announces it in discovery under
`v1/event_channels/{namespace}/{component}/{publisher_id:x}` as `{"zmq": "tcp://host:port"}`,
attached to its process's lease. A subscriber watches that prefix and connects its SUB socket to
each publisher as it appears, and disconnects when its key goes (closed, or its process died).

With DYN_ZMQ_CURVE_KEY_FILE set (a graph with `security.tls` on sets it), every socket speaks
CURVE with the graph's key pair (curve.py): encrypted, and only the graph's processes connect.

Messages are multipart `[topic, publisher_id (u64 BE), seq (u64 BE), payload]`; ZMQ filters by
topic prefix on the publisher side. `seq` counts per publisher and topic, so a subscriber counts
what it missed (high-water marks are bounded on both ends and ZMQ drops silently beyond them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence

import zmq
import zmq.asyncio

from dynamo_graph.runtime.discovery.base import Discovery, DiscoveryError
from dynamo_graph.runtime.events.base import Event, EventPublisher, EventSubscriber
from dynamo_graph.runtime.events.common import ALL_INTERFACES, DEFAULT_MAX_PENDING, GapCounter, check_topics
from dynamo_graph.runtime.events.curve import CurveKeys
from dynamo_graph.runtime.names import EndpointName, NameError_, instance_id_from_key

log = logging.getLogger(__name__)

EVENT_CHANNELS_ROOT = "v1/event_channels"


def event_channels_prefix(namespace: str, component: str) -> str:
    """Discovery prefix of a channel's publishers; names are checked as in dyn:// names."""
    name = EndpointName.parse(f"{namespace}.{component}")
    if (name.namespace, name.component) != (namespace, component):
        raise NameError_(f"namespace {namespace!r} and component {component!r} must not contain '.'")
    return f"{EVENT_CHANNELS_ROOT}/{namespace}/{component}/"


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ZmqEventPublisher(EventPublisher):
    def __init__(self, sock: zmq.asyncio.Socket, discovery: Discovery, key: str, publisher_id: int) -> None:
        self.publisher_id = publisher_id
        self._sock = sock
        self._discovery = discovery
        self._key = key
        self._id_frame = publisher_id.to_bytes(8, "big")
        self._seqs: dict[str, int] = {}

    @classmethod
    async def create(
        cls,
        discovery: Discovery,
        namespace: str,
        component: str,
        publisher_id: int,
        *,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        sndhwm: int = DEFAULT_MAX_PENDING,
    ) -> ZmqEventPublisher:
        """Bind on `host` (one interface: loopback by default) and announce `advertise_host`
        (default `host`): for many machines, bind a routable address of this host."""
        if host in ALL_INTERFACES:
            raise ValueError(f"zmq event publisher: bind one interface, not {host!r} (all interfaces)")
        key = event_channels_prefix(namespace, component) + f"{publisher_id:x}"
        curve = CurveKeys.from_env()
        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.PUB)
        try:
            if curve is not None:
                curve.serve(sock, context)
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.bind(_tcp(host, "*"))
            port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
            endpoint = _tcp(advertise_host or host, port)
            await discovery.put(key, json.dumps({"zmq": endpoint}).encode())
        except BaseException:
            sock.close(linger=0)
            raise
        return cls(sock, discovery, key, publisher_id)

    async def publish(self, topic: str, payload: bytes) -> None:
        seq = self._seqs[topic] = self._seqs.get(topic, 0) + 1
        await self._sock.send_multipart([topic.encode(), self._id_frame, seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        """Withdraw the announcement first, so that subscribers disconnect rather than retry."""
        if self._sock.closed:
            return
        try:
            await self._discovery.delete(self._key)
        except DiscoveryError as exc:
            log.warning("zmq event publisher: could not withdraw %s: %s", self._key, exc)
        finally:
            self._sock.close(linger=0)


class ZmqEventSubscriber(EventSubscriber):
    def __init__(self, sock: zmq.asyncio.Socket, topics: tuple[str, ...]) -> None:
        self.topics = topics
        self._sock = sock
        self._gaps = GapCounter()
        self._endpoints: dict[int, str] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def dropped(self) -> int:
        """Events known lost (sequence gaps; a loss shows once that topic's publisher sends again)."""
        return self._gaps.missed

    @property
    def publishers(self) -> dict[int, str]:
        """The publishers this subscriber is connected to: id -> endpoint."""
        return dict(self._endpoints)

    @classmethod
    async def create(
        cls,
        discovery: Discovery,
        namespace: str,
        component: str,
        topics: Sequence[str],
        *,
        rcvhwm: int = DEFAULT_MAX_PENDING,
        env: Mapping[str, str] | None = None,
    ) -> ZmqEventSubscriber:
        """Connect to the publishers announced now before returning, then follow discovery. The
        CURVE key from `env` (default: this process's)."""
        prefix = event_channels_prefix(namespace, component)
        topics = check_topics(topics)
        curve = CurveKeys.from_env(env)
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        if curve is not None:
            curve.connect_as_member(sock)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        for topic in topics:
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self = cls(sock, topics)
        try:
            for key, value in (await discovery.get_prefix(prefix)).items():
                self._on_put(key, value)
        except BaseException:
            sock.close(linger=0)
            raise
        self._watch_task = asyncio.create_task(self._watch(discovery, prefix))
        return self

    async def _watch(self, discovery: Discovery, prefix: str) -> None:
        try:
            async for change in discovery.watch_prefix(prefix):
                if change.kind == "put" and change.value is not None:
                    self._on_put(change.key, change.value)
                else:
                    self._on_delete(change.key)
        except DiscoveryError as exc:
            log.error("zmq event subscriber: discovery watch of %s ended: %s", prefix, exc)

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            publisher_id = instance_id_from_key(key)
            endpoint = json.loads(value)["zmq"]
            if not isinstance(endpoint, str):
                raise TypeError(f"endpoint is {type(endpoint).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("zmq event subscriber: ignoring bad channel record %s: %s", key, exc)
            return
        old = self._endpoints.get(publisher_id)
        if old == endpoint:
            return
        if old is not None:
            self._sock.disconnect(old)
        self._sock.connect(endpoint)
        self._endpoints[publisher_id] = endpoint

    def _on_delete(self, key: str) -> None:
        try:
            publisher_id = instance_id_from_key(key)
        except ValueError:
            return
        endpoint = self._endpoints.pop(publisher_id, None)
        if endpoint is not None:
            self._sock.disconnect(endpoint)
        self._gaps.forget(publisher_id)

    async def events(self) -> AsyncIterator[Event]:
        while not self._closed:
            try:
                frames = await self._sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                # close() cancels a pending receive: end quietly unless this task was cancelled.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    return
                raise
            if len(frames) != 4 or len(frames[1]) != 8 or len(frames[2]) != 8:
                log.warning("zmq event subscriber: dropping a malformed message (%d frames)", len(frames))
                continue
            topic_frame, id_frame, seq_frame, payload = frames
            topic = topic_frame.decode(errors="replace")
            publisher_id = int.from_bytes(id_frame, "big")
            self._gaps.see(publisher_id, topic, int.from_bytes(seq_frame, "big"))
            yield Event(topic, payload, publisher_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        self._sock.close(linger=0)
