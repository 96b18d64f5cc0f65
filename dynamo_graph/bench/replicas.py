"""Load that changes over time and the replicas a pool runs meanwhile: what an autoscaler is
judged by (benchmarks/bench_autoscale.py, tests/system/test_autoscale.py).

A load profile is phases of (seconds, requests/s), sent open-loop at even spacing; the sampler
reads a running graph's processes.json (its state dir) every `every_s` for the ready replicas
of one component, and integrates them into replica-seconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dynamo_graph.bench.loadgen import Request


def phased(body: dict, phases: Sequence[tuple[float, float]]) -> list[Request]:
    """`body` sent at `rate` requests/s for `seconds`, phase after phase."""
    requests: list[Request] = []
    start = 0.0
    for seconds, rate in phases:
        requests += [Request(body, start + i / rate) for i in range(int(seconds * rate))]
        start += seconds
    return requests


def parse_phases(text: str) -> list[tuple[float, float]]:
    """`SECONDS:RATE,SECONDS:RATE,...` (e.g. `6:2,30:16,24:2`); ValueError naming the part."""
    phases = []
    for part in text.split(","):
        seconds, sep, rate = part.partition(":")
        try:
            phase = (float(seconds), float(rate))
        except ValueError:
            phase = (0.0, 0.0)
        if not sep or phase[0] <= 0 or phase[1] <= 0:
            raise ValueError(f"{part!r}: expected SECONDS:RATE, both above 0")
        phases.append(phase)
    return phases


class ReplicaSampler(threading.Thread):
    """Ready (not retiring) replicas of `component`, on the monotonic clock, until stopped."""

    def __init__(self, state_dir: Path, component: str, every_s: float = 0.25) -> None:
        super().__init__(daemon=True, name=f"replicas of {component}")
        self.processes = state_dir / "processes.json"
        self.component = component
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                records = json.loads(self.processes.read_text())
            except (OSError, ValueError):
                continue
            ready = sum(
                r["component"] == self.component and r["state"] == "ready" and not r.get("retiring")
                for r in records
            )
            self.samples.append((time.monotonic(), ready))

    def stop(self) -> list[tuple[float, int]]:
        self.done.set()
        self.join()
        return self.samples

    def replica_seconds(self) -> float:
        spans = zip(self.samples, self.samples[1:], strict=False)
        return sum((t1 - t0) * n for (t0, n), (t1, _) in spans)

    def elapsed(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if len(self.samples) > 1 else 0.0
