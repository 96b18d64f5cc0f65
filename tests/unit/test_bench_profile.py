"""`bench --profile` and `--compare-static`: the load profile's arrivals, and the comparison's
arithmetic (SLA attainment, replica-seconds, targets, variants)."""

from __future__ import annotations

import itertools
import math

import pytest

from dynamo_graph.bench.autoscale import attainment, targets, variants
from dynamo_graph.bench.replicas import arrivals, parse_profile, profile_seconds, replica_seconds
from dynamo_graph.graph.schema import Autoscale


def test_steps_and_ramps_parse_and_send_what_their_rates_integrate_to() -> None:
    phases = parse_profile("6:2, 4:0-8,2:0,1:30")
    assert phases == [(6.0, 2.0), (4.0, 0.0, 8.0), (2.0, 0.0), (1.0, 30.0)]
    assert profile_seconds(phases) == 13.0
    times = arrivals(phases)
    assert len(times) == 12 + 16 + 0 + 30
    assert times[:3] == [0.0, 0.5, 1.0]
    ramp = [t - 6 for t in times[12:28]]
    # a rate rising 0 -> 8 over 4 s has sent k requests by t where t^2 = k
    assert all(math.isclose(t, math.sqrt(k)) for k, t in enumerate(ramp))
    assert times[28] == 12.0 and times == sorted(times)
    down = arrivals([(4.0, 8.0, 0.0)])
    assert len(down) == 16 and down == sorted(down) and down[-1] < 4.0
    gaps = [b - a for a, b in itertools.pairwise(down)]
    assert gaps == sorted(gaps)  # the falling rate spaces them further apart


@pytest.mark.parametrize("bad", ["6", "0:2", "5:-1", "5:a", "5:2-x", "3:0", ""])
def test_a_bad_profile_names_the_part(bad: str) -> None:
    with pytest.raises(ValueError, match=r"SECONDS:RATE|sends no request"):
        parse_profile(bad)


def test_replica_seconds_hold_each_count_until_the_next_sample() -> None:
    assert replica_seconds([(10.0, 1), (12.0, 3), (13.0, 2), (15.0, 2)]) == 2 * 1 + 1 * 3 + 2 * 2
    assert replica_seconds([(10.0, 4)]) == 0


def test_sla_attainment_counts_lost_requests_as_misses_and_checks_both_targets() -> None:
    row = {"ok": True, "ttft_ms": 100.0, "itl_p50_ms": 10.0, "output_tokens": 20}
    rows = [
        row,
        {**row, "ttft_ms": 300.0},  # late first token
        {**row, "itl_p50_ms": 60.0},  # slow tokens
        {**row, "ok": False},  # lost
        {**row, "itl_p50_ms": 99.0, "output_tokens": 1},  # one token: no time between tokens
    ]
    assert attainment(rows, {"ttft_ms": 250.0, "itl_ms": 50.0}) == 0.4
    assert attainment(rows, {"ttft_ms": 250.0}) == 0.6
    assert attainment([], {"ttft_ms": 1.0}) == 0.0


def test_the_tightest_target_of_the_pools_and_a_static_variant_per_count() -> None:
    pools = {
        "prefill": Autoscale(max_replicas=3, target={"ttft_p90_ms": 400}),
        "decode": Autoscale(max_replicas=3, target={"ttft_p90_ms": 300, "itl_p90_ms": 40}),
    }
    assert targets(pools) == {"ttft_ms": 300, "itl_ms": 40}
    assert variants(["backend"], [1, 4]) == [
        ("autoscale", []),
        ("static-1", ["components.backend.replicas=1", "~components.backend.autoscale"]),
        ("static-4", ["components.backend.replicas=4", "~components.backend.autoscale"]),
    ]
