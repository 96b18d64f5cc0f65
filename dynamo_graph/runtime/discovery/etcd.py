"""etcd discovery: one lease per process with keepalive, list-then-watch, re-grant after loss.

The client is etcd3aio (asyncio, grpc.aio), kept behind this small class so that it can be swapped
for aetcd. What etcd3aio does and does not do for us:
- Its watches resume by themselves only after UNAVAILABLE; an etcd restart can also break the
  stream with INTERNAL ("Failed execute_batch"), which etcd3aio raises. We watch again from the
  last event's revision + 1, so a watcher misses nothing across restarts. A watch whose revision
  was compacted is cancelled by etcd and etcd3aio would then wait forever; we list again, diff
  and watch anew.
- Closing the client makes grpc raise CancelledError in open watch streams; watches end quietly
  when this discovery was closed.
- `LeaseKeepalive` only logs errors; it reports a lost lease through `.alive`. When the lease is
  gone (this process was cut off from etcd for longer than the TTL), we grant a new one and put
  every key we own again. The lease id changes then; instance ids do not, because the runtime
  chooses them (names.new_instance_id) and they are not the lease.
- Unary calls fail with EtcdConnectionError while the grpc channel reconnects (about 0.15 s after
  an etcd restart with our channel settings, about 2 s with grpc's defaults); writes retry with
  backoff for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar
from urllib.parse import urlsplit

import grpc
from etcd3aio import Etcd3Client, EtcdConnectionError, EtcdError, EtcdTransientError, prefix_range_end

from dynamo_graph.runtime.credentials import CredentialsError, etcd_credentials
from dynamo_graph.runtime.discovery.base import Discovery, DiscoveryError, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")

_DELETE = 1  # mvccpb.Event.DELETE (PUT is 0)
_WRITE_RETRY_S = 5.0  # how long a write waits for etcd to come back before it fails
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 1.0
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
# grpc's defaults back off up to 120 s between reconnect attempts; after a long etcd outage the
# channel would stay down long after etcd is back. etcd3aio has no hook for channel options.
_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`http://host:port`, `https://host:port` or `host:port` -> (host, port). TLS itself comes
    from ETCD_AUTH_CA (runtime/credentials.py): https without it is an error there."""
    text = endpoint.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise DiscoveryError(f"etcd endpoint {endpoint!r}: expected http(s)://host:port or host:port")
    try:
        port = parts.port or 2379
    except ValueError as exc:
        raise DiscoveryError(f"etcd endpoint {endpoint!r}: bad port") from exc
    return parts.hostname, port


