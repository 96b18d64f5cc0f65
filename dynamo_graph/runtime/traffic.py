"""Traffic shares and answer statistics per instance: what a canary rollout steers and reads.

A component's traffic split is one discovery key, `v1/traffic/{ns}/{comp}`, holding a
`TrafficSplit`: requests go, with probability `share`, to the instances whose record carries
every label of `labels` (e.g. `revision=7`, which a worker takes from `DYN_INSTANCE_LABELS`),
and otherwise to the rest. Whoever writes the key (the supervisor during a canary rollout)
keeps it under its lease, so a split never outlives the rollout that set it. With no key, or
with one of the two groups empty, every routable instance is a candidate.

`AnswerStats` counts, per instance a client sent requests to, the requests, the errors the
instance caused (it could not be reached, its stream broke, it answered an error), the time to
its first response and the time between its later responses, in fixed geometric buckets, so
anyone reading two snapshots can compare groups of instances over the interval between them
(error rate, percentiles: a canary's judge, the autoscaler's planner) without this room
knowing what a token is (an engine streaming a token per response makes them TTFT and ITL).
It also sums the work the caller says each request and response carried (`Client.generate`'s
`units_sent` and `units_of`: an LLM pool's prompt tokens sent and tokens answered), so a reader
of two snapshots has the work an instance was given, not only the number of requests.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from collections.abc import Mapping, Sequence

import msgspec

from dynamo_graph.runtime.discovery import Discovery

log = logging.getLogger(__name__)
TRAFFIC_ROOT = "v1/traffic"
LABELS_ENV = "DYN_INSTANCE_LABELS"
# Upper bounds (ms) of the time-to-first-response buckets: 1 ms to ~5 min, 12% apart, so a
# percentile read from them is within ~6% of the true value.
FIRST_RESPONSE_BOUNDS_MS: tuple[float, ...] = tuple(round(1.12**i, 3) for i in range(0, 111))


def traffic_key(namespace: str, component: str) -> str:
    return f"{TRAFFIC_ROOT}/{namespace}/{component}"


def parse_labels(text: str, source: str) -> dict[str, str]:
    """`key=value[,key=value...]` as a dict; a ValueError naming `source` when malformed."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{source}={text!r}: expected key=value[,key=value...]")
        labels[key.strip()] = value.strip()
    return labels


def labels_from_env() -> dict[str, str]:
    """This process's instance labels, `DYN_INSTANCE_LABELS=key=value[,key=value...]`."""
    return parse_labels(os.environ.get(LABELS_ENV, ""), LABELS_ENV)


def has_labels(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


class TrafficSplit(msgspec.Struct, frozen=True):
    """`share` (0..1) of the requests to the instances carrying `labels`, the rest elsewhere."""

    labels: dict[str, str]
    share: float

    def choose(
        self, ids: Sequence[int], labels_of: Mapping[int, Mapping[str, str]], draw: float
    ) -> list[int]:
        """The candidates of one request, given its uniform `draw` in [0, 1)."""
        chosen = [i for i in ids if has_labels(labels_of.get(i, {}), self.labels)]
        if not chosen or len(chosen) == len(ids):
            return list(ids)
        if draw < self.share:
            return chosen
        picked = set(chosen)
        return [i for i in ids if i not in picked]


class TrafficSplits:
    """Every component's split, from one watch of `v1/traffic/` per process (the runtime's),
    however many clients read it: `get` is a dict lookup on each request's path."""

    def __init__(self) -> None:
        self._splits: dict[str, TrafficSplit] = {}
        self._decode = msgspec.json.Decoder(TrafficSplit)

    def get(self, namespace: str, component: str) -> TrafficSplit | None:
        return self._splits.get(traffic_key(namespace, component))

    async def follow(self, discovery: Discovery) -> None:
        async for event in discovery.watch_prefix(TRAFFIC_ROOT + "/"):
            split = None
            if event.kind == "put" and event.value is not None:
                try:
                    split = self._decode.decode(event.value)
                except msgspec.DecodeError as err:
                    log.warning("ignoring malformed traffic split %s: %s", event.key, err)
            if split != self._splits.get(event.key):
                log.info("traffic split of %s: %s", event.key, split or "lifted")
            if split is None:
                self._splits.pop(event.key, None)
            else:
                self._splits[event.key] = split


class AnswerStats:
    """What one instance's answers looked like, cumulative since the client first sent to it."""

    __slots__ = ("between", "buckets", "errors", "request_units", "requests", "response_units")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.request_units = 0  # the caller's measure of the requests' work (prompt tokens)
        self.response_units = 0  # and of the responses' (tokens answered)
        self.buckets = [0] * (len(FIRST_RESPONSE_BOUNDS_MS) + 1)  # the last one: beyond the bounds
        self.between = [0] * (len(FIRST_RESPONSE_BOUNDS_MS) + 1)  # gaps between later responses

    def first_response(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(FIRST_RESPONSE_BOUNDS_MS, seconds * 1000.0)] += 1

    def next_response(self, seconds: float) -> None:
        self.between[bisect.bisect_left(FIRST_RESPONSE_BOUNDS_MS, seconds * 1000.0)] += 1

    def report(self) -> dict[str, object]:
        """`errors`, `request_units`, `response_units` and the non-empty `first_response_ms`
        and `between_responses_ms` buckets, keyed by upper bound (`inf` last)."""
        return {
            "errors": self.errors,
            "request_units": self.request_units,
            "response_units": self.response_units,
            "first_response_ms": _nonzero(self.buckets),
            "between_responses_ms": _nonzero(self.between),
        }


_BOUND_NAMES = [*map(str, FIRST_RESPONSE_BOUNDS_MS), "inf"]


def _nonzero(buckets: list[int]) -> dict[str, int]:
    return {_BOUND_NAMES[i]: n for i, n in enumerate(buckets) if n}


def percentile_ms(buckets: Mapping[str, int], q: float) -> float | None:
    """The `q` quantile (0..1) of a bucket map (`first_response_ms` or `between_responses_ms` as
    `AnswerStats.report` gives, or a difference of two), by the upper bound of the bucket holding
    it; None when empty."""
    counts = sorted((math.inf if k == "inf" else float(k), n) for k, n in buckets.items() if n > 0)
    total = sum(n for _, n in counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for bound, n in counts:
        seen += n
        if seen >= rank:
            return bound
    return counts[-1][0]
