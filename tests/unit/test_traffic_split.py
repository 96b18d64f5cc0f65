"""The canary's pieces that need no processes: the traffic split's choice, the answer counts a
frontend reports per instance, and the judging of one step."""

from __future__ import annotations

from collections import Counter

import pytest

from dynamo_graph.graph.plan import RolloutPolicy
from dynamo_graph.graph.targets.local.answers import Answers, answers_of, side, tally
from dynamo_graph.graph.targets.local.canary import judge
from dynamo_graph.runtime.traffic import AnswerStats, TrafficSplit, labels_from_env, percentile_ms

LABELS = {1: {"revision": "1"}, 2: {"revision": "1"}, 3: {"revision": "2"}}


def test_a_split_sends_its_share_to_the_labelled_instances_and_the_rest_elsewhere() -> None:
    split = TrafficSplit({"revision": "2"}, 0.1)
    assert split.choose([1, 2, 3], LABELS, 0.05) == [3]
    assert split.choose([1, 2, 3], LABELS, 0.5) == [1, 2]


def test_a_split_with_one_side_empty_leaves_every_instance_a_candidate() -> None:
    split = TrafficSplit({"revision": "9"}, 0.5)
    assert split.choose([1, 2, 3], LABELS, 0.0) == [1, 2, 3]
    everyone = TrafficSplit({}, 0.5)  # no labels: every instance matches
    assert everyone.choose([1, 2], LABELS, 0.9) == [1, 2]


def test_instance_labels_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_INSTANCE_LABELS", "zone=a, revision=7")
    assert labels_from_env() == {"zone": "a", "revision": "7"}
    monkeypatch.setenv("DYN_INSTANCE_LABELS", "revision")
    with pytest.raises(ValueError, match="DYN_INSTANCE_LABELS"):
        labels_from_env()


def test_first_response_buckets_give_percentiles_within_their_spacing() -> None:
    stats = AnswerStats()
    for ms in range(1, 101):
        stats.first_response(ms / 1000)
    p90 = percentile_ms(stats.report()["first_response_ms"], 0.9)  # type: ignore[arg-type]
    assert p90 is not None and 90 <= p90 <= 90 * 1.12
    assert percentile_ms({}, 0.9) is None


def _health(instances: dict[str, tuple[int, int, dict[str, int]]]) -> dict:
    entries = [
        {"instance_id": i, "requests": r, "errors": e, "first_response_ms": b}
        for i, (r, e, b) in instances.items()
    ]
    return {"status": "healthy", "details": {"tiny": {"instances": entries, "unavailable": []}}}


def test_a_step_sums_both_frontends_and_counts_only_what_happened_during_it() -> None:
    before = tally([_health({"a": (10, 0, {"5.0": 10})}), _health({"a": (5, 0, {"5.0": 5})})])
    after = tally(
        [
            _health({"a": (30, 1, {"5.0": 29}), "b": (7, 0, {"9.0": 7})}),
            _health({"a": (15, 0, {"5.0": 15}), "b": (3, 0, {"9.0": 3})}),
        ]
    )
    assert side(before, after, {"a"}) == Answers(30, 1, Counter({"5.0": 29}))
    assert side(before, after, {"b"}) == Answers(10, 0, Counter({"9.0": 10}))


POLICY = RolloutPolicy(
    strategy="canary", max_error_rate_increase=0.01, max_ttft_p90_ratio=1.5, min_requests=20
)


def test_a_new_side_that_fails_more_often_loses() -> None:
    new, old = Answers(50, 5, Counter({"10.0": 45})), Answers(500, 0, Counter({"10.0": 500}))
    verdict = judge(new, old, POLICY)
    assert not verdict.ok and "error rate 10.0%" in verdict.why


def test_a_new_side_with_a_slower_first_token_loses_and_a_similar_one_passes() -> None:
    old = Answers(100, 0, Counter({"10.0": 100}))
    slow = judge(Answers(40, 0, Counter({"40.0": 40})), old, POLICY)
    assert not slow.ok and "TTFT p90 40 ms against 10 ms" in slow.why
    assert judge(Answers(40, 0, Counter({"12.0": 40})), old, POLICY).ok


def test_too_few_requests_are_judged_on_errors_alone() -> None:
    old = Answers(100, 0, Counter({"10.0": 100}))
    verdict = judge(Answers(5, 0, Counter({"90.0": 5})), old, POLICY)
    assert verdict.ok and "too few requests" in verdict.why


def test_a_disaggregated_models_prefill_instances_are_counted_too() -> None:
    entry = {"requests": 3, "errors": 1, "first_response_ms": {"100": 3}}
    health = {
        "details": {
            "m": {
                "instances": [{"instance_id": "a", **entry}],
                "prefill_instances": [{"instance_id": "b", **entry}],
                "prefill_unavailable": [{"instance_id": "c", **entry}],
            }
        }
    }
    counted = answers_of(health)
    assert sorted(counted) == ["a", "b", "c"] and counted["b"].requests == 3


def test_the_work_units_an_instance_was_given_reach_the_planner_as_tokens() -> None:
    stats = AnswerStats()
    stats.requests, stats.request_units, stats.response_units = 2, 900, 40
    before = answers_of(
        {"details": {"m": {"prefill_instances": [{"instance_id": "a", "request_units": 100}]}}}
    )
    after = answers_of({"details": {"m": {"prefill_instances": [{"instance_id": "a", **stats.report()}]}}})
    window = side(before, after, {"a"})
    assert (window.prompt_tokens, window.output_tokens) == (800, 40)
