"""One behavioural suite over both discovery backends (file and etcd), plus what is particular to
each: etcd restarts and lease loss, file expiry and layout. TTL 2 s everywhere, file poll 0.1 s."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from etcd3aio import Etcd3Client

from dynamo_graph.runtime.discovery import Discovery, DiscoveryError, WatchEvent
from dynamo_graph.runtime.discovery import etcd as etcd_module
from dynamo_graph.runtime.discovery.etcd import EtcdDiscovery
from dynamo_graph.runtime.discovery.file import LEASES_DIR, FileDiscovery, default_file_root
from tests.support.services import EtcdProc

TTL_S = 2
POLL_S = 0.1

# A second process: registers one key, says "ready", then waits to be killed or stopped.
OWNER_SCRIPT = """
import asyncio, os, sys
from dynamo_graph.runtime.discovery import create_discovery

async def main():
    backend, location, key = sys.argv[1:4]
    if backend == "file":
        d = create_discovery("file", file_root=location, ttl_s=2)
    else:
        d = create_discovery("etcd", etcd_endpoints=location, ttl_s=2)
    await d.start()
    await d.put(key, b'{"pid": %d}' % os.getpid())
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@dataclass
class Backend:
    name: str
    location: str  # the file root or the etcd URL, for the owner subprocess
    prefix: str  # unique per test: the session etcd is shared
    make: Callable[[], Discovery]


