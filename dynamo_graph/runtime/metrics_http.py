"""A tiny `GET /metrics` server on asyncio: the Prometheus text of one registry, for processes
that have no HTTP server of their own (the supervisor, workers).

asyncio's own server, so collectors run inside the process's event loop at scrape time and
read its state without locks; one request per connection, headers ignored, anything but
`GET /metrics` is a 404.

With the graph's TLS files (`security.tls`, runtime/tls.py) it is HTTPS that requires a client
certificate (`TlsFiles.for_metrics`): of the graph's scraper CA where the graph set one, which no
other listener trusts, so Prometheus's certificate (graph/tls.py) reads metrics and nothing else;
a process without one fails the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from dynamo_graph.runtime.tls import TlsFiles

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0


class MetricsServer:
    """`GET /metrics` of `registry` on an address, (re)bound when `follow` is given another
    address or other TLS files; given the same TLS files again, it reloads them (a new
    revision issued them anew: the supervisor's server outlives its certificate's revision)."""

    def __init__(self, registry: CollectorRegistry, what: str = "metrics") -> None:
        self.registry = registry
        self.what = what  # names the server in its log lines
        self.address: tuple[str, int] | None = None
        self.tls: TlsFiles | None = None
        self._server: asyncio.Server | None = None
        self._context: ssl.SSLContext | None = None

    @property
    def port(self) -> int | None:
        """The port bound (the one the kernel chose for port 0); None when not listening."""
        if self._server is None or not self._server.sockets:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    async def follow(self, address: tuple[str, int] | None, tls: TlsFiles | None = None) -> None:
        """Listen on `address` (None: not at all), over mutual TLS with `tls`; a bind failure
        (or unloadable TLS files) is logged, not fatal: the process serves without its metrics."""
        if (address, tls) == (self.address, self.tls):
            if tls is not None and self._context is not None:
                try:  # the next handshakes present the files' new certificate
                    self._context.load_cert_chain(tls.cert, tls.key)
                except OSError as exc:
                    log.error("%s: cannot reload %s: %s", self.what, tls.cert, exc)
            return
        await self.close()
        self.address, self.tls = address, tls
        if address is None:
            return
        try:
            self._context = None if tls is None else tls.server_context()
            self._server = await asyncio.start_server(self._handle, *address, ssl=self._context)
        except OSError as exc:  # ssl.SSLError is one
            log.error("%s: cannot listen on %s:%d: %s", self.what, *address, exc)

    async def close(self) -> None:
        self._context = None
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
        except (TimeoutError, OSError):  # a peer gone, or its TLS broken off
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
