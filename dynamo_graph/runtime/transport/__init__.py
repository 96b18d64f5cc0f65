"""Request plane transports, chosen by name: `tcp` (default) or `nats`.

Environment: `DYN_REQUEST_PLANE` (tcp | nats), `NATS_SERVER` (nats://127.0.0.1:4222),
`DYN_TCP_HOST` (bind address, 127.0.0.1), `DYN_TCP_PORT` (listen port, 0 = any free one; static
workers need a fixed one), `DYN_TCP_ADVERTISE_HOST` (the address callers dial) and, for mutual
TLS on tcp, `DYN_TLS_CA_FILE` / `DYN_TLS_CERT_FILE` / `DYN_TLS_KEY_FILE` (runtime/tls.py).
Explicit keyword arguments win over the environment. A caller picks its client by the key of
the instance's transport record ({"tcp": ...} or {"nats": ...}).
"""

from __future__ import annotations

import os
from typing import Any

from dynamo_graph.runtime import tls
from dynamo_graph.runtime.tls import TlsFiles
from dynamo_graph.runtime.transport.base import (
    CannotConnect,
    Handler,
    RequestPlaneClient,
    RequestPlaneServer,
    RequestTimeout,
    StreamBroken,
    TransportError,
)
from dynamo_graph.runtime.transport.frames import EndpointNotFound

KINDS = ("tcp", "nats")
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

__all__ = [
    "KINDS",
    "CannotConnect",
    "EndpointNotFound",
    "Handler",
    "RequestPlaneClient",
    "RequestPlaneServer",
    "RequestTimeout",
    "StreamBroken",
    "TransportError",
    "check_settings",
    "create_client",
    "create_server",
    "default_kind",
]


def default_kind() -> str:
    """The transport named by DYN_REQUEST_PLANE (tcp when unset)."""
    return _check_kind(os.environ.get("DYN_REQUEST_PLANE") or "tcp", "DYN_REQUEST_PLANE")


def _check_kind(kind: str, source: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"{source}={kind!r} is not a request plane; use one of: {', '.join(KINDS)}")
    return kind


def check_settings() -> str:
    """Validate the request-plane settings in the environment now; returns the plane's name."""
    kind = default_kind()
    _tcp_port()
    tls.check_settings()
    return kind


def _tcp_port() -> int:
    raw = os.environ.get("DYN_TCP_PORT") or "0"
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"DYN_TCP_PORT={raw!r} is not a port number (0-65535)")
    return int(raw)


def create_server(kind: str | None = None, **kw: Any) -> RequestPlaneServer:
    """A worker-side server. tcp: host, port, advertise_host, max_streams_per_connection,
    cancel_grace_s, ssl; nats: url, keepalive_s, cancel_grace_s."""
    kind = _check_kind(kind, "request plane kind") if kind else default_kind()
    if kind == "tcp":
        from dynamo_graph.runtime.transport.tcp import TcpRequestPlaneServer

        kw.setdefault("host", os.environ.get("DYN_TCP_HOST") or "127.0.0.1")
        kw.setdefault("port", _tcp_port())
        kw.setdefault("advertise_host", os.environ.get("DYN_TCP_ADVERTISE_HOST") or None)
        if "ssl" not in kw and (files := TlsFiles.from_env()) is not None:
            kw["ssl"] = files.server_context()
        return TcpRequestPlaneServer(**kw)
    from dynamo_graph.runtime.transport.nats import NatsRequestPlaneServer

    kw.setdefault("url", os.environ.get("NATS_SERVER") or DEFAULT_NATS_URL)
    return NatsRequestPlaneServer(**kw)


def create_client(kind: str | None = None, **kw: Any) -> RequestPlaneClient:
    """A caller-side client. tcp: connect_timeout_s, stream_buffer, ssl; nats: url, ack_timeout_s,
    silence_s, stream_buffer."""
    kind = _check_kind(kind, "request plane kind") if kind else default_kind()
    if kind == "tcp":
        from dynamo_graph.runtime.transport.tcp import TcpRequestPlaneClient

        if "ssl" not in kw and (files := TlsFiles.from_env()) is not None:
            kw["ssl"] = files.client_context()
        return TcpRequestPlaneClient(**kw)
    from dynamo_graph.runtime.transport.nats import NatsRequestPlaneClient

    kw.setdefault("url", os.environ.get("NATS_SERVER") or DEFAULT_NATS_URL)
    return NatsRequestPlaneClient(**kw)
