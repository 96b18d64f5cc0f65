"""The autoscaler's sizing of one pool, interval by interval (planner.PoolPlanner: no processes)."""

from __future__ import annotations

from dynamo_graph.graph.plan import AutoscalePolicy
from dynamo_graph.graph.targets.local.planner import REQUESTS, Measured, PoolPlanner

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
    assert planner.capacities[REQUESTS] == 4.0
    # 4 -> 6 req/s, still within the target: 6 a replica shown, but 8 coming (+2 an interval).
    decision = planner.decide(POLICY, seen(1, 6.0, 450.0), now=5.0)
    assert planner.capacities[REQUESTS] == 6.0 and decision.desired == 2, decision


def test_a_miss_lowers_the_capacity_in_proportion() -> None:
    planner = PoolPlanner("p", capacities={REQUESTS: 10.0}, ready_was=2, resized_at=-100.0)
    planner.decide(POLICY, seen(2, 10.0, 1000.0), now=0.0)  # 5 req/s a replica, 2x over
    assert planner.capacities[REQUESTS] == 2.5


def test_a_miss_just_after_the_pool_grew_is_the_old_queue_not_the_capacity() -> None:
    planner = PoolPlanner("p", capacities={REQUESTS: 10.0}, ready_was=2, resized_at=-100.0)
    planner.decide(POLICY, seen(4, 10.0, 1000.0), now=0.0)  # two more just came
    planner.decide(POLICY, seen(4, 10.0, 800.0), now=5.0)
    assert planner.capacities[REQUESTS] == 10.0
    planner.decide(POLICY, seen(4, 10.0, 1000.0), now=10.0)  # settled: now it counts
    assert planner.capacities[REQUESTS] == 1.25


def test_scale_down_waits_for_the_delay_and_takes_the_most_wanted_meanwhile() -> None:
    planner = PoolPlanner("p", capacities={REQUESTS: 4.0})
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
    planner = PoolPlanner("p", capacities={REQUESTS: 4.0})
    planner.decide(POLICY, seen(4, 6.0, 100.0), now=0.0)  # 2 would do
    planner.decide(POLICY, seen(4, 16.0, 100.0), now=20.0)  # 4 would not
    assert planner.decide(POLICY, seen(4, 6.0, 100.0), now=35.0).desired == 4


def test_a_load_swinging_around_the_target_changes_the_pool_down_at_most_once_per_delay() -> None:
    planner = PoolPlanner("p", capacities={REQUESTS: 4.0})
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


def pool(role: str, ttft: float | None, itl: float | None) -> AutoscalePolicy:
    return AutoscalePolicy(1, 4, 4, "", ttft, itl, 5.0, 30.0, role=role)


def tokens(
    ready: int, rate: float, prompt: float, output: float, ttft: float | None, itl: float | None
) -> Measured:
    """`rate` requests/s of `prompt` prompt tokens and `output` output tokens each."""
    return Measured(ready, rate, ttft, itl, 50, prompt_tokens_s=rate * prompt, output_tokens_s=rate * output)


def _run(policy: AutoscalePolicy, phases: list[tuple[int, float, float]], counts_tokens: bool) -> list[int]:
    """A prefill pool at a constant 12 requests/s through `phases` of (intervals, prompt tokens,
    TTFT p90 ms at one replica; shared by the replicas that run): the replicas after each."""
    planner, ready, sizes, now = PoolPlanner("prefill"), 1, [], 0.0
    for intervals, prompt, ttft_one in phases:
        for _ in range(intervals):
            ttft = ttft_one / ready
            seen = tokens(ready, 12.0, prompt, 1.0, ttft, None)
            if not counts_tokens:
                seen = Measured(ready, 12.0, ttft, None, 50)  # what a frontend without token counts says
            ready = planner.decide(policy, seen, now).desired
            sizes.append(ready)
            now += 5.0
    return sizes


def test_a_prefill_pool_follows_prompt_tokens_where_a_request_rate_cannot_tell() -> None:
    """Recorded shape of the disagg system test: 12 requests/s throughout; prompts of 100
    tokens, then 1,000 (TTFT 1.2 s on one replica), then 100 again."""
    phases = [(3, 100.0, 120.0), (6, 1000.0, 1200.0), (10, 100.0, 120.0)]
    policy = pool("prefill", 500.0, None)
    by_tokens = _run(policy, phases, counts_tokens=True)
    assert by_tokens[3] == 4 and by_tokens[-1] == 1, by_tokens  # grew at once, then shrank back
    sizes = _run(policy, phases, counts_tokens=False)
    # 12 req/s is 12 req/s: the capacity learned while long prompts missed keeps the pool big.
    assert max(sizes[3:9]) >= 3 and sizes[-1] >= 3, sizes


def test_a_decode_pool_is_sized_by_output_tokens_against_its_itl_target() -> None:
    planner, policy = PoolPlanner("decode"), pool("decode", None, 50.0)
    # 10 requests/s throughout; answers of 20, 40, then 60 tokens, ITL creeping up on one replica.
    assert planner.decide(policy, tokens(1, 10.0, 300.0, 20.0, None, 20.0), 0.0).desired == 1
    assert planner.decide(policy, tokens(1, 10.0, 300.0, 40.0, None, 30.0), 5.0).desired == 1  # 0.6
    decision = planner.decide(policy, tokens(1, 10.0, 300.0, 60.0, None, 45.0), 10.0)
    # 600 output tokens/s shown within the target, 800 coming (+200 an interval): two replicas.
    assert planner.capacities == {"output tokens/s": 600.0} and decision.desired == 2, decision
    assert decision.sized_by == "output tokens/s" and decision.rate == 10.0


def test_an_aggregated_pool_takes_the_larger_of_its_prompt_and_output_demand() -> None:
    policy = pool("agg", 500.0, 50.0)
    planner = PoolPlanner("agg", capacities={"prompt tokens/s": 4000.0, "output tokens/s": 300.0})
    # 5 req/s of 400 prompt tokens (2,000/s: one replica) and 180 output tokens (900/s: three),
    # the ITL target missed by 1.2x just after the pool changed (no capacity lowered).
    decision = planner.decide(policy, tokens(1, 5.0, 400.0, 180.0, 420.0, 60.0), 0.0)
    assert decision.desired == 3 and decision.sized_by == "output tokens/s", decision
    assert decision.capacity == 300.0 and "900.0 output tokens/s wanted" in decision.reason
    # A TTFT miss (3.2x) lowers only the prompt-token capacity; the output tokens were within
    # their ITL target, so theirs rises to what the replica showed.
    planner = PoolPlanner("agg", capacities={"prompt tokens/s": 4000.0, "output tokens/s": 300.0})
    planner.decide(policy, tokens(1, 5.0, 100.0, 100.0, 100.0, 30.0), 0.0)
    planner.decide(policy, tokens(1, 5.0, 1600.0, 100.0, 1600.0, 30.0), 20.0)  # 8,000/s at 3.2x
    assert planner.capacities == {"prompt tokens/s": 2500.0, "output tokens/s": 500.0}


def test_token_counts_size_a_pool_once_the_frontends_report_them() -> None:
    planner, policy = PoolPlanner("p"), pool("prefill", 500.0, None)
    planner.decide(policy, Measured(1, 4.0, 200.0, None, 50), 0.0)
    assert planner.measures(policy) == ["req/s"]  # a frontend that counts no tokens
    planner.decide(policy, tokens(1, 4.0, 500.0, 1.0, 200.0, None), 5.0)
    assert planner.measures(policy) == ["prompt tokens/s"] and planner.capacities["prompt tokens/s"] == 2000.0
