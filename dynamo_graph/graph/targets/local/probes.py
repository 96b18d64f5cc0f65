"""Readiness probes: one attempt each, cheap enough to poll every few milliseconds.

`http` is a bare HTTP/1.0 GET over asyncio streams (the supervisor needs a status line, not an
HTTP client library), `tcp` a connect, `log` a line containing the target that appeared in the
process's log after its current start. The connection comes from the process's launcher, so a
remote process is probed from its own host (through the ssh connection): its 127.0.0.1 is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dynamo_graph.graph.plan import Probe

ATTEMPT_TIMEOUT_S = 1.0

Connect = Callable[[str, int], Awaitable[tuple[Any, Any]]]  # (host, port) -> (reader, writer), or OSError


class LogWatch:
    """Looks for a needle in the bytes a log gained since `offset`, reading each byte once."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset
        self._tail = b""

    def seen(self, needle: str) -> bool:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return False
        self.offset += len(chunk)
        data = self._tail + chunk
        if needle.encode() in data:
            return True
        self._tail = data[-len(needle) :]
        return False


async def _http_ok(url: str, connect: Connect) -> bool:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    reader, writer = await connect(host, port)
    try:
        path = parts.path or "/"
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
        await writer.drain()
        status = await reader.readline()
        return status.split()[1:2] == [b"200"]
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _tcp_ok(target: str, connect: Connect) -> bool:
    host, _, port = target.rpartition(":")
    _, writer = await connect(host.strip("[]") or "127.0.0.1", int(port))
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def check(probe: Probe, log: LogWatch, connect: Connect = asyncio.open_connection) -> bool:
    """One attempt of the probe; False on any connection problem."""
    if probe.kind == "log":
        return log.seen(probe.target)
    try:
        async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
            if probe.kind == "http":
                return await _http_ok(probe.target, connect)
            return await _tcp_ok(probe.target, connect)
    except (OSError, TimeoutError, ValueError, IndexError):
        return False
