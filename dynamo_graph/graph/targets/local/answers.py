"""What the frontends saw of each worker instance: requests, failures, the prompt tokens sent
and tokens answered (`request_units`, `response_units`), time to the first response and between
responses, as every frontend's /health lists them per instance
(runtime/traffic.py counts them in each frontend's client). A canary (canary.py) compares two
revisions' instances with these over a step; the autoscaler (planner.py) sizes a pool by them.
Summed over every ready frontend; a difference of two tallies is what happened between them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamo_graph.graph.targets.local import probes
from dynamo_graph.graph.targets.local.runner import Runner
from dynamo_graph.runtime.traffic import percentile_ms

INSTANCE_LINE = re.compile(r"instance ([0-9a-f]+) serving")
SHARED_PORT_TRIES = 16  # connections to a shared port until the wanted process answers


@dataclass
class Answers:
    """How one instance, or one side of the split, answered (cumulative, or over a step)."""

    requests: int = 0
    errors: int = 0
    first_response_ms: Counter[str] = field(default_factory=Counter)
    between_responses_ms: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0  # the tokens of the requests sent (the frontend's request units)
    output_tokens: int = 0  # the tokens answered (its response units)

    def add(self, other: Answers, sign: int = 1) -> None:
        self.requests += sign * other.requests
        self.errors += sign * other.errors
        self.prompt_tokens += sign * other.prompt_tokens
        self.output_tokens += sign * other.output_tokens
        for bound, n in other.first_response_ms.items():
            self.first_response_ms[bound] += sign * n
        for bound, n in other.between_responses_ms.items():
            self.between_responses_ms[bound] += sign * n

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def ttft_p90_ms(self) -> float | None:
        return percentile_ms(self.first_response_ms, 0.9)

    def itl_p90_ms(self) -> float | None:
        return percentile_ms(self.between_responses_ms, 0.9)

    def describe(self) -> str:
        p90 = self.ttft_p90_ms()
        ttft = "-" if p90 is None else f"{p90:.0f} ms"
        return f"{self.requests} requests, {self.errors} failed, TTFT p90 {ttft}"


def answers_of(health: Any) -> dict[str, Answers]:
    """Per instance id (hex), what one frontend's /health document says it answered, for the
    decode (or aggregated) pool and the prefill pool of every model. An instance listed under
    several models (LoRA adapters share a client) is counted once."""
    out: dict[str, Answers] = {}
    details = health.get("details") if isinstance(health, dict) else None
    if not isinstance(details, dict):
        return out
    for model in details.values():
        if not isinstance(model, dict):
            continue
        listed = ("instances", "unavailable", "prefill_instances", "prefill_unavailable")
        for entry in [e for key in listed for e in model.get(key) or []]:
            if not isinstance(entry, dict) or entry.get("instance_id") in out:
                continue
            out[str(entry.get("instance_id"))] = Answers(
                int(entry.get("requests") or 0),
                int(entry.get("errors") or 0),
                _buckets(entry.get("first_response_ms")),
                _buckets(entry.get("between_responses_ms")),
                int(entry.get("request_units") or 0),
                int(entry.get("response_units") or 0),
            )
    return out


def tally(documents: list[Any]) -> dict[str, Answers]:
    """Per instance id, the answers every frontend counted."""
    total: dict[str, Answers] = {}
    for document in documents:
        for instance, answers in answers_of(document).items():
            total.setdefault(instance, Answers()).add(answers)
    return total


def side(before: Mapping[str, Answers], after: Mapping[str, Answers], ids: set[str]) -> Answers:
    """What the instances `ids` answered between two tallies."""
    out = Answers()
    for instance in ids:
        if instance in after:
            out.add(after[instance])
        if instance in before:
            out.add(before[instance], -1)
    return out


def _buckets(value: object) -> Counter[str]:
    return Counter(value) if isinstance(value, dict) else Counter()


def serving_frontends(runners: Iterable[Runner]) -> list[Runner]:
    """The ready frontends among `runners` (those whose readiness is their HTTP /health)."""
    return [
        r
        for r in runners
        if r.spec.shares_ports and r.ready.is_set() and r.spec.readiness.target.endswith("/health")
    ]


async def health_of(frontend: Runner) -> tuple[int, Any] | None:
    """A frontend process's /health (status, parsed body); None when it cannot be asked."""
    proc = frontend.proc
    if proc is None:
        return None
    return await health_at(frontend.spec.readiness.target, proc.open_connection, proc.pid)


async def health_at(url: str, connect: probes.Connect, pid: int | None) -> tuple[int, Any] | None:
    """The /health at `url` of the frontend process `pid` (None: whichever answers); None when
    it cannot be asked. Its port may be shared (a frontend's replicas, a rollout's old and new
    run): an answer from another process (its `x-dyngraph-pid`) is asked again, on a new
    connection, a few times."""
    for _ in range(SHARED_PORT_TRIES):
        try:
            async with asyncio.timeout(probes.ATTEMPT_TIMEOUT_S):
                status, headers, body = await probes.http_get(url, connect)
            if pid is not None and headers.get(probes.PID_HEADER, str(pid)) != str(pid):
                continue
            return status, json.loads(body)
        except (OSError, TimeoutError, ValueError, IndexError):
            return None
    return None


async def frontend_answers(frontends: Iterable[Runner]) -> dict[str, Answers]:
    """Per instance id, the answers the given frontends counted so far."""
    documents = await asyncio.gather(*(health_of(f) for f in frontends))
    return tally([d for _, d in filter(None, documents)])


def instance_of(runner: Runner) -> str | None:
    """The instance id a worker's current run announced in its log ("instance <hex> serving",
    the line its readiness probe waits for)."""
    proc = runner.proc
    if proc is None:
        return None
    try:
        with proc.log_path.open("rb") as log:
            log.seek(proc.log_offset)
            found = INSTANCE_LINE.search(log.read().decode(errors="replace"))
    except FileNotFoundError:
        return None
    return found.group(1) if found else None