def _retriable(exc: BaseException) -> bool:
    """etcd unreachable or restarting (grpc may report a dropped stream as INTERNAL)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in _RETRY_CODES
    return isinstance(exc, EtcdConnectionError | EtcdTransientError)


def _is_lease_not_found(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and "lease not found" in (exc.details() or "")


class EtcdDiscovery(Discovery):
    """Keys live on this process's etcd lease; `_owned` remembers them to put them again after a
    re-grant."""

    backend = "etcd"

    def __init__(
        self, endpoints: list[str], *, ttl_s: int = 10, env: Mapping[str, str] | None = None
    ) -> None:
        """`env`: where the credentials come from (runtime/credentials.py) when not this process's
        environment (a supervisor acting for its graph's processes)."""
        if not endpoints:
            raise DiscoveryError("etcd discovery needs at least one endpoint")
        if ttl_s < 1:
            raise DiscoveryError(f"etcd lease TTL must be at least 1 s, got {ttl_s}")
        self._endpoints = [parse_endpoint(e) for e in endpoints]
        self._tls = any(e.strip().lower().startswith("https://") for e in endpoints)
        self._ttl_s = int(ttl_s)
        self._env = env
        self._client: Etcd3Client | None = None
        self._lease: int | None = None
        self._owned: dict[str, bytes] = {}
        self._write_lock = asyncio.Lock()
        self._lease_lost = asyncio.Event()
        self._closed = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None

    @property
    def lease_id(self) -> int:
        if self._lease is None:
            raise DiscoveryError("etcd discovery is not started")
        return self._lease

    @property
    def _etcd(self) -> Etcd3Client:
        if self._client is None or self._closed.is_set():
            raise DiscoveryError("etcd discovery is not started or already closed")
        return self._client

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        targets = []
        for host, port in self._endpoints:
            # etcd3aio dials `ipv4:host:port`, which takes addresses only: resolve names here.
            try:
                infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise DiscoveryError(f"etcd endpoint {host}:{port}: cannot resolve ({exc})") from exc
            targets.append(f"{infos[0][4][0]}:{port}")
        try:
            creds = etcd_credentials(self._env)
        except CredentialsError as exc:
            raise DiscoveryError(str(exc)) from None
        if self._tls and not creds.channel:
            raise DiscoveryError("https etcd endpoints need ETCD_AUTH_CA (the CA certificate file)")
        client = Etcd3Client(
            targets,
            watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=1.0,
            tls_server_name=creds.tls_server_name or (self._endpoints[0][0] if creds.channel else None),
            **dict(creds.channel),
        )
        manager = getattr(client, "_manager", None)
        if manager is not None:
            manager.grpc_options += _CHANNEL_OPTIONS
        await client.connect()
        self._client = client
        if creds.username is not None:
            try:
                reply = await client.auth.authenticate(creds.username, creds.password)
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                await client.close()
                self._client = None
                raise DiscoveryError(f"etcd: authentication as {creds.username!r} failed: {exc}") from None
            client.set_token(reply.token)
        try:
            self._lease = await self._retry("grant a lease", self._grant)
        except DiscoveryError:
            await client.close()
            self._client = None
            raise
        self._keeper = asyncio.create_task(self._keep_lease(), name="etcd-lease-keeper")

    async def _grant(self) -> int:
        resp = await self._etcd.lease.grant(self._ttl_s, timeout=self._ttl_s)
        return int(resp.ID)

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Retry while etcd is unreachable (e.g. its first moments after a restart), up to
        _WRITE_RETRY_S. A write on a lost lease wakes the keeper and waits for the new lease."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _WRITE_RETRY_S
        backoff = _BACKOFF_MIN_S
        while True:
            try:
                return await call()
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                if _is_lease_not_found(exc):
                    self._lease_lost.set()
                elif not _retriable(exc):
                    raise DiscoveryError(f"etcd: cannot {what}: {exc}") from exc
                if loop.time() + backoff > deadline:
                    targets = ", ".join(f"{h}:{p}" for h, p in self._endpoints)
                    raise DiscoveryError(f"etcd at {targets}: cannot {what}: {exc}") from exc
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _keep_lease(self) -> None:
        """Keep the lease alive; when etcd says it is gone, grant a new one and re-put our keys."""
        check_s = min(1.0, self._ttl_s / 4)
        while not self._closed.is_set():
            lease = self.lease_id
            async with self._etcd.lease.keep_alive_context(lease, self._ttl_s) as keepalive:
                while keepalive.alive and not self._lease_lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._closed.wait(), check_s)
                    if self._closed.is_set():
                        return
            log.warning(
                "etcd lease %x lost; granting a new one and registering %d keys again",
                lease,
                len(self._owned),
            )
            await self._regrant()

    async def _regrant(self) -> None:
        """Grant and re-put until etcd answers (capped backoff with jitter, no limit: the process
        must come back whenever etcd does). Keys re-put on a newer lease leave the older one."""
        backoff = 0.1
        while True:
            try:
                self._lease = await self._grant()
                self._lease_lost.clear()
                async with self._write_lock:
                    for key, value in list(self._owned.items()):
                        await self._put_raw(key, value)
                return
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                log.warning("etcd lease re-grant failed (%s); retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 5.0)

    async def _put_raw(self, key: str, value: bytes) -> None:
        await self._etcd.kv.put(key, value, lease=self.lease_id)

    async def put(self, key: str, value: bytes) -> None:
        try:  # the same contract as the file backend, so a bad value fails on every backend
            json.loads(value)
        except ValueError as exc:
            raise DiscoveryError(f"etcd discovery: value of {key!r} is not valid JSON: {exc}") from exc
        async with self._write_lock:
            previous = self._owned.get(key)
            self._owned[key] = value  # before the write: a re-grant meanwhile must re-put it too
            try:
                await self._retry(f"put {key}", lambda: self._put_raw(key, value))
            except DiscoveryError:
                if previous is None:
                    del self._owned[key]
                else:
                    self._owned[key] = previous
                raise

    async def delete(self, key: str) -> None:
        async with self._write_lock:
            self._owned.pop(key, None)
            await self._retry(f"delete {key}", lambda: self._etcd.kv.delete(key))

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        resp = await self._retry(
            f"list {prefix}", lambda: self._etcd.kv.get(prefix, range_end=prefix_range_end(prefix))
        )
        return {kv.key.decode(): bytes(kv.value) for kv in resp.kvs}

    async def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """List, then watch from the listed revision + 1. A broken stream is watched again from
        the last event's revision + 1 (etcd3aio resumes only after UNAVAILABLE, and an etcd restart
        can also surface as INTERNAL). If etcd cancels the watch (its start revision was
        compacted), list again and emit the difference. Retries until close()."""
        end = prefix_range_end(prefix)
        known: dict[str, bytes] = {}
        next_rev = 0  # 0: list first
        backoff = _BACKOFF_MIN_S
        while not self._closed.is_set():
            try:
                if not next_rev:
                    resp = await self._etcd.kv.get(prefix, range_end=end)
                    listed = {kv.key.decode(): bytes(kv.value) for kv in resp.kvs}
                    for key in [k for k in known if k not in listed]:
                        del known[key]
                        yield WatchEvent("delete", key, None)
                    for key, value in listed.items():
                        if known.get(key) != value:
                            known[key] = value
                            yield WatchEvent("put", key, value)
                    next_rev = resp.header.revision + 1
                stream = self._etcd.watch.watch(prefix, range_end=end, start_revision=next_rev)
                async with contextlib.aclosing(stream):
                    async for wresp in stream:
                        backoff = _BACKOFF_MIN_S
                        for ev in wresp.events:
                            next_rev = ev.kv.mod_revision + 1
                            key = ev.kv.key.decode()
                            if ev.type == _DELETE:
                                if known.pop(key, None) is not None:
                                    yield WatchEvent("delete", key, None)
                            else:
                                known[key] = bytes(ev.kv.value)
                                yield WatchEvent("put", key, known[key])
                        if wresp.canceled:
                            reason = wresp.cancel_reason or f"compacted at {wresp.compact_revision}"
                            log.warning("etcd watch on %s cancelled (%s); listing again", prefix, reason)
                            next_rev = 0
                            break
            except (grpc.aio.AioRpcError, EtcdConnectionError, EtcdTransientError) as exc:
                if self._closed.is_set():
                    return
                if not _retriable(exc):
                    raise DiscoveryError(f"etcd: watch on {prefix} failed: {exc}") from exc
                log.warning("etcd watch on %s broken (%s); watching again in %.1f s", prefix, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            except DiscoveryError:  # self._etcd after close()
                if self._closed.is_set():
                    return
                raise
            except asyncio.CancelledError:
                # grpc raises CancelledError in a stream whose channel close() shut; a real
                # cancellation of the consuming task must still propagate.
                task = asyncio.current_task()
                if self._closed.is_set() and task is not None and not task.cancelling():
                    return
                raise

    async def close(self) -> None:
        if self._closed.is_set() or self._client is None:
            self._closed.set()
            return
        self._closed.set()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._lease is not None:
            try:  # revoking deletes our keys at once; if etcd is down they go after the TTL
                await self._client.lease.revoke(self._lease, timeout=2.0)
            except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as exc:
                log.warning(
                    "etcd lease %x not revoked (%s); its keys expire after %d s",
                    self._lease,
                    exc,
                    self._ttl_s,
                )
        self._owned.clear()
        await self._client.close()