@pytest.fixture(params=["file", "etcd"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A factory of started-later discoveries on one store; everything made is closed after."""
    made: list[Discovery] = []
    if request.param == "file":
        root = tmp_path / "kv"
        location = str(root)

        def build() -> Discovery:
            return FileDiscovery(root, ttl_s=TTL_S, poll_s=POLL_S)
    else:
        etcd: EtcdProc = request.getfixturevalue("etcd_server")
        location = etcd.url

        def build() -> Discovery:
            return EtcdDiscovery([etcd.url], ttl_s=TTL_S)

    def make() -> Discovery:
        made.append(build())
        return made[-1]

    yield Backend(request.param, location, f"t/{uuid.uuid4().hex[:8]}/", make)
    for d in made:
        await d.close()


class Watcher:
    """Consumes watch_prefix into a live view, so tests can wait for a state."""

    def __init__(self, discovery: Discovery, prefix: str) -> None:
        self.state: dict[str, bytes] = {}
        self.events: list[WatchEvent] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._run(discovery.watch_prefix(prefix)))

    async def _run(self, events: AsyncIterator[WatchEvent]) -> None:
        async for event in events:
            self.events.append(event)
            if event.kind == "put":
                assert event.value is not None
                self.state[event.key] = event.value
            else:
                self.state.pop(event.key, None)
            self._changed.set()

    async def wait_for(self, pred: Callable[[dict[str, bytes]], bool], within: float) -> float:
        """Seconds until `pred(state)` holds; fails after `within` seconds."""
        start = time.monotonic()
        async with asyncio.timeout(within):
            while True:
                self._changed.clear()
                if pred(self.state):
                    return time.monotonic() - start
                if self.task.done():
                    self.task.result()
                    raise AssertionError("watch ended early")
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({self.task, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()


async def _started(b: Backend) -> Discovery:
    d = b.make()
    await d.start()
    return d


async def _spawn_owner(b: Backend, key: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OWNER_SCRIPT,
        b.name,
        b.location,
        key,
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    async with asyncio.timeout(10):
        line = await proc.stdout.readline()  # once registered (about 0.5 s with grpc imported)
    if line.strip() != b"ready":
        proc.kill()
        raise AssertionError(f"owner failed to start: {line!r}, rc={await proc.wait()}")
    return proc


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


def _file_leftovers(root: Path) -> tuple[list[Path], list[str]]:
    return list(root.rglob("owner.json")), [p.name for p in (root / LEASES_DIR).iterdir()]


# ---- both backends ---------------------------------------------------------------------------


async def test_put_get_delete(backend: Backend) -> None:
    d = await _started(backend)
    p = backend.prefix
    await d.put(p + "a/1", b'{"n": 1}')
    await d.put(p + "a/2", b'{"n": 2}')
    await d.put(p + "b/1", b"[]")
    assert await d.get_prefix(p + "a/") == {p + "a/1": b'{"n": 1}', p + "a/2": b'{"n": 2}'}
    assert set(await d.get_prefix(p)) == {p + "a/1", p + "a/2", p + "b/1"}
    await d.put(p + "a/1", b'{"n": 10}')
    await d.delete(p + "a/2")
    assert await d.get_prefix(p + "a/") == {p + "a/1": b'{"n": 10}'}
    assert await d.get_prefix(p + "zzz/") == {}
    assert d.lease_id > 0


async def test_values_must_be_json(backend: Backend) -> None:
    d = await _started(backend)
    with pytest.raises(DiscoveryError, match="not valid JSON"):
        await d.put(backend.prefix + "x", b"not json")
    assert await d.get_prefix(backend.prefix) == {}


async def test_watch_lists_then_follows(backend: Backend) -> None:
    owner, reader = await _started(backend), await _started(backend)
    p = backend.prefix
    await owner.put(p + "old", b"1")
    watcher = Watcher(reader, p)
    await watcher.wait_for(lambda s: p + "old" in s, 1.0)
    assert watcher.events[0] == WatchEvent("put", p + "old", b"1")

    await owner.put(p + "new", b"2")
    assert await watcher.wait_for(lambda s: s.get(p + "new") == b"2", 1.0) < 1.0
    await owner.put(p + "new", b"3")
    await watcher.wait_for(lambda s: s.get(p + "new") == b"3", 1.0)
    await owner.delete(p + "old")
    assert await watcher.wait_for(lambda s: p + "old" not in s, 1.0) < 1.0
    assert watcher.events[-1] == WatchEvent("delete", p + "old", None)
    assert [e.kind for e in watcher.events] == ["put", "put", "put", "delete"]


async def test_close_removes_keys_at_once_and_ends_watches(backend: Backend) -> None:
    owner, reader = await _started(backend), await _started(backend)
    key = backend.prefix + "k"
    await owner.put(key, b"{}")
    watcher = Watcher(reader, backend.prefix)
    await watcher.wait_for(lambda s: key in s, 1.0)
    await owner.close()
    assert await watcher.wait_for(lambda s: key not in s, 1.0) < 1.0
    await reader.close()
    async with asyncio.timeout(1.0):
        await watcher.task  # a watch ends when its discovery closes


async def test_killed_process_keys_expire(backend: Backend) -> None:
    reader = await _started(backend)
    key = backend.prefix + "owner"
    watcher = Watcher(reader, backend.prefix)
    owner = await _spawn_owner(backend, key)
    try:
        await watcher.wait_for(lambda s: key in s, 2.0)
        owner.kill()
        killed = time.monotonic()
        await watcher.wait_for(lambda s: key not in s, TTL_S + 1.5)
        assert time.monotonic() - killed < TTL_S + 1.5
    finally:
        await _stop(owner)
    if backend.name == "file":  # the reader cleaned up the record and the dead lease
        assert _file_leftovers(Path(backend.location)) == ([], [f"{reader.lease_id:016x}"])


async def test_stalled_process_comes_back(backend: Backend) -> None:
    """SIGSTOP past the TTL: the key goes (lease expired); SIGCONT: the owner notices and puts it
    again (etcd: new lease; file: heartbeat re-puts), and watchers see it come back."""
    reader = await _started(backend)
    key = backend.prefix + "owner"
    watcher = Watcher(reader, backend.prefix)
    owner = await _spawn_owner(backend, key)
    try:
        await watcher.wait_for(lambda s: key in s, 2.0)
        owner.send_signal(signal.SIGSTOP)
        await watcher.wait_for(lambda s: key not in s, TTL_S + 1.5)
        owner.send_signal(signal.SIGCONT)
        assert await watcher.wait_for(lambda s: key in s, 3.0) < 3.0
    finally:
        await _stop(owner)


# ---- etcd ------------------------------------------------------------------------------------


async def _etcd_pair(etcd: EtcdProc) -> tuple[EtcdDiscovery, EtcdDiscovery]:
    owner, reader = EtcdDiscovery([etcd.url], ttl_s=TTL_S), EtcdDiscovery([etcd.url], ttl_s=TTL_S)
    await owner.start()
    await reader.start()
    return owner, reader


async def test_etcd_watch_survives_restart(etcd_fresh: EtcdProc) -> None:
    owner, reader = await _etcd_pair(etcd_fresh)
    try:
        await owner.put("svc/a", b"1")
        watcher = Watcher(reader, "svc/")
        await watcher.wait_for(lambda s: "svc/a" in s, 1.0)
        etcd_fresh.restart()
        await owner.put("svc/b", b"2")  # retries while the channel reconnects
        await watcher.wait_for(lambda s: "svc/b" in s, 3.0)
        await asyncio.sleep(TTL_S + 0.5)  # keepalives resumed: the leased key outlives a TTL
        assert set(await reader.get_prefix("svc/")) == {"svc/a", "svc/b"}
        assert watcher.state.keys() == {"svc/a", "svc/b"}
    finally:
        await owner.close()
        await reader.close()


async def test_etcd_down_longer_than_ttl(etcd_fresh: EtcdProc) -> None:
    """Keys are back within a few seconds once etcd returns: etcd renews restored leases and,
    if the keepalive came too late anyway, the owner re-grants and puts its keys again."""
    owner, reader = await _etcd_pair(etcd_fresh)
    try:
        await owner.put("svc/a", b"1")
        watcher = Watcher(reader, "svc/")
        await watcher.wait_for(lambda s: "svc/a" in s, 1.0)
        etcd_fresh.stop()
        await asyncio.sleep(TTL_S + 1)  # the outage outlasts the lease: the TTL is what is tested
        etcd_fresh.restart()
        await watcher.wait_for(lambda s: "svc/a" in s, 3.0)
        await owner.put("svc/b", b"2")
        await watcher.wait_for(lambda s: s.keys() == {"svc/a", "svc/b"}, 3.0)
        assert set(await reader.get_prefix("svc/")) == {"svc/a", "svc/b"}
    finally:
        await owner.close()
        await reader.close()


async def test_etcd_lost_lease_is_granted_again(etcd_fresh: EtcdProc) -> None:
    """A revoked lease (what etcd does when a process was cut off past the TTL): the keys go,
    the owner grants a new lease, puts them back, and the watcher sees them return."""
    owner, reader = await _etcd_pair(etcd_fresh)
    try:
        await owner.put("svc/a", b"1")
        watcher = Watcher(reader, "svc/")
        await watcher.wait_for(lambda s: "svc/a" in s, 1.0)
        old_lease = owner.lease_id
        async with Etcd3Client([f"127.0.0.1:{etcd_fresh.port}"]) as admin:
            assert admin.lease is not None
            await admin.lease.revoke(old_lease)
        await watcher.wait_for(lambda s: "svc/a" not in s, 1.0)
        assert await watcher.wait_for(lambda s: "svc/a" in s, 3.0) < 3.0
        assert owner.lease_id != old_lease
    finally:
        await owner.close()
        await reader.close()


async def test_etcd_unreachable_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_module, "_WRITE_RETRY_S", 0.5)
    d = EtcdDiscovery(["http://127.0.0.1:1"], ttl_s=TTL_S)
    with pytest.raises(DiscoveryError, match=r"127\.0\.0\.1:1: cannot grant a lease"):
        await d.start()


# ---- file ------------------------------------------------------------------------------------


async def test_file_layout_and_expired_cleanup(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    owner = FileDiscovery(root, ttl_s=TTL_S, poll_s=POLL_S)
    reader = FileDiscovery(root, ttl_s=TTL_S, poll_s=POLL_S)
    await owner.start()
    await reader.start()
    try:
        await owner.put("v1/instances/ns/c/e/1f", b'{"a": [1, 2]}')
        record = root / "v1/instances/ns/c/e/1f.json"
        lease_file = root / LEASES_DIR / f"{owner.lease_id:016x}"
        assert json.loads(record.read_bytes()) == {"lease": f"{owner.lease_id:016x}", "value": {"a": [1, 2]}}
        assert json.loads(lease_file.read_bytes())["ttl"] == TTL_S
        assert await reader.get_prefix("v1/instances/ns/") == {"v1/instances/ns/c/e/1f": b'{"a": [1, 2]}'}
        assert await reader.get_prefix("v1/instances/ns/c/e/1") == {
            "v1/instances/ns/c/e/1f": b'{"a": [1, 2]}'
        }

        stale = time.time() - TTL_S - 1  # as if the owner stopped heartbeating
        os.utime(lease_file, (stale, stale))
        assert await reader.get_prefix("v1/") == {}
        assert not record.exists() and not lease_file.exists()
    finally:
        await owner.close()
        await reader.close()


async def test_file_rejects_bad_keys(tmp_path: Path) -> None:
    d = FileDiscovery(tmp_path, ttl_s=TTL_S, poll_s=POLL_S)
    await d.start()
    try:
        for key in ["", "a//b", "../x", "a/../b", "a/.hidden", f"{LEASES_DIR}/x", "/abs"]:
            with pytest.raises(DiscoveryError, match="bad key"):
                await d.put(key, b"1")
        with pytest.raises(DiscoveryError, match="bad key"):
            await d.get_prefix("../")
    finally:
        await d.close()


def test_default_file_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    assert default_file_root() == tmp_path
    monkeypatch.delenv("DYN_FILE_KV")
    assert default_file_root().name == f"dyngraph_store_kv-{os.getuid()}"
