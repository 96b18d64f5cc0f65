"""The autoscaler: one planner per graph, in its supervisor, sizing each autoscaled pool from
what the graph measures, and the supervisor's rollout machinery acting on it.

Every `interval_s` a pool's planner reads what every ready frontend counted per instance since
its last look (answers.py): the requests sent to the pool's instances (its arrival rate), their
time to first response and between responses (TTFT and ITL, one token per response). Then:

- **capacity** — the request rate one replica serves within the target, learned online: an
  interval within the target at r requests/s per replica raises it to at least r (the best a
  replica has shown); an interval over the target caps it at r x target / measured, the rate
  the target would have allowed if latency grows in proportion — unless the pool changed size
  in the last SETTLE_INTERVALS intervals: a miss then is the queue built before the new
  replicas came. Intervals with fewer than MIN_ANSWERS answers say nothing about latency.
- **demand** — the arrival rate, plus its trend over the last TREND_INTERVALS intervals when it
  rises, so a ramp is met ahead rather than behind (as Dynamo's SLA planner predicts load).
- **desired** = ceil(demand / capacity) — but a pool below NEAR_TARGET of its target is not
  grown on that estimate: a capacity in requests/s holds for one mix of requests only (a
  prefill pool that learned it on long prompts serves far more short ones, and a decode pool
  sees no time between tokens in a burst of two-token answers), so the estimate sizes a rise
  ahead only once latency confirms the pool is near its limit — and while the target is
  missed by a factor m at least ceil(replicas x m) (Kubernetes' HPA rule) and one more than now, within
  `min_replicas`..`max_replicas` (what fits: plan.py's AutoscalePolicy). With no capacity
  known yet, only the target decides.
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

from dynamo_graph.graph.plan import AutoscalePolicy
from dynamo_graph.graph.targets.local.answers import (
    Answers,
    frontend_answers,
    instance_of,
    serving_frontends,
    side,
)
from dynamo_graph.graph.targets.local.state import atomic_write
from dynamo_graph.graph.targets.local.supervisor import Supervisor

MIN_ANSWERS = 5  # answers an interval needs before its latency counts
SETTLE_INTERVALS = 2  # after the pool changed size, misses do not lower the capacity this long
TREND_INTERVALS = 3
TICK_S = 0.5  # how often the loop looks whether a pool is due
NEAR_TARGET = 0.8  # below this share of its target, the capacity estimate grows nothing


@dataclass
class Measured:
    """One pool over one interval."""

    ready: int
    rate: float  # requests/s sent to its instances
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    answers: int


@dataclass
class Decision:
    time: float
    pool: str
    ready: int
    desired: int
    rate: float
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    capacity: float | None  # requests/s per replica within target, as learned so far
    reason: str
    capped: str = ""  # why the pool cannot grow past max_replicas ("" when it is not at the cap)


def load_ratio(policy: AutoscalePolicy, seen: Measured) -> float | None:
    """The pool's worst measured / target over its targets (above 1: missed), or None when the
    interval had too few answers to say."""
    if seen.answers < MIN_ANSWERS:
        return None
    ratios = [
        measured / target
        for measured, target in (
            (seen.ttft_p90_ms, policy.ttft_p90_ms),
            (seen.itl_p90_ms, policy.itl_p90_ms),
        )
        if measured is not None and target is not None
    ]
    return max(ratios, default=None)


@dataclass
class PoolPlanner:
    """The sizing of one pool (see the module docstring); pure, so it can be tested alone."""

    pool: str
    capacity: float | None = None
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=TREND_INTERVALS))
    fewer_since: float | None = None  # when fewer replicas started to look enough
    fewer_most: int = 0  # the most replicas any interval since then wanted
    ready_was: int = -1  # ready replicas at the last decision
    resized_at: float = float("-inf")  # when the ready count last changed

    def decide(self, policy: AutoscalePolicy, seen: Measured, now: float) -> Decision:
        ratio = load_ratio(policy, seen)
        over = ratio if ratio is not None and ratio > 1.0 else None  # how far the target was missed
        per_replica = seen.rate / max(seen.ready, 1)
        if seen.ready != self.ready_was:
            self.ready_was, self.resized_at = seen.ready, now
        settled = now - self.resized_at >= SETTLE_INTERVALS * policy.interval_s
        if ratio is not None and seen.ready:  # the interval measured what the targets name
            if over is None and per_replica > 0:
                self.capacity = max(self.capacity or 0.0, per_replica)
            elif over is not None and (settled or self.capacity is None):
                limit = per_replica / over
                self.capacity = limit if self.capacity is None else min(self.capacity, limit)
        self.rates.append(seen.rate)
        trend = (self.rates[-1] - self.rates[0]) / max(len(self.rates) - 1, 1)
        demand = seen.rate + max(trend, 0.0)
        if self.capacity:
            wanted = math.ceil(demand / self.capacity)
            why = f"{demand:.1f} req/s wanted at {self.capacity:.1f} req/s a replica"
            if wanted > seen.ready and (ratio is None or ratio < NEAR_TARGET):
                wanted = seen.ready  # headroom left: the estimate may be another mix's
                at = "an unmeasured share" if ratio is None else f"{ratio:.2f}"
                why = f"{why}, but the pool is at {at} of its target"
        else:
            wanted = seen.ready
            why = "no capacity measured yet"
        floor = max(seen.ready + 1, math.ceil(seen.ready * over)) if over is not None else 0
        if wanted < floor:  # as Kubernetes' HPA: replicas x measured / target
            wanted = floor
            why = f"target missed by {over:.2f}x"
        wanted = min(max(wanted, policy.min_replicas), policy.max_replicas)
        desired, why = self._stabilized(policy, seen.ready, wanted, why, now, over is not None)
        capped = policy.capped if wanted >= policy.max_replicas and policy.capped else ""
        return Decision(
            now,
            self.pool,
            seen.ready,
            desired,
            round(seen.rate, 3),
            seen.ttft_p90_ms,
            seen.itl_p90_ms,
            None if self.capacity is None else round(self.capacity, 3),
            why,
            capped,
        )

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


class Autoscaler:
    """The loop that measures each autoscaled pool on its interval and asks the supervisor for
    the replicas its planner decided."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.planners: dict[str, PoolPlanner] = {}
        self.last: dict[str, tuple[float, dict[str, Answers]]] = {}  # pool -> (when, tally)
        self.decisions: dict[str, Decision] = {}
        self.changes: Counter[tuple[str, str]] = Counter()  # (pool, "up" | "down") -> times
        self.log = sup.state.root / "autoscale.jsonl"
        self.summary = sup.state.root / "autoscale.json"
        self.summary.unlink(missing_ok=True)  # a previous run's last decisions

    async def run(self) -> None:
        while not self.sup.stopping:
            plan = self.sup.full_plan
            now = time.monotonic()
            due = [
                (pool, policy)
                for pool, policy in (plan.autoscale if plan else {}).items()
                if now >= self.last.get(pool, (0.0, {}))[0] + policy.interval_s
            ]
            if due and not self.sup.scaling and self.sup.rolling is None:
                # One look at every frontend serves every pool due now.
                tally = await frontend_answers(serving_frontends(self.sup.runners.values()))
                for pool, policy in due:
                    await self._tick(pool, policy, tally)
            await asyncio.sleep(TICK_S)

    async def _tick(self, pool: str, policy: AutoscalePolicy, tally: dict[str, Answers]) -> None:
        sup = self.sup
        runners = [r for r in sup.runners.values() if r.spec.component == pool]
        ready = [r for r in runners if r.ready.is_set()]
        ids = {i for r in ready if (i := instance_of(r))}
        now = time.monotonic()
        previous = self.last.get(pool)
        self.last[pool] = (now, tally)
        if previous is None:
            return  # the first look: nothing to compare with yet
        window = side(previous[1], tally, ids)
        seen = Measured(
            ready=len(ready),
            rate=window.requests / max(now - previous[0], 1e-6),
            ttft_p90_ms=window.ttft_p90_ms(),
            itl_p90_ms=window.itl_p90_ms(),
            answers=window.requests,
        )
        planner = self.planners.setdefault(pool, PoolPlanner(pool))
        decision = planner.decide(policy, seen, now)
        decision.time = time.time()
        self._record(decision)
        current = sup.desired.get(pool, len(runners))
        if decision.desired != current and len(ready) == len(runners):
            lines = await sup.scale(pool, decision.desired)
            if lines:
                self.changes[(pool, "up" if decision.desired > current else "down")] += 1
                sup.report(
                    "dyngraph", f"autoscale {pool}: {current} -> {decision.desired} ({decision.reason})"
                )

    def _record(self, decision: Decision) -> None:
        self.decisions[decision.pool] = decision
        line = json.dumps(asdict(decision), sort_keys=True)
        with self.log.open("a") as log:
            log.write(line + "\n")
        atomic_write(self.summary, json.dumps({p: asdict(d) for p, d in self.decisions.items()}, indent=2))
