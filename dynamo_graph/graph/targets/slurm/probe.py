"""`python -m dynamo_graph.graph.targets.slurm.probe EVENTS LOG KIND TARGET TIMEOUT_S`: the readiness
check of one run of a Slurm step, started by the job script beside the step (script.py).

It appends `ready TS` to the step's events file once the process's probe passes (the same
probes as the local supervisor's), or `unready TS` after the timeout; it gives up quietly when
the run ends first (an `exit` line follows the run's `start`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from dynamo_graph.graph.plan import Probe
from dynamo_graph.graph.targets.local import probes
from dynamo_graph.graph.targets.local.process import START_MARKER

POLL_S = 0.1


def _event_count(events: Path) -> int:
    return len(events.read_text().splitlines()) if events.exists() else 0


def _run_ended(events: Path, since: int) -> bool:
    """An `exit` after line `since` (this run's `start`): a later run's events are not this one's."""
    lines = events.read_text().splitlines() if events.exists() else []
    return any(line.startswith("exit ") for line in lines[since:])


def _current_run(log: Path) -> probes.LogWatch:
    """The log from the newest start marker on (the script writes it before each run)."""
    data = log.read_bytes() if log.exists() else b""
    marker = data.rfind(START_MARKER.encode())
    return probes.LogWatch(log, 0 if marker < 0 else data.index(b"\n", marker) + 1)


async def watch(events: Path, log: Path, probe: Probe) -> str:
    """`ready`, `unready` (timed out) or `ended` (the run ended before it was ready)."""
    watch_log = _current_run(log)
    since = _event_count(events)  # the script writes this run's `start` before it starts the probe
    deadline = time.monotonic() + probe.timeout_s
    while time.monotonic() < deadline:
        if await probes.check(probe, watch_log):
            return "ready"
        if _run_ended(events, since):
            return "ended"
        await asyncio.sleep(POLL_S)
    return "unready"


def main(args: list[str]) -> int:
    if len(args) != 5 or args[2] not in ("http", "tcp", "log"):
        print("usage: probe EVENTS LOG http|tcp|log TARGET TIMEOUT_S", file=sys.stderr)
        return 2
    events, log = Path(args[0]), Path(args[1])
    outcome = asyncio.run(watch(events, log, Probe(args[2], args[3], float(args[4]))))  # type: ignore[arg-type]
    if outcome != "ended":
        with events.open("a") as f:
            f.write(f"{outcome} {int(time.time())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
