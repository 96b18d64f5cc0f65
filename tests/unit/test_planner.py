"""The autoscaler's sizing of one pool, interval by interval (planner.PoolPlanner: no processes)."""

from __future__ import annotations

from dynamo_graph.graph.plan import AutoscalePolicy
from dynamo_graph.graph.targets.local.planner import Measured, PoolPlanner

POLICY = AutoscalePolicy(
    min_replicas=1,
    max_replicas=4,
    wanted_max=4,
    capped="",
    ttft_p90_ms=500.0,
    itl_p90_ms=None,
    interval_s=5.0,
    scale_down_delay_s=30.0,
)


def seen(ready: int, rate: float, ttft: float | None, answers: int = 50) -> Measured:
    return Measured(ready=ready, rate=rate, ttft_p90_ms=ttft, itl_p90_ms=None, answers=answers)


def test_a_miss_sizes_the_pool_by_the_rate_the_target_would_have_allowed() -> None:
    decision = PoolPlanner("p").decide(POLICY, seen(1, 10.0, 1500.0), now=0.0)
    assert decision.capacity == 3.333 and decision.desired == 3  # 10 req/s at 3.3 a replica


def test_capacity_is_learned_within_the_target_and_sizes_a_rising_load_ahead() -> None:
    planner = PoolPlanner("p")
    assert planner.decide(POLICY, seen(1, 4.0, 200.0), now=0.0).desired == 1
    assert planner.capacity == 4.0
    # 4 -> 6 req/s, still within the target: 6 a replica shown, but 8 coming (+2 an interval).
    decision = planner.decide(POLICY, seen(1, 6.0, 450.0), now=5.0)
    assert planner.capacity == 6.0 and decision.desired == 2, decision


def test_a_miss_lowers_the_capacity_in_proportion() -> None:
    planner = PoolPlanner("p", capacity=10.0, ready_was=2, resized_at=-100.0)
    planner.decide(POLICY, seen(2, 10.0, 1000.0), now=0.0)  # 5 req/s a replica, 2x over
    assert planner.capacity == 2.5


def test_a_miss_just_after_the_pool_grew_is_the_old_queue_not_the_capacity() -> None:
    planner = PoolPlanner("p", capacity=10.0, ready_was=2, resized_at=-100.0)
    planner.decide(POLICY, seen(4, 10.0, 1000.0), now=0.0)  # two more just came
    planner.decide(POLICY, seen(4, 10.0, 800.0), now=5.0)
    assert planner.capacity == 10.0
    planner.decide(POLICY, seen(4, 10.0, 1000.0), now=10.0)  # settled: now it counts
    assert planner.capacity == 1.25


def test_scale_down_waits_for_the_delay_and_takes_the_most_wanted_meanwhile() -> None:
    planner = PoolPlanner("p", capacity=4.0)
    assert planner.decide(POLICY, seen(4, 6.0, 100.0), now=0.0).desired == 4  # 2 would do
    assert planner.decide(POLICY, seen(4, 8.0, 100.0), now=10.0).desired == 4  # 3 would (trend)
    assert planner.decide(POLICY, seen(4, 6.0, 100.0), now=25.0).desired == 4
    decision = planner.decide(POLICY, seen(4, 6.0, 100.0), now=31.0)
    assert decision.desired == 3 and "fewer did for 30 s" in decision.reason  # the bump counted
    for now in (36.0, 46.0, 56.0):
        assert planner.decide(POLICY, seen(3, 6.0, 100.0), now=now).desired == 3
    decision = planner.decide(POLICY, seen(3, 6.0, 100.0), now=67.0)
    assert decision.desired == 2, decision


def test_wanting_as_many_as_run_breaks_the_stretch() -> None:
    planner = PoolPlanner("p", capacity=4.0)
    planner.decide(POLICY, seen(4, 6.0, 100.0), now=0.0)  # 2 would do
    planner.decide(POLICY, seen(4, 16.0, 100.0), now=20.0)  # 4 would not
    assert planner.decide(POLICY, seen(4, 6.0, 100.0), now=35.0).desired == 4


def test_a_load_swinging_around_the_target_changes_the_pool_down_at_most_once_per_delay() -> None:
    planner = PoolPlanner("p", capacity=4.0)
    ready, changes = 2, 0
    for step in range(60):  # 5 minutes of 5 s intervals, over and under the target in turns
        over = step % 2 == 0
        decision = planner.decide(POLICY, seen(ready, 6.0, 700.0 if over else 300.0), now=step * 5.0)
        if decision.desired != ready:
            changes += 1
            ready = decision.desired
    assert changes <= 2, changes  # up once to what the load needs; no down while it keeps missing


def test_too_few_answers_say_nothing_about_latency() -> None:
    decision = PoolPlanner("p").decide(POLICY, seen(1, 0.2, 5000.0, answers=1), now=0.0)
    assert decision.desired == 1 and decision.capacity is None


def test_a_pool_at_its_gpu_cap_says_so() -> None:
    capped = AutoscalePolicy(1, 2, 4, "host 'local' has 2 GPU(s) and 1 per replica", 500.0, None, 5.0, 30.0)
    decision = PoolPlanner("p").decide(capped, seen(2, 10.0, 2000.0), now=0.0)
    assert decision.desired == 2 and "has 2 GPU(s)" in decision.capped


def test_a_pool_well_within_its_target_is_not_grown_on_its_capacity_estimate() -> None:
    planner = PoolPlanner("p")
    planner.decide(POLICY, seen(1, 4.0, 100.0), now=0.0)  # 4 req/s a replica shown, 0.2 of target
    decision = planner.decide(POLICY, seen(1, 8.0, 150.0), now=5.0)  # rising, still far within
    assert decision.desired == 1 and "0.30 of its target" in decision.reason, decision
    decision = planner.decide(POLICY, seen(1, 9.0, 450.0), now=10.0)  # near it: sized ahead
    assert decision.desired == 2, decision
