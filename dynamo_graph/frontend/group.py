"""Frontend processes that share one port answer /metrics for each other.

A frontend with `replicas: N` (or `dyngraph run --http-processes N`) is N processes on one port
(SO_REUSEPORT): the kernel gives each new connection to one of them, so a scrape reaches one
process, at random. Each process also listens on a Unix socket of its group's folder
(`<tmp>/dyngraph-frontends-<uid>/<group>/<pid>.sock`, private to the user); the process
that takes a scrape asks every other one there for its metrics and answers for all of them, each
series labelled with its process's `pid`, so one scrape holds the whole frontend and PromQL sums
it (`sum by (model) (rate(dynamo_frontend_requests_total[1m]))`).

Why per-process labels and not prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR):
that mode needs prometheus_client's own metric objects, which write an mmapped file on every
observation (several microseconds; the frontend observes every streamed token, docs/benchmarks.md),
and it can only sum, max or list gauges; the routers' gauges (a worker's fitted TTFT, its
backlog as one process sees it) mean nothing summed. Here the request path is untouched and the
cost falls on the scrape: one local round trip per process.

Metrics are all the members share. Each has its own router: its index of the workers' caches
agrees with the others' because each subscribes to the same KV events; its in-flight load is its
own booking of the requests it routed, and the others' show through the workers' load reports
(router/kv/reported.py), the larger of the two counting. That count is off by at most what reached
or left a worker during one report's age (~5-10 ms on one host), by any member; without load
reports (`router.cost: dynamo`, no queue) a member sees only its own 1/N of the load.
docs/frontend-scaling.md says more, and what else stays per process (the queue, session
affinity, the index of a member that started later).

A process that does not answer within `PEER_TIMEOUT_S` is left out of that scrape (its series
are missing, not zero); a socket left by a killed process is removed by the next scrape.
`dynamo_frontend_group_processes` says how many processes answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0
PID_LABEL = "pid"
MAX_GROUP_NAME = 32
_Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]  # name, doc, type, unit, samples


def group_dir(group: str) -> Path:
    """The folder where the members of `group` put their sockets, in one private to this user.
    A long group name is hashed: a Unix socket's path holds 107 bytes at most."""
    root = Path(tempfile.gettempdir()) / f"dyngraph-frontends-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    info = root.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{root} must belong to this user alone (mode 700)")
    name = group.replace("/", "_")
    if len(name) > MAX_GROUP_NAME:
        name = hashlib.sha256(group.encode()).hexdigest()[:MAX_GROUP_NAME]
    path = root / name
    path.mkdir(exist_ok=True)
    return path


def _families(registry: CollectorRegistry) -> list[_Family]:
    return [
        (m.name, m.documentation, m.type, m.unit, [(s.name, s.labels, s.value) for s in m.samples])
        for m in registry.collect()
    ]


class FrontendGroup(Collector):
    """This process's membership of its group: the socket others ask, and the scrape that asks them."""

    def __init__(self, group: str, registry: CollectorRegistry, member: int | None = None) -> None:
        """`member`: this process's id among the group (its pid unless a test says otherwise)."""
        self.registry = registry
        self.member = os.getpid() if member is None else member
        self.dir = group_dir(group)
        self.path = self.dir / f"{self.member}.sock"
        self._server: asyncio.AbstractServer | None = None
        self._merged: list[Metric] = []
        self._own = CollectorRegistry(auto_describe=False)
        self._own.register(self)

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)  # a socket left by an earlier process with this pid
        self._server = await asyncio.start_unix_server(self._answer, path=str(self.path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the last member out removes the folder
            self.dir.rmdir()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(msgspec.msgpack.encode(_families(self.registry)))
            await writer.drain()
        except OSError:
            pass  # the asker gave up
        finally:
            writer.close()

    async def _ask(self, name: str) -> tuple[int, list[_Family]] | None:
        """Member `name`'s metrics (None when it cannot answer)."""
        path = os.path.join(self.dir, name)
        member = name.removesuffix(".sock")
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(path)
                try:
                    data = await reader.read()
                finally:
                    writer.close()
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its process is gone (a kill -9 leaves the file)
            return None
        except (OSError, TimeoutError) as err:
            log.warning("frontend process %s did not answer the scrape: %r", member, err)
            return None
        try:
            return int(member), msgspec.msgpack.decode(data, type=list[_Family])
        except (ValueError, msgspec.DecodeError) as err:
            log.warning("frontend process %s answered the scrape with %r", member, err)
            return None

    async def scrape(self) -> bytes:
        """Every member's metrics, each series labelled with its process's pid."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:  # someone removed the folder: this process answers for itself
            log.warning("%s is gone: /metrics answers for this process alone", self.dir)
            names = []
        peers = [n for n in names if n.endswith(".sock") and n != self.path.name]
        answers = [(self.member, _families(self.registry))]
        answers += [a for a in await asyncio.gather(*(self._ask(p) for p in peers)) if a is not None]
        self._merged = _merge(sorted(answers))
        return generate_latest(self._own)

    def collect(self) -> Iterator[Metric]:
        yield from self._merged


def _merge(answers: Iterable[tuple[int, list[_Family]]]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    processes = 0
    for pid, families in answers:
        processes += 1
        for name, doc, kind, unit, samples in families:
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, doc, kind, unit)
            for sample, labels, value in samples:
                metric.add_sample(sample, {**labels, PID_LABEL: str(pid)}, value)
    count = GaugeMetricFamily(
        "dynamo_frontend_group_processes", "Frontend processes of this port that answered this scrape"
    )
    count.add_metric([], processes)
    return [*merged.values(), count]


@contextlib.asynccontextmanager
async def membership(group: str | None, registry: CollectorRegistry) -> AsyncIterator[FrontendGroup | None]:
    """This process in `group` while the block runs (None: not in a group)."""
    if group is None:
        yield None
        return
    member = FrontendGroup(group, registry)
    await member.start()
    try:
        yield member
    finally:
        await member.close()
