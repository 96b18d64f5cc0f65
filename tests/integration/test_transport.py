"""The request plane, the same suite over tcp and nats: content and order, one terminal frame,
typed errors, cancellation reaching the worker, dead workers, timeouts, many streams on one
connection, unregister and graceful stop. Workers run in a real subprocess where death or
isolation matters (tests/support/scripts/transport_worker.py), in-process elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.backend.errors import EngineError, EngineOverloaded, InvalidArgument
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.transport import (
    CannotConnect,
    EndpointNotFound,
    RequestPlaneClient,
    RequestPlaneServer,
    RequestTimeout,
    StreamBroken,
    create_client,
    create_server,
)
from dynamo_graph.runtime.transport.frames import Ack, Data, End, Error, Request, decode, encode
from tests.support.scripts.transport_worker import SUBJECT
from tests.support.waiting import wait_for_async

KINDS = ["tcp", "nats"]
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def nats_url(kind: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("nats_server").url if kind == "nats" else ""


def _options(kind: str, nats_url: str) -> dict[str, Any]:
    return {"url": nats_url} if kind == "nats" else {}


@dataclass
class Plane:
    """In-process servers and clients of one kind, all stopped when the test ends."""

    kind: str
    nats_url: str
    servers: list[RequestPlaneServer]
    clients: list[RequestPlaneClient]

    async def server(self, **kw: Any) -> RequestPlaneServer:
        server = create_server(self.kind, **_options(self.kind, self.nats_url), **kw)
        await server.start()
        self.servers.append(server)
        return server

    def client(self, **kw: Any) -> RequestPlaneClient:
        client = create_client(self.kind, **_options(self.kind, self.nats_url), **kw)
        self.clients.append(client)
        return client


@pytest.fixture
async def plane(kind: str, nats_url: str) -> AsyncIterator[Plane]:
    plane = Plane(kind, nats_url, [], [])
    yield plane
    for client in plane.clients:
        await client.close()
    for server in plane.servers:
        await server.stop()


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    record: dict[str, Any]
    log: Path

    def cancelled(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


def _spawn_worker(kind: str, nats_url: str, tmp: Path) -> Worker:
    record_file, log = tmp / "record.json", tmp / "cancel.log"
    cmd = [
        sys.executable,
        "-m",
        "tests.support.scripts.transport_worker",
        kind,
        str(record_file),
        "--log",
        str(log),
    ]
    if kind == "nats":
        cmd += ["--nats-url", nats_url]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while not record_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"transport worker did not start (exit {proc.poll()})")
        time.sleep(0.01)
    return Worker(proc, json.loads(record_file.read_text())["record"], log)


def _stop_worker(worker: Worker) -> None:
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGTERM)
        try:
            worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


@pytest.fixture(scope="module")
def shared_worker(kind: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One worker process per transport for the tests that do not kill it."""
    worker = _spawn_worker(kind, nats_url, tmp_path_factory.mktemp(f"worker-{kind}"))
    yield worker
    _stop_worker(worker)


@pytest.fixture
def own_worker(kind: str, nats_url: str, tmp_path: Path) -> Iterator[Worker]:
    """A worker process this test may kill."""
    worker = _spawn_worker(kind, nats_url, tmp_path)
    yield worker
    _stop_worker(worker)


def echo_request(n: int, delay_s: float = 0.0, tag: str = "") -> bytes:
    return json.dumps({"n": n, "delay_s": delay_s, "tag": tag}).encode()


def numbered(n: int) -> Callable[[bytes, dict[str, str], Context], AsyncIterator[bytes]]:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        for i in range(n):
            yield body + b":" + str(i).encode()

    return handler


async def collect(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in stream]


# ---------------------------------------------------------------------------------- content


async def test_stream_content_and_order(plane: Plane) -> None:
    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.e-1", numbered(300))
        client = plane.client()
        got = await collect(client.stream(record, "t.c.e-1", b"hello", {"h": "v"}, Context()))
        assert got == [b"hello:" + str(i).encode() for i in range(300)]
        assert await collect(client.stream(record, "t.c.e-1", b"again", {}, Context())) == [
            b"again:" + str(i).encode() for i in range(300)
        ]


