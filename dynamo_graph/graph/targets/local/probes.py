"""Readiness probes: one attempt each, cheap enough to poll every few milliseconds.

`http` is a bare HTTP/1.0 GET over asyncio streams (the supervisor needs a status line, not an
HTTP client library), `tcp` a connect, `log` a line containing the target that appeared in the
process's log after its current start. The connection comes from the process's launcher, so a
remote process is probed from its own host (through the ssh connection): its 127.0.0.1 is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dynamo_graph.graph.plan import Probe

ATTEMPT_TIMEOUT_S = 1.0
PID_HEADER = "x-dyngraph-pid"  # the frontend's answers to /health and /live name their process

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


async def http_get(url: str, connect: Connect) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of a GET; raises OSError, ValueError."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    reader, writer = await connect(host, port)
    try:
        if parts.scheme == "https":  # a frontend's own certificate: readiness, not trust, is asked
            unverified = ssl.create_default_context()
            unverified.check_hostname = False
            unverified.verify_mode = ssl.CERT_NONE
            await writer.start_tls(unverified)
        path = parts.path or "/"
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers, await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _http_ok(url: str, connect: Connect, pid: int | None) -> bool:
    """A 200, from the process itself: a frontend names its pid (`x-dyngraph-pid`), since a
    rollout's new frontend shares its port with the old one, which may answer instead."""
    status, headers, _ = await http_get(url, connect)
    answered = headers.get(PID_HEADER)
    return status == 200 and (pid is None or answered is None or answered == str(pid))


async def _tcp_ok(target: str, connect: Connect) -> bool:
    host, _, port = target.rpartition(":")
    _, writer = await connect(host.strip("[]") or "127.0.0.1", int(port))
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def check(
    probe: Probe, log: LogWatch, connect: Connect = asyncio.open_connection, pid: int | None = None
) -> bool:
    """One attempt of the probe (of the process `pid`, where an answer can tell); False on any
    connection problem."""
    if probe.kind == "log":
        return log.seen(probe.target)
    try:
        async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
            if probe.kind == "http":
                return await _http_ok(probe.target, connect, pid)
            return await _tcp_ok(probe.target, connect)
    except (OSError, TimeoutError, ValueError, IndexError):
        return False
