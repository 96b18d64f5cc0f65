"""The ranks of a replica over several nodes (a worker's `nodes`) live and die together.

Each rank is a process of the plan with its own runner (runner.py), all with the same `group`
(their leader's name). They start together, none waiting for another to be ready: the leader
is ready only once every rank joined its rendezvous, so the replica is ready when its leader
is. A rank whose run ends on its own (it died, or its probe timed out) takes the others' runs
down, as the model's shards cannot go on without it; each runner then restarts its rank as
for any exit, so the group comes back together. A run taken down that way counts as a failed
one (it restarts under `on-failure` even if it exited cleanly on SIGTERM), and does not take
the others down again. `down` stops every runner, so nothing is taken down twice there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from dynamo_graph.graph.plan import ProcessSpec
from dynamo_graph.graph.targets.local.state import ProcessRecord


class _Run(Protocol):
    async def stop(self) -> int | None: ...


class Rank(Protocol):
    """What the gang needs of a rank's runner (runner.py's Runner)."""

    spec: ProcessSpec
    record: ProcessRecord
    taken_down: bool

    @property
    def proc(self) -> _Run | None: ...


_stopping: set[asyncio.Task[int | None]] = set()  # the peers' stops in flight (kept referenced)


def take_down_peers(runner: Rank, runners: Iterable[Rank]) -> list[str]:
    """`runner`'s run ended on its own: stop the running runs of the other ranks of its group
    (SIGTERM, then SIGKILL after their grace) and mark them taken down. Returns their names."""
    group = runner.spec.group
    taken = []
    for peer in runners:
        if peer is runner or peer.spec.group != group or peer.proc is None:
            continue
        if peer.record.state not in ("starting", "ready", "reconnecting"):
            continue  # not running: it is between runs (or done), and starts again by itself
        peer.taken_down = True
        task = asyncio.ensure_future(peer.proc.stop())
        _stopping.add(task)
        task.add_done_callback(_stopping.discard)
        taken.append(peer.spec.name)
    return taken