async def _raw_frames(kind: str, nats_url: str, record: dict[str, Any], request: Request) -> list[Any]:
    """Every frame the worker sends for one request, read off the wire for 0.2 s after a
    terminal frame, so a second terminal would be seen."""
    frames: list[Any] = []
    if kind == "tcp":
        host, port = record["tcp"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = encode(request)
        writer.write(len(payload).to_bytes(4, "big") + payload)
        try:
            while True:
                async with asyncio.timeout(0.2 if any(type(f) in (End, Error) for f in frames) else 5):
                    size = int.from_bytes(await reader.readexactly(4), "big")
                    frames.append(decode(await reader.readexactly(size)))
        except TimeoutError:
            pass
        writer.close()
        return frames
    import nats

    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(record["nats"], encode(request), reply=inbox)
    try:
        while True:
            timeout = 0.2 if any(type(f) in (End, Error) for f in frames) else 5
            frames.append(decode((await sub.next_msg(timeout=timeout)).data))
    except Exception:
        pass
    await nc.close()
    return frames


@pytest.mark.parametrize("fails", [False, True])
async def test_exactly_one_terminal_frame(plane: Plane, fails: bool) -> None:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"
        if fails:
            raise InvalidArgument("nope", param="x")

    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.raw", handler)
        frames = await _raw_frames(plane.kind, plane.nats_url, record, Request(7, "t.c.raw", {}, b""))
        frames = [f for f in frames if type(f) is not Ack]
        assert [type(f) for f in frames] == [Data, Data, Error if fails else End]
        assert all(f.id == 7 for f in frames)


async def test_engine_errors_round_trip(plane: Plane) -> None:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        yield b"first"
        if body == b"invalid":
            raise InvalidArgument("temperature must be >= 0", param="temperature")
        raise RuntimeError("boom")

    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.err", handler)
        client = plane.client()
        got: list[bytes] = []
        with pytest.raises(InvalidArgument) as info:
            async for item in client.stream(record, "t.c.err", b"invalid", {}, Context()):
                got.append(item)
        assert got == [b"first"]
        assert (info.value.code, info.value.param, info.value.message) == (
            "invalid_argument",
            "temperature",
            "temperature must be >= 0",
        )
        with pytest.raises(EngineError) as info2:
            await collect(client.stream(record, "t.c.err", b"other", {}, Context()))
        assert info2.value.code == "internal" and "boom" in info2.value.message


async def test_context_id_reaches_worker(plane: Plane) -> None:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        yield context.id.encode()
        yield headers["x-trace"].encode()

    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.ctx", handler)
        got = await collect(
            plane.client().stream(record, "t.c.ctx", b"", {"x-trace": "t1"}, Context("req-42"))
        )
        assert got == [b"req-42", b"t1"]


# ---------------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("how", ["stop_generating", "aclose"])
async def test_cancel_reaches_worker_within_100ms(plane: Plane, shared_worker: Worker, how: str) -> None:
    async with asyncio.timeout(10):
        client = plane.client()
        context = Context()
        stream = client.stream(shared_worker.record, SUBJECT, echo_request(10_000, 0.01), {}, context)
        got = [await anext(stream) for _ in range(3)]
        assert got == [b":0", b":1", b":2"]
        if how == "stop_generating":
            context.stop_generating()
            assert await collect(stream) == []  # ends quietly
        else:
            await stream.aclose()  # type: ignore[attr-defined]
        elapsed = await wait_for_async(
            lambda: context.id in shared_worker.cancelled(),
            2,
            "the cancellation to reach the worker",
            poll=0.002,
        )
        assert elapsed < 0.1, f"cancel took {elapsed * 1000:.0f} ms to reach the worker"


async def test_cancel_stops_handler_in_process(plane: Plane) -> None:
    finished = asyncio.Event()

    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        try:
            while not context.is_stopped():
                yield b"tok"
                await asyncio.sleep(0.005)
        finally:
            finished.set()

    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.cancel", handler)
        async for _ in plane.client().stream(record, "t.c.cancel", b"", {}, Context()):
            break  # the consumer closes the stream early
        await asyncio.wait_for(finished.wait(), 1)


async def test_caller_gone_stops_worker_context(plane: Plane) -> None:
    """tcp: the lost connection kills the Context; nats: the keepalive's "no responders" probe
    does (within keepalive_s, 0.2 s here)."""
    stopped = asyncio.Event()

    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        yield b"first"
        await context.stopped()
        assert context.is_killed()
        stopped.set()

    async with asyncio.timeout(10):
        server = await plane.server(**({"keepalive_s": 0.2} if plane.kind == "nats" else {}))
        record = server.register("t.c.gone", handler)
        client = plane.client()
        stream = client.stream(record, "t.c.gone", b"", {}, Context())
        await anext(stream)
        await client.close()
        await asyncio.wait_for(stopped.wait(), 2)


# ---------------------------------------------------------------------------------- failures


async def test_worker_killed_mid_stream_is_stream_broken(plane: Plane, own_worker: Worker) -> None:
    """tcp notices at once (connection reset); nats after the client's silence window (3 s)."""
    async with asyncio.timeout(15):
        client = plane.client()
        stream = client.stream(own_worker.record, SUBJECT, echo_request(10_000, 0.01), {}, Context())
        await anext(stream)
        own_worker.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(StreamBroken):
            await collect(stream)
        elapsed = time.monotonic() - started
        limit = 0.5 if plane.kind == "tcp" else 3.0 + 1.0
        assert elapsed < limit, f"StreamBroken after {elapsed:.2f} s"
        # The kernel closes a killed process's sockets one by one: wait until it is gone, or the
        # reconnect below may still reach its listener for an instant (and then be reset).
        await asyncio.to_thread(own_worker.proc.wait, 5)
        # the next request to the same (now dead) address is a fresh connect attempt
        with pytest.raises(CannotConnect):
            await collect(client.stream(own_worker.record, SUBJECT, echo_request(1), {}, Context()))


async def test_dead_address_cannot_connect(plane: Plane) -> None:
    async with asyncio.timeout(10):
        if plane.kind == "tcp":
            server = await plane.server()
            record = {"tcp": server.register("x.y.z", numbered(1))["tcp"]}
            await server.stop()
        else:
            record = {"nats": "dynrp.0000000000000000.nobody.home"}
        started = time.monotonic()
        with pytest.raises(CannotConnect):
            await collect(plane.client().stream(record, "x.y.z", b"", {}, Context()))
        assert time.monotonic() - started < 1.0


async def test_unreachable_nats_server_cannot_connect() -> None:
    async with asyncio.timeout(10):
        client = create_client("nats", url="nats://127.0.0.1:1")
        with pytest.raises(CannotConnect):
            await collect(client.stream({"nats": "a.b"}, "a.b", b"", {}, Context()))
        await client.close()


async def test_silent_handler_times_out(plane: Plane) -> None:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        yield b"first"
        await context.stopped()

    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.slow", handler)
        got: list[bytes] = []
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            async for item in plane.client().stream(record, "t.c.slow", b"", {}, Context(), timeout_s=0.3):
                got.append(item)
        assert got == [b"first"]
        assert 0.25 < time.monotonic() - started < 1.5


async def test_many_concurrent_streams_one_connection(plane: Plane, shared_worker: Worker) -> None:
    async with asyncio.timeout(30):
        client = plane.client()

        async def one(i: int) -> list[bytes]:
            request = echo_request(20, 0.0, tag=f"s{i}")
            return await collect(client.stream(shared_worker.record, SUBJECT, request, {}, Context()))

        results = await asyncio.gather(*(one(i) for i in range(1000)))
        for i, got in enumerate(results):
            assert got == [f"s{i}:{j}".encode() for j in range(20)]


# ---------------------------------------------------------------------------------- lifecycle


def _slow(n: int, delay_s: float) -> Callable[[bytes, dict[str, str], Context], AsyncIterator[bytes]]:
    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        for i in range(n):
            await asyncio.sleep(delay_s)
            yield str(i).encode()

    return handler


async def test_unregister_refuses_new_requests_in_flight_finishes(plane: Plane) -> None:
    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.unreg", _slow(10, 0.02))
        client = plane.client()
        in_flight = asyncio.ensure_future(collect(client.stream(record, "t.c.unreg", b"", {}, Context())))
        await asyncio.sleep(0.05)
        server.unregister("t.c.unreg")
        with pytest.raises(EndpointNotFound) as info:
            await collect(client.stream(record, "t.c.unreg", b"", {}, Context()))
        assert info.value.code == "not_found"
        assert await in_flight == [str(i).encode() for i in range(10)]


async def test_stop_with_grace_lets_in_flight_finish(plane: Plane) -> None:
    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.stop", _slow(10, 0.02))
        in_flight = asyncio.ensure_future(
            collect(plane.client().stream(record, "t.c.stop", b"", {}, Context()))
        )
        await asyncio.sleep(0.05)
        await server.stop(grace_s=5)
        assert await in_flight == [str(i).encode() for i in range(10)]


async def test_stop_past_grace_breaks_streams(plane: Plane) -> None:
    async with asyncio.timeout(10):
        server = await plane.server()
        record = server.register("t.c.stop2", _slow(1000, 0.01))
        stream = plane.client().stream(record, "t.c.stop2", b"", {}, Context())
        await anext(stream)
        started = time.monotonic()
        await server.stop(grace_s=0.1)
        with pytest.raises(StreamBroken):
            await collect(stream)
        assert time.monotonic() - started < 1.0


# ---------------------------------------------------------------------------------- one transport


async def test_tcp_reconnects_after_connection_loss() -> None:
    async with asyncio.timeout(10):
        server = create_server("tcp")
        await server.start()
        record = server.register("t.c.re", numbered(3))
        client = create_client("tcp")
        assert len(await collect(client.stream(record, "t.c.re", b"", {}, Context()))) == 3
        port = int(record["tcp"].rsplit(":", 1)[1])
        await server.stop()
        server = create_server("tcp", port=port)
        await server.start()
        server.register("t.c.re", numbered(3))
        assert len(await collect(client.stream(record, "t.c.re", b"", {}, Context()))) == 3
        await client.close()
        await server.stop()


async def test_tcp_stream_limit_per_connection() -> None:
    async with asyncio.timeout(10):
        server = create_server("tcp", max_streams_per_connection=2)
        await server.start()
        record = server.register("t.c.lim", _slow(5, 0.05))
        client = create_client("tcp")
        first = [
            asyncio.ensure_future(collect(client.stream(record, "t.c.lim", b"", {}, Context())))
            for _ in range(2)
        ]
        await asyncio.sleep(0.02)
        with pytest.raises(EngineOverloaded):
            await collect(client.stream(record, "t.c.lim", b"", {}, Context()))
        assert [len(r) for r in await asyncio.gather(*first)] == [5, 5]
        await client.close()
        await server.stop()


async def test_tcp_slow_consumer_holds_the_producer_back() -> None:
    """A stalled consumer bounds what the worker produces (flow control end to end)."""
    produced = 0

    async def handler(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        nonlocal produced
        for _ in range(2000):
            produced += 1
            yield b"x" * 65536

    async with asyncio.timeout(20):
        server = create_server("tcp")
        await server.start()
        record = server.register("t.c.bp", handler)
        client = create_client("tcp", stream_buffer=8)
        stream = client.stream(record, "t.c.bp", b"", {}, Context())
        await anext(stream)
        await asyncio.sleep(0.3)
        assert produced < 500, f"{produced} frames of 64 KiB produced for a stalled consumer"
        assert 1 + len(await collect(stream)) == 2000
        await client.close()
        await server.stop()


async def test_nats_slow_consumer_fails_instead_of_buffering(nats_server: Any) -> None:
    nats_url = nats_server.url
    async with asyncio.timeout(10):
        server = create_server("nats", url=nats_url)
        await server.start()
        record = server.register("t.c.bp", numbered(1000))
        client = create_client("nats", url=nats_url, stream_buffer=16)
        stream = client.stream(record, "t.c.bp", b"", {}, Context())
        await anext(stream)
        await asyncio.sleep(0.3)
        with pytest.raises(StreamBroken):
            await collect(stream)
        await client.close()
        await server.stop()


# ---------------------------------------------------------------------------------- factory


def test_factory_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_REQUEST_PLANE", "carrier-pigeon")
    with pytest.raises(ValueError, match=r"DYN_REQUEST_PLANE='carrier-pigeon'.*tcp, nats"):
        create_server()
    with pytest.raises(ValueError, match="DYN_REQUEST_PLANE"):
        create_client()
    with pytest.raises(ValueError, match="tcp, nats"):
        create_client("udp")


def test_factory_reads_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_graph.runtime.transport.nats import NatsRequestPlaneClient
    from dynamo_graph.runtime.transport.tcp import TcpRequestPlaneServer

    monkeypatch.setenv("DYN_REQUEST_PLANE", "nats")
    monkeypatch.setenv("NATS_SERVER", "nats://10.0.0.1:4222")
    client = create_client()
    assert isinstance(client, NatsRequestPlaneClient) and client.url == "nats://10.0.0.1:4222"
    monkeypatch.delenv("DYN_REQUEST_PLANE")
    monkeypatch.setenv("DYN_TCP_HOST", "0.0.0.0")
    monkeypatch.setenv("DYN_TCP_ADVERTISE_HOST", "10.1.2.3")
    server = create_server()
    assert isinstance(server, TcpRequestPlaneServer)
    assert (server.host, server.advertise_host) == ("0.0.0.0", "10.1.2.3")
    assert os.environ["DYN_TCP_HOST"] == "0.0.0.0"
