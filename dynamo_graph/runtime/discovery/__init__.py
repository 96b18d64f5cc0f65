"""Discovery backends and their configuration (arguments first, then the environment).

Environment, as Dynamo names it: `DYN_DISCOVERY_BACKEND` (file | etcd, default file),
`DYN_FILE_KV` (file root), `ETCD_ENDPOINTS` (comma-separated, default http://127.0.0.1:2379),
`DYN_LEASE_TTL` (seconds, default 10). The etcd backend is imported only when chosen, so the
default needs no grpc.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from dynamo_graph.redact import redact_url
from dynamo_graph.runtime.discovery.base import Discovery, DiscoveryError, WatchEvent

BACKENDS = ("file", "etcd")
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_TTL_S = 10.0

__all__ = ["BACKENDS", "Discovery", "DiscoveryError", "WatchEvent", "check_settings", "create_discovery"]


def _backend(backend: str | None) -> str:
    source = "--discovery-backend" if backend is not None else "DYN_DISCOVERY_BACKEND"
    value = (backend if backend is not None else os.environ.get("DYN_DISCOVERY_BACKEND", "")).strip()
    value = value.lower() or "file"
    if value not in BACKENDS:
        raise DiscoveryError(f"{source}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def _ttl(ttl_s: float | None) -> float:
    if ttl_s is None:
        text = os.environ.get("DYN_LEASE_TTL", "").strip()
        if not text:
            return DEFAULT_TTL_S
        try:
            ttl_s = float(text)
        except ValueError:
            raise DiscoveryError(f"DYN_LEASE_TTL={text!r}: expected a number of seconds > 0") from None
        source = "DYN_LEASE_TTL"
    else:
        source = "lease TTL"
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise DiscoveryError(f"{source}={ttl_s!r}: expected a number of seconds > 0")
    return float(ttl_s)


def _endpoints(endpoints: list[str] | str | None) -> tuple[list[str], str]:
    source = "ETCD_ENDPOINTS" if endpoints is None else "etcd endpoints"
    if endpoints is None:
        endpoints = os.environ.get("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    cleaned = [e.strip() for e in items if e.strip()]
    if not cleaned:
        raise DiscoveryError(
            f"{source}={redact_url(endpoints)!r}: expected http://host:port[,http://host:port...]"
        )
    return cleaned, source


def check_settings() -> str:
    """Validate the discovery settings in the environment now (before any connection is made);
    returns the backend name."""
    backend = _backend(None)
    _ttl(None)
    if backend == "etcd":
        _endpoints(None)
    return backend


def create_discovery(
    backend: str | None = None,
    *,
    file_root: str | Path | None = None,
    etcd_endpoints: list[str] | str | None = None,
    ttl_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> Discovery:
    """A discovery backend, not started yet (call `await d.start()`); etcd's credentials come
    from `env` when given, else from this process's environment."""
    chosen = _backend(backend)
    ttl = _ttl(ttl_s)
    if chosen == "etcd":
        try:
            from dynamo_graph.runtime.discovery.etcd import EtcdDiscovery, parse_endpoint
        except ImportError as exc:
            raise DiscoveryError(f"the etcd discovery backend needs etcd3aio ({exc})") from exc

        endpoints, source = _endpoints(etcd_endpoints)
        try:  # fail here, naming the setting, rather than at start()
            for endpoint in endpoints:
                parse_endpoint(endpoint)
        except DiscoveryError as exc:
            raise DiscoveryError(f"{source}: {exc}") from None
        if ttl < 1:
            raise DiscoveryError(f"lease TTL {ttl:g} s: etcd leases need at least 1 s")
        return EtcdDiscovery(endpoints, ttl_s=math.ceil(ttl), env=env)
    from dynamo_graph.runtime.discovery.file import FileDiscovery, default_file_root

    root = Path(file_root) if file_root is not None else default_file_root()
    return FileDiscovery(root, ttl_s=ttl)
