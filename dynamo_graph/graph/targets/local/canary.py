"""What a canary rollout steers and judges: the traffic split and the two sides' answers.

At each of `rollout.steps` (percent) the rollout (rollout.py: `Rollout._canary`) runs enough
new replicas beside all the old ones, and `TrafficSplit` sends that share of the component's
requests to the instances labelled with the new revision (runtime/traffic.py: one discovery key
the supervisor holds under its own lease, so a supervisor that dies takes its split with it).
After `pause_s` the answers every frontend counted per instance (answers.py: requests, errors,
time to first response) are summed per side over the step, and `judge` compares them: a new
side that fails more often than the old by more than `max_error_rate_increase`, or whose time
to first token p90 is above `max_ttft_p90_ratio` times the old side's, fails the step and the
new replicas are stopped (their streams finish); the old revision serves as before.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from dynamo_graph.graph.plan import ProcessSpec, RolloutPolicy
from dynamo_graph.graph.targets.local.answers import Answers
from dynamo_graph.graph.targets.local.load_reports import discovery_of
from dynamo_graph.runtime.discovery import Discovery, DiscoveryError
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.traffic import TrafficSplit as SplitRecord
from dynamo_graph.runtime.traffic import traffic_key


class RolloutFailed(Exception):
    """The rollout cannot go on: a new run did not prove itself (or lost its comparison), or
    its traffic could not be steered; the message names what and says why."""


class Verdict(NamedTuple):
    ok: bool
    why: str  # what was compared, and why it failed if it did


def judge(new: Answers, old: Answers, policy: RolloutPolicy, errors_only: bool = False) -> Verdict:
    """The new side against the old over one step (see the module docstring). Time to first
    token is compared only where both sides answered `min_requests` (and not `errors_only`)."""
    seen = f"new: {new.describe()}; old: {old.describe()}"
    if new.errors and new.error_rate > old.error_rate + policy.max_error_rate_increase:
        return Verdict(
            False,
            f"error rate {new.error_rate:.1%} against {old.error_rate:.1%} "
            f"(allowed +{policy.max_error_rate_increase:.1%}); {seen}",
        )
    enough = min(new.requests, old.requests) >= policy.min_requests
    new_p90, old_p90 = new.ttft_p90_ms(), old.ttft_p90_ms()
    if errors_only or not enough or new_p90 is None or old_p90 is None:
        return Verdict(True, seen if enough else f"{seen} (too few requests to compare TTFT)")
    if new_p90 > policy.max_ttft_p90_ratio * old_p90:
        return Verdict(
            False,
            f"TTFT p90 {new_p90:.0f} ms against {old_p90:.0f} ms "
            f"(allowed {policy.max_ttft_p90_ratio:g}x); {seen}",
        )
    return Verdict(True, seen)


def endpoint_of(spec: ProcessSpec) -> EndpointName:
    """The endpoint a worker's command line serves (`in=dyn://ns.component.endpoint`)."""
    for arg in spec.argv:
        if arg.startswith("in=dyn://"):
            return EndpointName.parse(arg.removeprefix("in="))
    raise ValueError(f"{spec.name} serves no dyn:// endpoint: it cannot be a canary")


class TrafficSplit:
    """The component's split between revisions, held in discovery while the canary runs (the
    same backend, folder or endpoints the graph's processes use, and with TLS the credentials,
    from their environment)."""

    def __init__(self, spec: ProcessSpec, revision: int) -> None:
        endpoint = endpoint_of(spec)
        self.key = traffic_key(endpoint.namespace, endpoint.component)
        self.labels = {"revision": str(revision)}
        self.discovery: Discovery = discovery_of(spec.env)

    async def __aenter__(self) -> TrafficSplit:
        try:
            await self.discovery.start()
        except (DiscoveryError, OSError) as err:
            raise RolloutFailed(f"cannot reach discovery to split {self.key}'s traffic: {err}") from err
        return self

    async def share(self, fraction: float) -> None:
        """Send `fraction` of the requests to the new revision's instances."""
        record = SplitRecord(self.labels, fraction)
        try:
            await self.discovery.put(self.key, msgspec.json.encode(record))
        except (DiscoveryError, OSError) as err:
            raise RolloutFailed(f"cannot set {self.key}'s traffic split: {err}") from err

    async def __aexit__(self, *exc: object) -> None:
        """Lift the split (every instance a candidate again) and leave discovery."""
        await self.discovery.close()
