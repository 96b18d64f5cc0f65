"""A tiny `GET /metrics` server on asyncio: the Prometheus text of one registry, for processes
that have no HTTP server of their own (the supervisor, workers).

asyncio's own server, so collectors run inside the process's event loop at scrape time and
read its state without locks; one request per connection, headers ignored, anything but
`GET /metrics` is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0


class MetricsServer:
    """`GET /metrics` of `registry` on an address, (re)bound when `follow` is given another."""

    def __init__(self, registry: CollectorRegistry, what: str = "metrics") -> None:
        self.registry = registry
        self.what = what  # names the server in its log lines
        self.address: tuple[str, int] | None = None
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int | None:
        """The port bound (the one the kernel chose for port 0); None when not listening."""
        if self._server is None or not self._server.sockets:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    async def follow(self, address: tuple[str, int] | None) -> None:
        """Listen on `address` (None: not at all); a bind failure is logged, not fatal: the
        process serves without its metrics."""
        if address == self.address:
            return
        await self.close()
        self.address = address
        if address is None:
            return
        try:
            self._server = await asyncio.start_server(self._handle, *address)
        except OSError as exc:
            log.error("%s: cannot listen on %s:%d: %s", self.what, *address, exc)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)).strip():
                pass  # headers: nothing in them matters here
            parts = request.split()
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            if parts[:1] != [b"GET"] or path != b"/metrics":
                status, body, kind = b"404 Not Found", b"only GET /metrics is here\n", b"text/plain"
            else:
                status, body, kind = b"200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + kind
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
