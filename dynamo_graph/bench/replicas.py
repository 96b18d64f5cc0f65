"""Load that changes over time and the replicas a pool runs meanwhile: what an autoscaler is
judged by (`bench --compare-static`, tests/system/test_autoscale.py).

A load profile is phases of (seconds, requests/s) — steps, or ramps from one rate to another —
sent open-loop at the times the rate gives (`bench --profile`); the sampler
reads a running graph's processes.json (its state dir) every `every_s` for the ready replicas
of one component, and integrates them into replica-seconds.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dynamo_graph.bench.loadgen import Request

Phase = tuple[float, float] | tuple[float, float, float]
"""(seconds, requests/s), or a ramp (seconds, requests/s at its start, at its end)."""


def arrivals(phases: Sequence[Phase]) -> list[float]:
    """When each request of the profile starts (seconds from its start): evenly spaced in a
    step; in a ramp, the k-th where the rate's integral reaches k (a linearly rising or falling
    rate); phase after phase."""
    times: list[float] = []
    start = 0.0
    for seconds, first, *rest in phases:
        last = rest[0] if rest else first
        slope = (last - first) / (2 * seconds)  # the integral is first*t + slope*t^2
        for k in range(int(seconds * (first + last) / 2 + 1e-9)):
            times.append(start + (2 * k / (first + math.sqrt(first * first + 4 * slope * k)) if k else 0.0))
        start += seconds
    return times


def phased(body: dict, phases: Sequence[Phase]) -> list[Request]:
    """`body` sent at the profile's arrival times."""
    return [Request(body, at) for at in arrivals(phases)]


def parse_profile(text: str) -> list[Phase]:
    """`SECONDS:RATE` steps and `SECONDS:FROM-TO` ramps, comma-separated (`6:2,9:2-16,20:16,5:0`;
    a burst is a short high step); ValueError naming the part."""
    phases: list[Phase] = []
    for part in text.split(","):
        seconds, sep, rates = part.strip().partition(":")
        first, dash, last = rates.partition("-")
        try:
            phase = (float(seconds), float(first), float(last)) if dash else (float(seconds), float(first))
        except ValueError:
            phase = (0.0, 0.0)
        if not sep or phase[0] <= 0 or min(phase[1:]) < 0:
            raise ValueError(
                f"{part!r}: expected SECONDS:RATE or SECONDS:FROM-TO (seconds above 0, rates 0 or more)"
            )
        phases.append(phase)
    if not arrivals(phases):
        raise ValueError(f"{text!r}: the profile sends no request")
    return phases


def profile_seconds(phases: Sequence[Phase]) -> float:
    return sum(p[0] for p in phases)


def replica_seconds(samples: Sequence[tuple[float, int]]) -> float:
    """Samples of (time, ready replicas) integrated step-wise: each count holds until the next."""
    return sum((t1 - t0) * n for (t0, n), (t1, _) in itertools.pairwise(samples))


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
        return replica_seconds(self.samples)

    def elapsed(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if len(self.samples) > 1 else 0.0
