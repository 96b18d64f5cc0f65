"""The event plane on each backend (inproc, zmq over file discovery, NATS): ordering per publisher,
topic filtering, publishers coming and going, slow subscribers dropping (counted) instead of
blocking publishers, and a 10k burst. zmq and NATS publishers also run as real child processes.

zmq connects asynchronously (the "slow joiner"): events published before a subscriber's socket is
connected are lost by design, so tests first ping on a `sync` topic until one gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from dynamo_graph.runtime.discovery.file import FileDiscovery
from dynamo_graph.runtime.events import (
    EVENT_PLANE_ENV,
    Event,
    EventPublisher,
    EventSubscriber,
    InProcEventBus,
    create_event_publisher,
    create_event_subscriber,
    event_plane_kind,
    zmq_addresses,
)
from dynamo_graph.runtime.events.nats import NatsEventSubscriber
from dynamo_graph.runtime.events.zmq import ZmqEventPublisher, ZmqEventSubscriber, event_channels_prefix
from tests.support.services import NatsProc

NS, COMP = "evtest", "worker"
SYNC = "sync"
REPO = Path(__file__).resolve().parents[2]
TTL_S, POLL_S = 1.0, 0.05  # file discovery: a killed publisher's key goes within about a second

# A publisher in its own process: pings on SYNC until told "go", sends `count` kv events, reports
# "sent", then exits when its stdin closes (or is killed).
CHILD = f"""
import asyncio, sys
from pathlib import Path
from dynamo_graph.runtime.events import create_event_publisher

async def main(kind, where, publisher_id, count):
    discovery = None
    if kind == "zmq":
        from dynamo_graph.runtime.discovery.file import FileDiscovery
        discovery = FileDiscovery(Path(where), ttl_s={TTL_S!r}, poll_s={POLL_S!r})
        await discovery.start()
    pub = await create_event_publisher(kind, discovery=discovery, namespace={NS!r},
        component={COMP!r}, publisher_id=publisher_id, nats_url=where)
    go = asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
    while not go.done():
        await pub.publish({SYNC!r}, b"")
        await asyncio.sleep(0.02)
    for i in range(count):
        await pub.publish("kv_events", i.to_bytes(4, "big"))
    print("sent", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await pub.close()
    if discovery is not None:
        await discovery.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3], 16), int(sys.argv[4])))
"""


class Inbox:
    """A subscriber's events, read by a background task so that tests can wait under timeouts
    (cancelling a pending read would end the subscriber's async generator). SYNC pings are
    recorded apart. `pause()` stops reading, to play a slow subscriber. Waits are bounded by
    each test's `asyncio.timeout`."""

    def __init__(self, sub: EventSubscriber) -> None:
        self.sub = sub
        self.synced: set[int] = set()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._sync_seen = asyncio.Event()
        self._reading = asyncio.Event()
        self._reading.set()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for event in self.sub.events():
            await self._reading.wait()
            if event.topic == SYNC:
                self.synced.add(event.publisher_id)
                self._sync_seen.set()
            else:
                self._queue.put_nowait(event)

    def pause(self) -> None:
        self._reading.clear()

    def resume(self) -> None:
        self._reading.set()

    async def wait_synced(self, publisher_ids: set[int]) -> None:
        while not publisher_ids <= self.synced:
            self._sync_seen.clear()
            await self._sync_seen.wait()

    async def sync(self, pub: EventPublisher) -> None:
        """Ping from `pub` until a ping arrives: from then on nothing it sends is lost."""
        publisher_id = pub.publisher_id
        while publisher_id not in self.synced:
            await pub.publish(SYNC, b"")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait_synced({publisher_id}), 0.05)

    async def take(self, n: int) -> list[Event]:
        return [await self._queue.get() for _ in range(n)]

    async def quiet(self, for_s: float = 0.3) -> list[Event]:
        """Everything that arrives until nothing has for `for_s`."""
        got: list[Event] = []
        while True:
            try:
                got.append(await asyncio.wait_for(self._queue.get(), for_s))
            except TimeoutError:
                return got

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.sub.close()


