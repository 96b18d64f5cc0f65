"""The autoscaler: one planner per graph, sizing each autoscaled pool from what the graph
measures, and whatever runs the graph acting on it (Pools): the local supervisor's rollout
machinery, or a Slurm job's planner step (targets/slurm/autoscale.py).

Every `interval_s` a pool's planner reads what every ready frontend counted per instance since
its last look (answers.py): the requests sent to the pool's instances (its arrival rate), the
prompt tokens sent and the tokens answered, their time to first response and between
responses (TTFT and ITL, one token per response). A pool is sized by tokens, per its role
(SIZED_BY): a prefill pool by prompt tokens/s against its TTFT, a decode pool by output
tokens/s against its ITL, an aggregated pool by both (the larger answer) — requests/s only while
the frontends count no tokens. Per measure:

- **capacity** — what one replica serves within the target, learned online: an interval within
  the target at r per replica raises it to at least r (the best a replica has shown); an
  interval over the target caps it at r x target / measured, the rate the target would have
  allowed if latency grows in proportion — unless the pool changed size in the last
  SETTLE_INTERVALS intervals: a miss then is the queue built before the new replicas came.
  Prompt tokens are judged by the TTFT target, output tokens by the ITL target (each by the
  pool's worst ratio when its own target is not given). Intervals with fewer than MIN_ANSWERS
  answers say nothing about latency.
- **demand** — the rate, plus its trend over the last TREND_INTERVALS intervals when it
  rises, so a ramp is met ahead rather than behind (as Dynamo's SLA planner predicts load).
- **desired** = the most any measure asks, ceil(demand / capacity) — but a pool below
  NEAR_TARGET of its target is not grown on that estimate (a capacity holds for one mix of
  work: a prefill replica's prompt tokens/s depend on prompt length and batching, and a decode
  pool sees no time between tokens in a burst of two-token answers), so the estimate sizes a
  rise ahead only once latency confirms the pool is near its limit — and while the target is
  missed by a factor m at least ceil(replicas x m) (Kubernetes' HPA rule) and one more than
  now, within `min_replicas`..`max_replicas` (what fits: plan.py's AutoscalePolicy). With no
  capacity known yet, only the target decides. Counted in tokens, the pool shrinks when the
  work does, even at a constant request rate (short prompts after long ones).
- Up at once; down only once fewer replicas would have done for `scale_down_delay_s` without a
  break, to the most any interval of that stretch wanted — so a load swinging around the target
  changes the pool at most once per delay downwards, and never down right after a miss.

Each decision is a line of the graph's `autoscale.jsonl` (time, pool, inputs, decision,
reason); the last one per pool is `autoscale.json`, which `status` shows.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from dynamo_graph.graph.plan import AutoscalePolicy, ProcessSpec
from dynamo_graph.graph.targets.local.answers import (
    Answers,
    frontend_answers,
    instance_of,
    serving_frontends,
    side,
)
from dynamo_graph.graph.targets.local.canary import endpoint_of
from dynamo_graph.graph.targets.local.load_reports import LoadWatch, PoolLoad
from dynamo_graph.graph.targets.local.runner import Runner
from dynamo_graph.graph.targets.local.state import atomic_write
from dynamo_graph.graph.targets.local.supervisor import Supervisor

MIN_ANSWERS = 5  # answers an interval needs before its latency counts
SETTLE_INTERVALS = 2  # after the pool changed size, misses do not lower the capacity this long
TREND_INTERVALS = 3
TICK_S = 0.5  # how often the loop looks whether a pool is due
NEAR_TARGET = 0.8  # below this share of its target, the capacity estimate grows nothing

# What a pool's demand and a replica's capacity are counted in.
REQUESTS = "req/s"
PROMPT_TOKENS = "prompt tokens/s"
OUTPUT_TOKENS = "output tokens/s"
SIZED_BY = {"prefill": (PROMPT_TOKENS,), "decode": (OUTPUT_TOKENS,), "agg": (PROMPT_TOKENS, OUTPUT_TOKENS)}


@dataclass
class Measured:
    """One pool over one interval."""

    ready: int
    rate: float  # requests/s sent to its instances
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    answers: int
    prompt_tokens_s: float = 0.0  # prompt tokens/s sent to its instances
    output_tokens_s: float = 0.0  # tokens/s they answered
    load: PoolLoad | None = None  # what its workers reported, per replica (load targets only)

    def demand(self, measure: str) -> float:
        return {
            REQUESTS: self.rate,
            PROMPT_TOKENS: self.prompt_tokens_s,
            OUTPUT_TOKENS: self.output_tokens_s,
        }[measure]


@dataclass
class Decision:
    time: float
    pool: str
    ready: int
    desired: int
    rate: float
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    capacity: float | None  # a replica's capacity within target in `sized_by`, as learned so far
    reason: str
    capped: str = ""  # why the pool cannot grow past max_replicas ("" when it is not at the cap)
    sized_by: str = REQUESTS  # the measure that asked for the most replicas
    prompt_tokens_s: float = 0.0
    output_tokens_s: float = 0.0
    capacities: dict[str, float] = field(default_factory=dict)  # per measure
    kv_usage: float | None = None  # the workers' load reports, per replica (load targets only)
    waiting_requests: float | None = None
    queued_prefill_tokens: float | None = None


LOADS = ("kv_usage", "waiting_requests", "queued_prefill_tokens")  # the load targets, by name


def load_ratios(policy: AutoscalePolicy, seen: Measured) -> dict[str, float]:
    """Reported / threshold per load target (above 1: over it); none without reports."""
    if seen.load is None:
        return {}
    pairs = {name: (getattr(seen.load, name), getattr(policy, name)) for name in LOADS}
    return {name: m / t for name, (m, t) in pairs.items() if t is not None}


def ratios(policy: AutoscalePolicy, seen: Measured) -> dict[str, float]:
    """Measured / target per target the interval measured (above 1: missed); none when it had
    too few answers to say."""
    if seen.answers < MIN_ANSWERS:
        return {}
    pairs = {"ttft": (seen.ttft_p90_ms, policy.ttft_p90_ms), "itl": (seen.itl_p90_ms, policy.itl_p90_ms)}
    return {k: m / t for k, (m, t) in pairs.items() if m is not None and t is not None}


def governing(measure: str, policy: AutoscalePolicy, found: dict[str, float]) -> float | None:
    """The ratio that judges a replica's capacity in `measure`: prompt tokens by the TTFT target,
    output tokens by the ITL target (by the pool's worst ratio when that target is not given),
    requests by the worst."""
    own = {PROMPT_TOKENS: ("ttft", policy.ttft_p90_ms), OUTPUT_TOKENS: ("itl", policy.itl_p90_ms)}
    name, target = own.get(measure, ("", None))
    if target is not None:
        return found.get(name)
    return max(found.values(), default=None)


@dataclass
class PoolPlanner:
    """The sizing of one pool (see the module docstring); pure, so it can be tested alone."""

    pool: str
    capacities: dict[str, float] = field(default_factory=dict)  # per measure, a replica's
    rates: deque[Measured] = field(default_factory=lambda: deque(maxlen=TREND_INTERVALS))
    counted: set[str] = field(default_factory=set)  # the token measures the frontends reported
    fewer_since: float | None = None  # when fewer replicas started to look enough
    fewer_most: int = 0  # the most replicas any interval since then wanted
    ready_was: int = -1  # ready replicas at the last decision
    resized_at: float = float("-inf")  # when the ready count last changed

    def measures(self, policy: AutoscalePolicy) -> list[str]:
        """What the pool is sized by: its role's token measures once the frontends count them
        (a frontend before token counts, or a text-input engine: requests)."""
        counted = [m for m in SIZED_BY.get(policy.role, SIZED_BY["agg"]) if m in self.counted]
        return counted or [REQUESTS]

    def decide(self, policy: AutoscalePolicy, seen: Measured, now: float) -> Decision:
        self.counted.update(m for m in (PROMPT_TOKENS, OUTPUT_TOKENS) if seen.demand(m) > 0)
        found, loads = ratios(policy, seen), load_ratios(policy, seen)
        ratio = max([*found.values(), *loads.values()], default=None)
        over = ratio if ratio is not None and ratio > 1.0 else None  # how far the target was missed
        if seen.ready != self.ready_was:
            self.ready_was, self.resized_at = seen.ready, now
        settled = now - self.resized_at >= SETTLE_INTERVALS * policy.interval_s
        measures = self.measures(policy)
        for measure in measures:
            self._learn(measure, governing(measure, policy, found), seen, settled)
        self.rates.append(seen)
        wanted, why, sized_by = seen.ready, "no capacity measured yet", measures[0]
        estimates = [(self._wanted(m, seen), m) for m in measures if self.capacities.get(m)]
        if estimates:
            (wanted, why), sized_by = max(estimates, key=lambda e: e[0][0])
            if wanted > seen.ready and (ratio is None or ratio < NEAR_TARGET):
                wanted = seen.ready  # headroom left: the estimate may be another mix's
                at = "an unmeasured share" if ratio is None else f"{ratio:.2f}"
                why = f"{why}, but the pool is at {at} of its target"
        if loads:  # as Kubernetes' HPA on a utilization: replicas x reported / threshold
            name, most = max(loads.items(), key=lambda item: item[1])
            by_load = math.ceil(seen.ready * most - 1e-9)
            if by_load > wanted or not (policy.ttft_p90_ms or policy.itl_p90_ms):
                wanted = by_load
                why = f"{name} at {most:.2f} of its threshold a replica"
        floor = max(seen.ready + 1, math.ceil(seen.ready * over)) if over is not None else 0
        if wanted < floor:  # as Kubernetes' HPA: replicas x measured / target
            wanted = floor
            why = f"target missed by {over:.2f}x"
        wanted = min(max(wanted, policy.min_replicas), policy.max_replicas)
        desired, why = self._stabilized(policy, seen.ready, wanted, why, now, over is not None)
        capped = policy.capped if wanted >= policy.max_replicas and policy.capped else ""
        capacity = self.capacities.get(sized_by)
        return Decision(
            now,
            self.pool,
            seen.ready,
            desired,
            round(seen.rate, 3),
            seen.ttft_p90_ms,
            seen.itl_p90_ms,
            None if capacity is None else round(capacity, 3),
            why,
            capped,
            sized_by,
            round(seen.prompt_tokens_s, 1),
            round(seen.output_tokens_s, 1),
            {m: round(c, 3) for m, c in self.capacities.items()},
            *(None if seen.load is None else round(getattr(seen.load, name), 3) for name in LOADS),
        )

    def _learn(self, measure: str, ratio: float | None, seen: Measured, settled: bool) -> None:
        """Raise a replica's capacity in `measure` to what an interval within the target showed;
        lower it to what the target would have allowed after a miss (not while unsettled)."""
        if ratio is None or not seen.ready:  # the interval measured nothing of the target
            return
        per_replica = seen.demand(measure) / seen.ready
        known = self.capacities.get(measure)
        if ratio <= 1.0 and per_replica > 0:
            self.capacities[measure] = max(known or 0.0, per_replica)
        elif ratio > 1.0 and (settled or known is None):
            limit = per_replica / ratio
            self.capacities[measure] = limit if known is None else min(known, limit)

    def _wanted(self, measure: str, seen: Measured) -> tuple[int, str]:
        """Replicas the demand in `measure` asks for: the rate, plus its rise per interval over
        the last TREND_INTERVALS when it rises, at a replica's capacity."""
        rates = [m.demand(measure) for m in self.rates]
        trend = (rates[-1] - rates[0]) / max(len(rates) - 1, 1)
        demand = seen.demand(measure) + max(trend, 0.0)
        capacity = self.capacities[measure]
        why = f"{demand:.1f} {measure} wanted at {capacity:.1f} {measure} a replica"
        return math.ceil(demand / capacity), why

    def _stabilized(
        self, policy: AutoscalePolicy, ready: int, wanted: int, why: str, now: float, missing: bool
    ) -> tuple[int, str]:
        if wanted >= ready or missing:
            self.fewer_since = None
            return max(wanted, ready), why
        if self.fewer_since is None:
            self.fewer_since, self.fewer_most = now, wanted
        self.fewer_most = max(self.fewer_most, wanted)
        waited = now - self.fewer_since
        if waited < policy.scale_down_delay_s:
            return ready, f"{why}; {wanted} would do for {waited:.0f} of {policy.scale_down_delay_s:g} s"
        self.fewer_since = None
        return self.fewer_most, f"{why}; fewer did for {policy.scale_down_delay_s:g} s"


@dataclass
class Member:
    """A process of a pool that runs (or is starting), each rank of a multi-node replica one:
    its spec, readiness and instance id."""

    spec: ProcessSpec
    ready: bool
    instance: str | None  # as its current run announced it; None before it did


class Pools(Protocol):
    """What the autoscaler needs of whatever runs the graph: the local supervisor
    (SupervisorPools), or a Slurm job's planner step (targets/slurm/autoscale.py)."""

    root: Path  # the graph's state dir: the decision log goes there

    @property
    def stopping(self) -> bool: ...

    def policies(self) -> dict[str, AutoscalePolicy]: ...

    def busy(self) -> bool:
        """A change is under way: no pool is measured meanwhile."""
        ...

    async def answers(self) -> dict[str, Answers]:
        """Per instance, what every ready frontend counted so far."""
        ...

    def members(self, pool: str) -> list[Member]: ...

    def current(self, pool: str) -> int:
        """The replicas (not ranks) the pool was last asked to run."""
        ...

    async def scale(self, pool: str, replicas: int) -> bool:
        """Run `replicas` of the pool (new ones prove ready, removed ones drain); whether it changed."""
        ...

    def report(self, line: str) -> None: ...


class SupervisorPools:
    """The local (and SSH) supervisor's pools: its runners, and its rollouts to scale them."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.root = sup.state.root

    @property
    def stopping(self) -> bool:
        return self.sup.stopping

    def policies(self) -> dict[str, AutoscalePolicy]:
        plan = self.sup.full_plan
        return plan.autoscale if plan else {}

    def busy(self) -> bool:
        return self.sup.scaling or self.sup.rolling is not None

    async def answers(self) -> dict[str, Answers]:
        return await frontend_answers(serving_frontends(self.sup.runners.values()))

    def _runners(self, pool: str) -> list[Runner]:
        return [r for r in self.sup.runners.values() if r.spec.component == pool]

    def members(self, pool: str) -> list[Member]:
        return [Member(r.spec, r.ready.is_set(), instance_of(r)) for r in self._runners(pool)]

    def current(self, pool: str) -> int:
        return self.sup.desired.get(pool, sum(r.spec.rank == 0 for r in self._runners(pool)))

    async def scale(self, pool: str, replicas: int) -> bool:
        return bool(await self.sup.scale(pool, replicas))

    def report(self, line: str) -> None:
        self.sup.report("dyngraph", line)


class Autoscaler:
    """The loop that measures each autoscaled pool on its interval and asks the pools' owner
    for the replicas its planner decided."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.planners: dict[str, PoolPlanner] = {}
        self.last: dict[str, tuple[float, dict[str, Answers]]] = {}  # pool -> (when, tally)
        self.decisions: dict[str, Decision] = {}
        self.changes: Counter[tuple[str, str]] = Counter()  # (pool, "up" | "down") -> times
        self.watches: dict[str, LoadWatch] = {}  # pools with load targets: their workers' reports
        self.log = pools.root / "autoscale.jsonl"
        self.summary = pools.root / "autoscale.json"
        self.summary.unlink(missing_ok=True)  # a previous run's last decisions

    async def run(self) -> None:
        try:
            while not self.pools.stopping:
                now = time.monotonic()
                due = [
                    (pool, policy)
                    for pool, policy in self.pools.policies().items()
                    if now >= self.last.get(pool, (0.0, {}))[0] + policy.interval_s
                ]
                if due and not self.pools.busy():
                    tally = await self.pools.answers()  # one look at every frontend serves every pool due now
                    for pool, policy in due:
                        await self._tick(pool, policy, tally)
                await asyncio.sleep(TICK_S)
        finally:
            for watch in self.watches.values():
                await watch.close()

    async def _watch(self, pool: str, policy: AutoscalePolicy, members: list[Member]) -> LoadWatch | None:
        """The pool's load reports, subscribed at its first look, when it has load targets."""
        if all(getattr(policy, name) is None for name in LOADS) or not members:
            return None
        watch = self.watches.get(pool)
        if watch is None:
            spec = members[0].spec
            watch = self.watches[pool] = LoadWatch(endpoint_of(spec), spec.env)
            await watch.start()
        return watch

    async def _tick(self, pool: str, policy: AutoscalePolicy, tally: dict[str, Answers]) -> None:
        members = self.pools.members(pool)
        # A replica is its leader (rank 0; a multi-node replica's other ranks serve nothing).
        ready = [m for m in members if m.ready and m.spec.rank == 0]
        ids = {m.instance for m in ready if m.instance}
        watch = await self._watch(pool, policy, members)
        now = time.monotonic()
        previous = self.last.get(pool)
        self.last[pool] = (now, tally)
        if previous is None:
            return  # the first look: nothing to compare with yet
        window = side(previous[1], tally, ids)
        load = None if watch is None else watch.take({int(i, 16) for i in ids})
        elapsed = max(now - previous[0], 1e-6)
        seen = Measured(
            ready=len(ready),
            rate=window.requests / elapsed,
            ttft_p90_ms=window.ttft_p90_ms(),
            itl_p90_ms=window.itl_p90_ms(),
            answers=window.requests,
            prompt_tokens_s=window.prompt_tokens / elapsed,
            output_tokens_s=window.output_tokens / elapsed,
            load=load,
        )
        planner = self.planners.setdefault(pool, PoolPlanner(pool))
        decision = planner.decide(policy, seen, now)
        decision.time = time.time()
        self._record(decision)
        current = self.pools.current(pool)
        steady = all(m.ready for m in members)  # every rank of every replica
        if decision.desired != current and steady and await self.pools.scale(pool, decision.desired):
            self.changes[(pool, "up" if decision.desired > current else "down")] += 1
            self.pools.report(f"autoscale {pool}: {current} -> {decision.desired} ({decision.reason})")

    def _record(self, decision: Decision) -> None:
        self.decisions[decision.pool] = decision
        line = json.dumps(asdict(decision), sort_keys=True)
        with self.log.open("a") as log:
            log.write(line + "\n")
        atomic_write(self.summary, json.dumps({p: asdict(d) for p, d in self.decisions.items()}, indent=2))
