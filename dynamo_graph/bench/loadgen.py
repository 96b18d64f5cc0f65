"""The load generator: streamed OpenAI-style requests over raw asyncio HTTP/1.1 sockets.

Client and server often share a small machine, so the client spends as little CPU as it can:
request bytes are built once before the clock starts; the response is read in whatever blocks
the socket holds (de-chunked in one pass), and each SSE event is decoded once by msgspec into
the few fields the client reads (benchmarks/bench_loadgen.py: less CPU per stream than the
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
from dataclasses import dataclass, field

import msgspec

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


@dataclass
class Result:
    """What the client saw of one request. Times are seconds; `start` counts from the run's start."""

    index: int
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    total: float = 0.0
    tokens: int = 0  # streamed events that carried output (text, reasoning or a tool call)
    output_tokens: int = 0  # the usage's completion tokens; `tokens` when the server sends none
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between output events: ITL


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


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: msgspec.Raw | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Event(msgspec.Struct):
    """The fields of a streamed event that the client reads (OpenAI chat and completions, the
    Responses API, Anthropic's Messages API); the rest is skipped unparsed."""

    choices: list[_Choice] | None = None
    usage: dict | None = None
    response: dict | None = None  # Responses: response.completed carries the usage
    error: msgspec.Raw | None = None
    type: str | None = None


_decode_event = msgspec.json.Decoder(_Event).decode
_OUTPUT_TYPES = ("response.output_text.delta", "content_block_delta")


def _output_in(event: _Event) -> bool:
    """Does this streamed event carry generated output?"""
    if event.choices:
        choice = event.choices[0]
        if choice.text:
            return True
        delta = choice.delta
        return delta is not None and bool(delta.content or delta.reasoning_content or delta.tool_calls)
    return event.type in _OUTPUT_TYPES


def _read_usage(event: _Event, result: Result) -> None:
    usage = event.usage or (event.response or {}).get("usage")
    if not usage:
        return
    result.output_tokens = usage.get("completion_tokens") or usage.get("output_tokens") or 0
    result.prompt_tokens = usage.get("prompt_tokens") or usage.get("input_tokens") or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or 0


def _handle_events(buf: bytes, now: float, start: float, last: list[float], result: Result) -> bytes:
    """Consume the complete SSE events in `buf`; returns the incomplete rest."""
    events = buf.split(b"\n\n")
    for raw in events[:-1]:
        data_at = raw.find(b"data: ")
        if data_at < 0 or raw.endswith(b"[DONE]"):
            continue
        data = raw[data_at + 6 :]
        if not data.startswith(b"{"):
            continue
        event = _decode_event(data)
        if event.error is not None or event.type == "error":
            result.error = bytes(event.error or data)[:300].decode(errors="replace")
        if _output_in(event):
            if last:
                result.gaps.append(now - last[0])
                last[0] = now
            else:
                result.ttft = now - start
                last.append(now)
            result.tokens += 1
        if event.usage or event.response:
            _read_usage(event, result)
    return events[-1]


class _Chunked:
    """De-chunks an HTTP/1.1 chunked body from whatever blocks the socket hands over, so that one
    read of many small chunks (a burst of tokens) costs one pass, not two awaits per chunk."""

    def __init__(self) -> None:
        self.raw = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes complete in `raw + data`; sets `done` at the last (empty) chunk."""
        raw = self.raw + data
        out = []
        pos = 0
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            end = eol + 2 + size + 2
            if size == 0:
                if raw.find(b"\r\n", eol + 2) < 0:  # the trailer's blank line has not come yet
                    break
                self.done = True
                pos = len(raw)
                break
            if end > len(raw):
                break
            out.append(raw[eol + 2 : end - 2])
            pos = end
        self.raw = raw[pos:]
        return b"".join(out)


async def _read_response(reader: asyncio.StreamReader, start: float, result: Result) -> bool:
    """Read one response; returns whether the connection can carry another request."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    headers = head.lower()
    reusable = b"connection: close" not in headers
    if b"transfer-encoding: chunked" not in headers:
        length = 0
        for line in headers.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        if status != b"200":
            result.error = f"HTTP {status.decode()}: {body[:300].decode(errors='replace')}"
        else:  # a 200 that is not a stream: the server ignored "stream"
            result.error = "the response was not streamed"
        return reusable
    buf = b""
    last: list[float] = []
    chunked = _Chunked()
    while not chunked.done:
        data = await reader.read(65536)
        if not data:
            raise asyncio.IncompleteReadError(chunked.raw, None)
        buf += chunked.feed(data)
        if status == b"200":
            buf = _handle_events(buf, time.perf_counter(), start, last, result)
    if status != b"200":
        result.error = f"HTTP {status.decode()}: {buf[:300].decode(errors='replace')}"
    if not result.output_tokens:
        result.output_tokens = result.tokens
    result.ok = not result.error and result.tokens > 0
    if not result.ok and not result.error:
        result.error = "no output in the stream"
    return reusable


class Connections:
    """Kept-alive connections to the target, reused by whoever sends next."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.idle:
            return self.idle.pop()
        reader, writer = await asyncio.open_connection(self.target.host, self.target.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def give(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], reusable: bool) -> None:
        if reusable and self.target.keep_alive:
            self.idle.append(conn)
        else:
            conn[1].close()

    def close(self) -> None:
        for _, writer in self.idle:
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
        reusable = await asyncio.wait_for(_read_response(conn[0], start, result), timeout_s)
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
