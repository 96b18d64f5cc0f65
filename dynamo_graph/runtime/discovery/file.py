"""File discovery: the embedded default, no services. A directory tree of JSON records that every
process of one user on one host (or on a shared disk with agreeing clocks) finds with no settings.

Layout under `root`: key `a/b/c` is the file `a/b/c.json` holding
`{"lease":"<16 hex>","value":<the JSON value>}` (the suffix lets `a/b` and `a/b/c` coexist, as in
etcd). `_leases/<16 hex>` is the heartbeat of one process: `{"ttl": s, "pid": n}`, its mtime
refreshed every ttl/3. A record whose lease file is missing or older than that lease's TTL is
expired: readers ignore it and the first to notice deletes it and the lease file. The owner's
heartbeat puts back any of its records that a reader deleted while the owner was stalled, so a
slow process comes back the way an etcd process re-grants its lease.

Writes are atomic (a temp file in the same directory, then os.replace). Watches poll and diff:
every FAST_POLL_S for FAST_WINDOW_S after they start and after each change (a graph coming up
is seen within milliseconds), backing off to poll_s while nothing changes.
File I/O runs in a worker thread so that a slow shared disk never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from dynamo_graph.runtime.discovery.base import Discovery, DiscoveryError, WatchEvent
from dynamo_graph.runtime.names import new_instance_id

log = logging.getLogger(__name__)

LEASES_DIR = "_leases"
RECORD_SUFFIX = ".json"
FAST_POLL_S = 0.02
FAST_WINDOW_S = 2.0
_LEASE_HEX = re.compile(r"^[0-9a-f]{16}$")


def default_file_root() -> Path:
    """`DYN_FILE_KV`, else one directory per user in the system temp dir."""
    env = os.environ.get("DYN_FILE_KV")
    return Path(env) if env else _per_user_root()


def _per_user_root() -> Path:
    return Path(tempfile.gettempdir()) / f"dyngraph_store_kv-{os.getuid()}"


def _record_head(lease: str) -> bytes:
    return b'{"lease":"' + lease.encode() + b'","value":'


def _parse_record(data: bytes) -> tuple[str, bytes] | None:
    """(lease, value bytes) or None for a file that is not a record. Values come back byte for
    byte as they were put (records are written as head + value + '}')."""
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    if not isinstance(rec, dict) or "value" not in rec:
        return None
    lease = rec.get("lease")
    if not isinstance(lease, str) or not _LEASE_HEX.match(lease):
        return None
    head = _record_head(lease)
    if data.startswith(head) and data.endswith(b"}"):
        return lease, data[len(head) : -1]
    return lease, json.dumps(rec["value"]).encode()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _unlink(path: Path | str) -> None:
    """Several processes may clean up the same expired file: losing the race is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class FileDiscovery(Discovery):
    """Records under `root`, alive while this process's lease file is fresh."""

    backend = "file"

    def __init__(self, root: Path, *, ttl_s: float = 10.0, poll_s: float = 0.25) -> None:
        if ttl_s <= 0 or poll_s <= 0:
            raise DiscoveryError(f"file discovery: ttl_s and poll_s must be > 0 (got {ttl_s}, {poll_s})")
        self.root = Path(root)
        self.ttl_s = float(ttl_s)
        self.poll_s = float(poll_s)
        self._lease = new_instance_id()
        self._lease_hex = f"{self._lease:016x}"
        self._lease_path = self.root / LEASES_DIR / self._lease_hex
        self._owned: dict[str, bytes] = {}
        self._write_lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._heartbeat: asyncio.Task[None] | None = None

    @property
    def lease_id(self) -> int:
        return self._lease

    # ---- keys and paths -------------------------------------------------------------------

    def _parts(self, key: str, *, prefix: bool = False) -> list[str]:
        """Key segments, refusing anything that would leave `root` or collide with our own files.
        A prefix may end with '/' or with part of a segment."""
        parts = key.split("/")
        checked = parts[:-1] if prefix else parts
        if (not prefix and not key) or any(p in ("", ".", "..") or p.startswith(".") for p in checked):
            raise DiscoveryError(
                f"file discovery: bad key {key!r}: segments must be non-empty and not start with '.'"
            )
        if parts[0] == LEASES_DIR and (len(parts) > 1 or not prefix):
            raise DiscoveryError(f"file discovery: bad key {key!r}: {LEASES_DIR}/ is reserved")
        return parts

    def _record_path(self, key: str) -> Path:
        parts = self._parts(key)
        return self.root.joinpath(*parts[:-1], parts[-1] + RECORD_SUFFIX)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._start_sync)
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="file-discovery-heartbeat")

    def _start_sync(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / LEASES_DIR).mkdir(mode=0o700, exist_ok=True)
        if self.root == _per_user_root() and self.root.stat().st_uid != os.getuid():
            raise DiscoveryError(f"file discovery: {self.root} belongs to another user; set DYN_FILE_KV")
        self._write_lease()

    def _write_lease(self) -> None:
        _write_atomic(self._lease_path, json.dumps({"ttl": self.ttl_s, "pid": os.getpid()}).encode())

    async def _beat_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.ttl_s / 3)
            if self._closed.is_set():
                return
            async with self._write_lock:
                try:
                    await asyncio.to_thread(self._beat, dict(self._owned))
                except OSError as exc:  # a full or vanished disk: keep trying, readers expire us
                    log.warning("file discovery heartbeat failed: %s", exc)

    def _beat(self, owned: dict[str, bytes]) -> None:
        """Refresh our lease; put back records a reader removed while we were stalled; remove
        lease files of dead processes that had no records left to trigger a cleanup."""
        try:
            os.utime(self._lease_path)
        except FileNotFoundError:
            log.warning(
                "file discovery lease %s was expired by another process; renewing it", self._lease_hex
            )
            self._write_lease()
        for key, value in owned.items():
            path = self._record_path(key)
            if not path.exists():
                _write_atomic(path, _record_head(self._lease_hex) + value + b"}")
        now = time.time()
        with os.scandir(self.root / LEASES_DIR) as entries:
            for entry in entries:
                if _LEASE_HEX.match(entry.name) and not self._lease_alive(entry.name, now):
                    _unlink(entry.path)

    def _lease_alive(self, lease: str, now: float) -> bool:
        path = self.root / LEASES_DIR / lease
        try:
            mtime = path.stat().st_mtime
            ttl = float(json.loads(path.read_bytes())["ttl"])
        except FileNotFoundError:
            return False
        except (ValueError, KeyError, TypeError):
            ttl = self.ttl_s
        return now - mtime <= ttl

    async def close(self) -> None:
        """Delete our records and lease file now; watchers of this instance end."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        async with self._write_lock:
            keys = list(self._owned)
            self._owned.clear()
            await asyncio.to_thread(self._remove_own, keys)

    def _remove_own(self, keys: list[str]) -> None:
        for key in keys:
            path = self._record_path(key)
            with contextlib.suppress(FileNotFoundError):
                parsed = _parse_record(path.read_bytes())
                if parsed is not None and parsed[0] == self._lease_hex:
                    _unlink(path)
        _unlink(self._lease_path)

    # ---- key-value --------------------------------------------------------------------------

    async def put(self, key: str, value: bytes) -> None:
        try:
            json.loads(value)
        except ValueError as exc:
            raise DiscoveryError(f"file discovery: value of {key!r} is not valid JSON: {exc}") from exc
        path = self._record_path(key)
        if self._heartbeat is None or self._closed.is_set():
            raise DiscoveryError("file discovery: put() needs start() first and no close()")
        async with self._write_lock:
            try:
                await asyncio.to_thread(_write_atomic, path, _record_head(self._lease_hex) + value + b"}")
            except OSError as exc:
                raise DiscoveryError(f"file discovery: cannot write {path}: {exc}") from exc
            self._owned[key] = value

    async def delete(self, key: str) -> None:
        path = self._record_path(key)
        async with self._write_lock:
            self._owned.pop(key, None)
            await asyncio.to_thread(_unlink, path)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return await asyncio.to_thread(self._scan, prefix)

    def _scan(self, prefix: str) -> dict[str, bytes]:
        """Live records under `prefix`; expired ones are deleted on the way. Only the directories
        that can hold matching keys are visited."""
        parts = self._parts(prefix, prefix=True)
        start_dir = self.root.joinpath(*parts[:-1])
        start_key = "".join(p + "/" for p in parts[:-1])
        found: dict[str, bytes] = {}
        leases: dict[str, bool] = {}
        now = time.time()
        stack = [(start_dir, start_key)]
        while stack:
            directory, key_prefix = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                name = entry.name
                if name.startswith(".") or (not key_prefix and name == LEASES_DIR):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    sub = f"{key_prefix}{name}/"
                    if sub.startswith(prefix) or prefix.startswith(sub):
                        stack.append((Path(entry.path), sub))
                    continue
                key = key_prefix + name.removesuffix(RECORD_SUFFIX)
                if not name.endswith(RECORD_SUFFIX) or not key.startswith(prefix):
                    continue
                try:
                    parsed = _parse_record(Path(entry.path).read_bytes())
                except FileNotFoundError:
                    continue
                if parsed is None:
                    continue
                lease, value = parsed
                if lease not in leases:
                    leases[lease] = self._lease_alive(lease, now)
                if leases[lease]:
                    found[key] = value
                else:
                    _unlink(entry.path)
                    _unlink(self.root / LEASES_DIR / lease)
        return found

    async def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Poll and diff: deletes (removed or expired records) first, then puts. Polls fast at
        first and after a change, backing off (doubling) to poll_s while nothing changes."""
        self._parts(prefix, prefix=True)
        known: dict[str, bytes] = {}
        fast = min(FAST_POLL_S, self.poll_s)
        fast_until = time.monotonic() + FAST_WINDOW_S
        delay = fast
        while not self._closed.is_set():
            current = await asyncio.to_thread(self._scan, prefix)
            changed = False
            for key in [k for k in known if k not in current]:
                del known[key]
                changed = True
                yield WatchEvent("delete", key, None)
            for key, value in current.items():
                if known.get(key) != value:
                    known[key] = value
                    changed = True
                    yield WatchEvent("put", key, value)
            if changed:
                fast_until = time.monotonic() + FAST_WINDOW_S
            delay = fast if time.monotonic() < fast_until else min(delay * 2, self.poll_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), delay)
