"""A lean HTTP/1.1 load generator for streamed OpenAI requests, on raw asyncio sockets.

The machine has 2 cores shared by client and server, so the client must spend as little CPU
as possible: it writes a pre-built request and only scans response bytes for SSE events and
the end of the chunked body. Bounded by request count and wall time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    total: float = 0.0
    events: int = 0
    gaps: list[float] = field(default_factory=list)


def build_request(host: str, port: int, path: str, body: dict, *, keep_alive: bool) -> bytes:
    payload = msgspec.json.encode(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode() + payload


async def _open(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> RequestResult:
    start = time.perf_counter()
    writer.write(request)
    result = RequestResult(ok=False)
    last = None
    tail = b""
    status_checked = False
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        if not status_checked:
            status_checked = True
            if not data.startswith(b"HTTP/1.1 200"):
                return result
        n = data.count(b"data: {")
        if n:
            if last is None:
                result.ttft = now - start
            else:
                result.gaps.append(now - last)
                result.gaps.extend([0.0] * (n - 1))
            last = now
            result.events += n
        tail = (tail + data)[-16:]
        if tail.endswith(b"0\r\n\r\n"):
            result.ok = b"[DONE]" in data or result.events > 0
            break
    result.total = time.perf_counter() - start
    return result


async def run_load(
    host: str,
    port: int,
    path: str,
    body: dict,
    *,
    concurrency: int,
    requests: int,
    keep_alive: bool,
    max_seconds: float,
) -> tuple[list[RequestResult], float]:
    """Send `requests` streamed requests with `concurrency` workers; returns results and wall time."""
    request = build_request(host, port, path, body, keep_alive=keep_alive)
    remaining = requests
    deadline = time.monotonic() + max_seconds
    results: list[RequestResult] = []

    async def worker() -> None:
        nonlocal remaining
        conn = None
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            if conn is None:
                conn = await _open(host, port)
            try:
                results.append(await _one(*conn, request))
            except (ConnectionError, asyncio.IncompleteReadError):
                results.append(RequestResult(ok=False))
                conn[1].close()
                conn = None
                continue
            if not keep_alive:
                conn[1].close()
                conn = None
        if conn is not None:
            conn[1].close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def write_result(out: str | Path, result: dict) -> Path:
    """Write a benchmark's result as indented JSON to `out` (making its folder) and say so."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