class Plane:
    """One backend, set up the way a process would use it (through the factory), plus bounded
    variants made directly for the slow-subscriber test."""

    def __init__(self, kind: str, discovery: FileDiscovery | None, where: str) -> None:
        self.kind = kind
        self.discovery = discovery
        self.where = where  # the discovery root (zmq) or the NATS URL
        self.bus = InProcEventBus()
        self._closers: list[EventPublisher | Inbox] = []

    async def publisher(self, publisher_id: int, *, bound: int | None = None) -> EventPublisher:
        if bound is not None and self.kind == "zmq":
            assert self.discovery is not None
            pub: EventPublisher = await ZmqEventPublisher.create(
                self.discovery, NS, COMP, publisher_id, sndhwm=bound
            )
        else:
            pub = await create_event_publisher(
                self.kind,
                discovery=self.discovery,
                namespace=NS,
                component=COMP,
                publisher_id=publisher_id,
                nats_url=self.where,
                bus=self.bus,
            )
        self._closers.append(pub)
        return pub

    async def inbox(self, topics: Sequence[str], *, bound: int | None = None) -> Inbox:
        topics = [*topics, SYNC]
        sub: EventSubscriber
        if bound is None:
            sub = await create_event_subscriber(
                self.kind,
                discovery=self.discovery,
                namespace=NS,
                component=COMP,
                topics=topics,
                nats_url=self.where,
                bus=self.bus,
            )
        elif self.kind == "inproc":
            sub = self.bus.subscriber(topics, max_pending=bound)
        elif self.kind == "zmq":
            assert self.discovery is not None
            sub = await ZmqEventSubscriber.create(self.discovery, NS, COMP, topics, rcvhwm=bound)
        else:
            sub = await NatsEventSubscriber.create(self.where, NS, COMP, topics, max_pending=bound)
        inbox = Inbox(sub)
        self._closers.append(inbox)
        return inbox

    async def close(self) -> None:
        for item in reversed(self._closers):
            await item.close()


