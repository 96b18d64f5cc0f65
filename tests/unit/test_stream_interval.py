"""frontend/interval.py: which deltas go out when, and what merging keeps."""

from __future__ import annotations

from dynamo_graph.frontend.interval import StreamInterval, merged
from dynamo_graph.llm.chat_output import Delta
from dynamo_graph.llm.logprobs import TokenLogprob
from dynamo_graph.llm.token_output import TokenDelta
from dynamo_graph.llm.tool_calls import ToolCallDelta


def feed(interval: StreamInterval, deltas: list[Delta]) -> list[list[str]]:
    """The texts sent after each delta (one token per delta)."""
    return [[d.text for d in interval.take(delta, n)] for n, delta in enumerate(deltas, 1)]


def test_first_token_at_once_then_every_n() -> None:
    interval = StreamInterval(3)
    sent = feed(interval, [Delta(c) for c in "abcdefgh"])
    assert sent == [["a"], [], [], ["bcd"], [], [], ["efg"], []]
    assert [d.text for d in interval.rest()] == ["h"]
    assert interval.rest() == []


def test_tokens_counted_from_the_pipeline_when_a_delta_holds_several() -> None:
    interval = StreamInterval(4)
    assert [d.text for d in interval.take(Delta("a"), 1)] == ["a"]
    assert interval.take(Delta("bc"), 3) == []
    assert [d.text for d in interval.take(Delta("def"), 6)] == ["bcdef"]


def test_runs_of_one_kind_merge_in_order_and_tool_calls_stay_whole() -> None:
    interval = StreamInterval(10)
    interval.take(Delta("", reasoning="r0"), 1)
    call = ToolCallDelta(index=0, arguments="{}")
    for n, delta in enumerate([Delta("", reasoning="r1"), Delta("", reasoning="r2"), Delta("a")], 2):
        assert interval.take(delta, n) == []
    assert interval.take(Delta("", tool_call=call), 5) == []
    assert interval.take(Delta("", tool_call=call), 6) == []
    assert interval.take(Delta("b"), 7) == []
    out = interval.rest()
    assert [(d.text, d.reasoning, d.tool_call) for d in out] == [
        ("", "r1r2", None),
        ("a", "", None),
        ("", "", call),
        ("", "", call),
        ("b", "", None),
    ]


def test_merging_keeps_logprobs_and_token_ids() -> None:
    first = TokenLogprob(token="a", logprob=-0.1, top=[])
    second = TokenLogprob(token="b", logprob=-0.2, top=[])
    (joined,) = merged([Delta("a", logprobs=[first]), Delta("b"), Delta("c", logprobs=[second])])
    assert (joined.text, joined.logprobs) == ("abc", [first, second])
    later = TokenDelta([2, 3], log_probs=[-0.2, -0.3], stop_reason=7)
    (tokens,) = merged([TokenDelta([1], log_probs=[-0.1]), later])
    assert (tokens.token_ids, tokens.log_probs, tokens.stop_reason) == ([1, 2, 3], [-0.1, -0.2, -0.3], 7)
