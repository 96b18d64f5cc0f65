"""The load generator: streamed OpenAI-style requests over raw asyncio HTTP/1.1 sockets.

Client and server often share a small machine, so the client spends as little CPU as it can:
request bytes are built once before the clock starts, and `stream.py` reads each response in
whatever blocks the socket holds (benchmarks/bench_loadgen.py: less CPU per stream than the
bare floor server spends sending it). Two shapes of load, both bounded in count and time:

- closed loop (`run_closed`): `concurrency` users, each sending its next request when the
  previous one ends;
- open loop (`run_open`): every request at its own time (`Request.at`: Poisson arrivals or a
  trace's timestamps), whether or not earlier ones have finished.

No new request starts after `max_seconds`; one in flight is given up after `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from dynamo_graph.bench.stream import Result, read_response

_encode = msgspec.json.encode


@dataclass(frozen=True)
class Target:
    """Where requests go: `host:port` and the route (`/v1/completions`, `/v1/chat/completions`...)."""

    host: str
    port: int
    path: str
    keep_alive: bool = True
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Request:
    """One request of a workload: its JSON body, and when an open loop sends it (seconds from
    the start; ignored by a closed loop)."""

    body: dict
    at: float = 0.0


def encode_request(target: Target, body: dict) -> bytes:
    """The whole HTTP request, built once so that sending it costs one write."""
    payload = _encode(body)
    extra = "".join(f"{k}: {v}\r\n" for k, v in target.headers)
    head = (
        f"POST {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
        f"Content-Length: {len(payload)}\r\n"
        f"Connection: {'keep-alive' if target.keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode() + payload


# uvicorn closes a connection idle for 5 s; reusing one that old races its close (the client
# would see the server's FIN instead of an answer, and count a request lost that never arrived).
MAX_IDLE_S = 3.0


class Connections:
    """Kept-alive connections to the target, reused by whoever sends next (while fresh)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            reader, writer, since = self.idle.pop()
            if now - since < MAX_IDLE_S:
                return reader, writer
            writer.close()
        reader, writer = await asyncio.open_connection(self.target.host, self.target.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def give(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], reusable: bool) -> None:
        if reusable and self.target.keep_alive:
            self.idle.append((*conn, time.monotonic()))
        else:
            conn[1].close()

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()


async def send(conns: Connections, wire: bytes, result: Result, clock0: float, timeout_s: float) -> Result:
    """One request on a kept-alive (or new) connection, its stream read into `result`; errors are
    recorded there, never raised. For loads of another shape (multi-turn conversations)."""
    conn = None
    try:
        conn = await asyncio.wait_for(conns.take(), timeout_s)
        start = time.perf_counter()
        result.start = start - clock0
        conn[1].write(wire)
        reusable = await asyncio.wait_for(read_response(conn[0], start, result), timeout_s)
        result.total = time.perf_counter() - start
        conns.give(conn, reusable)
        conn = None
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        result.error = result.error or why
        result.ok = False
        if result.start and not result.total:
            result.total = time.perf_counter() - clock0 - result.start
    finally:
        if conn is not None:
            conn[1].close()
    return result


OnResult = Callable[[Result], None]


@dataclass
class Run:
    """A finished load: the results in completion order and the wall time from the start to the
    last answer."""

    results: list[Result]
    wall_s: float


async def run_closed(
    target: Target,
    requests: Sequence[Request],
    *,
    concurrency: int,
    max_seconds: float,
    request_timeout_s: float = 300.0,
    on_result: OnResult | None = None,
) -> Run:
    """`concurrency` users send `requests` in order, each its next one when the last ends."""
    wires = [encode_request(target, r.body) for r in requests]
    conns = Connections(target)
    results: list[Result] = []
    queue = iter(range(len(wires)))
    clock0 = time.perf_counter()
    deadline = clock0 + max_seconds

    async def user() -> None:
        for index in queue:
            if time.perf_counter() >= deadline:
                return
            result = await send(conns, wires[index], Result(index), clock0, request_timeout_s)
            results.append(result)
            if on_result:
                on_result(result)

    try:
        await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
    finally:
        conns.close()
    return Run(results, time.perf_counter() - clock0)


async def run_open(
    target: Target,
    requests: Sequence[Request],
    *,
    max_seconds: float,
    request_timeout_s: float = 300.0,
    on_result: OnResult | None = None,
) -> Run:
    """Every request at its own `at` (seconds from the start), however many are in flight."""
    wires = [encode_request(target, r.body) for r in requests]
    conns = Connections(target)
    results: list[Result] = []
    clock0 = time.perf_counter()
    tasks: set[asyncio.Task[Result]] = set()

    def done(task: asyncio.Task[Result]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            results.append(task.result())
            if on_result:
                on_result(results[-1])

    try:
        for index, request in sorted(enumerate(requests), key=lambda item: item[1].at):
            if request.at >= max_seconds:
                break
            delay = request.at - (time.perf_counter() - clock0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(send(conns, wires[index], Result(index), clock0, request_timeout_s))
            tasks.add(task)
            task.add_done_callback(done)
        while tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in list(tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        conns.close()
    return Run(results, time.perf_counter() - clock0)