class ChildPublisher:
    """A publisher in a child process (see CHILD), driven through its stdin and stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, publisher_id: int) -> None:
        self.proc = proc
        self.publisher_id = publisher_id

    @classmethod
    async def start(cls, plane: Plane, publisher_id: int, count: int) -> ChildPublisher:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            plane.kind,
            plane.where,
            f"{publisher_id:x}",
            str(count),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        return cls(proc, publisher_id)

    async def go(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()
        assert await asyncio.wait_for(self.proc.stdout.readline(), 10) == b"sent\n"

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()


async def _plane(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Plane]:
    discovery = None
    where = ""
    if request.param == "zmq":
        where = str(tmp_path / "discovery")
        discovery = FileDiscovery(Path(where), ttl_s=TTL_S, poll_s=POLL_S)
        await discovery.start()
    elif request.param == "nats":
        where = request.getfixturevalue("nats_server").url
    p = Plane(request.param, discovery, where)
    yield p
    await p.close()
    if discovery is not None:
        await discovery.close()


plane = pytest.fixture(params=["inproc", "zmq", "nats"])(_plane)
# Backends whose publishers run in other processes (what a kill -9 test needs).
process_plane = pytest.fixture(params=["zmq", "nats"])(_plane)


def _numbers(events: Sequence[Event]) -> list[int]:
    return [int.from_bytes(e.payload, "big") for e in events]


async def test_order_per_publisher_and_topic_filter(plane: Plane) -> None:
    async with asyncio.timeout(10):
        inbox = await plane.inbox(["kv"])
        pub = await plane.publisher(0x1)
        await inbox.sync(pub)
        topics = ("kv_events", "metrics", "kv.stored blocks")  # the last needs sanitizing on NATS
        for i in range(300):
            await pub.publish(topics[i % 3], i.to_bytes(4, "big"))
        await pub.publish("kv_events", b"end")
        got = await inbox.take(201)
        expected = [(topics[i % 3], i) for i in range(300) if i % 3 != 1]
        assert [(e.topic, int.from_bytes(e.payload, "big")) for e in got[:-1]] == expected
        assert got[-1].payload == b"end"  # and no "metrics" event came in between
        assert {e.publisher_id for e in got} == {0x1}
        assert inbox.sub.dropped == 0


async def test_two_publishers_reach_one_subscriber(plane: Plane) -> None:
    """On zmq and NATS each publisher is its own process."""
    count, ids = 500, {0xA, 0xB0000000000001}
    async with asyncio.timeout(15):
        inbox = await plane.inbox(["kv"])
        if plane.kind == "inproc":
            pubs = [await plane.publisher(i) for i in ids]
            for i in range(count):
                for pub in pubs:
                    await pub.publish("kv_events", i.to_bytes(4, "big"))
        else:
            children = [await ChildPublisher.start(plane, i, count) for i in ids]
            try:
                await inbox.wait_synced(ids)
                await asyncio.gather(*(child.go() for child in children))
            finally:
                await asyncio.gather(*(child.stop() for child in children))
        got = await inbox.take(2 * count)
        for publisher_id in ids:
            assert _numbers([e for e in got if e.publisher_id == publisher_id]) == list(range(count))


async def test_publisher_after_subscriber_is_picked_up(plane: Plane) -> None:
    async with asyncio.timeout(10):
        inbox = await plane.inbox(["kv"])
        await asyncio.sleep(0.2)  # the subscriber is already watching when the publisher comes
        started = time.monotonic()
        pub = await plane.publisher(0x3)
        await inbox.sync(pub)
        assert time.monotonic() - started < 1.0
        for i in range(10):
            await pub.publish("kv_events", i.to_bytes(4, "big"))
        assert _numbers(await inbox.take(10)) == list(range(10))


async def test_killed_publisher_goes_away_without_breaking_subscriber(process_plane: Plane) -> None:
    plane = process_plane
    count, dead, alive = 100, 0xDEAD, 0xA11CE
    async with asyncio.timeout(15):
        inbox = await plane.inbox(["kv"])
        victim = await ChildPublisher.start(plane, dead, count)
        survivor = await ChildPublisher.start(plane, alive, count)
        try:
            await inbox.wait_synced({dead, alive})
            await victim.kill()
            if plane.kind == "zmq":
                assert plane.discovery is not None
                sub = inbox.sub
                assert isinstance(sub, ZmqEventSubscriber)
                # Its lease expires and discovery deletes its channel; nothing to await but that.
                while dead in sub.publishers:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                channels = await plane.discovery.get_prefix(event_channels_prefix(NS, COMP))
                assert [k.rsplit("/", 1)[1] for k in channels] == [f"{alive:x}"]
            await survivor.go()
            got = await inbox.take(count)
        finally:
            await survivor.stop()
        assert {e.publisher_id for e in got} == {alive}
        assert _numbers(got) == list(range(count))


@pytest.mark.serial  # times itself: run alone, not beside other test workers
async def test_slow_subscriber_drops_counted_without_blocking_publisher(plane: Plane) -> None:
    """Buffers hold 100 events (plus, on zmq/NATS, what the sockets hold): 20k events of 1 kB
    cannot all wait, so the subscriber loses some; the publisher runs at full speed regardless.
    A last event on the same topic reveals the loss at the tail, so the count is exact."""
    total, payload = 20_000, bytes(1000)
    async with asyncio.timeout(20):
        inbox = await plane.inbox(["kv"], bound=100)
        pub = await plane.publisher(0x5, bound=100)
        await inbox.sync(pub)
        inbox.pause()
        started = time.monotonic()
        for _ in range(total):
            await pub.publish("kv_events", payload)
        assert time.monotonic() - started < 5.0
        await asyncio.sleep(0.2)  # let the transports fill up
        inbox.resume()
        got = await inbox.quiet()
        await pub.publish("kv_events", b"end")
        got += await inbox.take(1)
        dropped: int = inbox.sub.dropped
        assert got[-1].payload == b"end"
        assert dropped > 0
        assert len(got) + dropped == total + 1
        if isinstance(inbox.sub, NatsEventSubscriber):
            assert inbox.sub.slow_consumer_drops == dropped


async def test_burst_of_10k_events_arrives_in_order(plane: Plane) -> None:
    total = 10_000
    async with asyncio.timeout(15):
        inbox = await plane.inbox(["kv"])
        pub = await plane.publisher(0x10)
        await inbox.sync(pub)
        started = time.monotonic()
        for i in range(total):
            await pub.publish("kv_events", i.to_bytes(4, "big"))
        got = await inbox.take(total)
        elapsed = time.monotonic() - started
        assert _numbers(got) == list(range(total))
        assert inbox.sub.dropped == 0
        assert elapsed < 5.0, f"{total} events took {elapsed:.2f}s on {plane.kind}"


def test_event_plane_kind_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_PLANE_ENV, raising=False)
    assert event_plane_kind() == "zmq"
    assert event_plane_kind("nats") == "nats"
    monkeypatch.setenv(EVENT_PLANE_ENV, "inproc")
    assert event_plane_kind() == "inproc"
    monkeypatch.setenv(EVENT_PLANE_ENV, "kafka")
    with pytest.raises(ValueError, match=r"DYN_EVENT_PLANE='kafka'.*inproc, zmq, nats"):
        event_plane_kind()
    with pytest.raises(ValueError, match="expected one of"):
        event_plane_kind("tcp")


async def test_zmq_publisher_binds_and_announces_the_request_plane_s_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of a multi-host graph gets its host's address as DYN_TCP_HOST /
    DYN_TCP_ADVERTISE_HOST: zmq binds that interface (here 127.0.0.2, not 127.0.0.1) and announces
    it, and a subscriber gets events through it."""
    monkeypatch.setenv("DYN_TCP_HOST", "0.0.0.0")
    monkeypatch.delenv("DYN_TCP_ADVERTISE_HOST", raising=False)
    with pytest.raises(ValueError, match=r"'0\.0\.0\.0' \(all interfaces\).*DYN_TCP_ADVERTISE_HOST"):
        zmq_addresses()
    monkeypatch.setenv("DYN_TCP_ADVERTISE_HOST", "127.0.0.2")
    assert zmq_addresses() == ("127.0.0.2", "127.0.0.2")  # one interface, never all
    monkeypatch.setenv("DYN_TCP_HOST", "127.0.0.2")
    discovery = FileDiscovery(tmp_path / "discovery", ttl_s=TTL_S, poll_s=POLL_S)
    await discovery.start()
    plane = Plane("zmq", discovery, str(tmp_path / "discovery"))
    try:
        async with asyncio.timeout(10):
            inbox = await plane.inbox(["kv"])
            pub = await plane.publisher(0x7)
            record = await discovery.get_prefix(event_channels_prefix(NS, COMP))
            assert [json.loads(v)["zmq"].rpartition(":")[0] for v in record.values()] == ["tcp://127.0.0.2"]
            await inbox.sync(pub)
            await pub.publish("kv_events", b"stored")
            assert [e.payload for e in await inbox.take(1)] == [b"stored"]
    finally:
        await plane.close()
        await discovery.close()


async def test_nats_publisher_and_subscriber_survive_a_server_restart(nats_fresh: NatsProc) -> None:
    server = nats_fresh
    plane = Plane("nats", None, server.url)
    try:
        async with asyncio.timeout(15):
            inbox = await plane.inbox(["kv"])
            pub = await plane.publisher(0x7)
            await inbox.sync(pub)
            await asyncio.to_thread(server.restart)  # same port
            inbox.synced.clear()
            await inbox.sync(pub)  # both ends reconnected (pings sent while down are lost)
            await pub.publish("kv_events", b"after")
            assert (await inbox.take(1))[0].payload == b"after"
    finally:
        await plane.close()
        server.stop()
