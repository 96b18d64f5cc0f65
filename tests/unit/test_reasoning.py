"""Reasoning parsers alone and in front of a tool-call parser, whole and split into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.chat_output import Delta, output_parser
from dynamo_graph.llm.openai import ChatCompletionRequest, ChatMessage
from dynamo_graph.llm.reasoning import REASONING_FORMATS, ReasoningStream, split_reasoning

CALL = '<tool_call>{"name": "f", "arguments": {"x": "</think>"}}</tool_call>'


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("deepseek_r1", "<think>\nhmm</think>\n\nAnswer", ("\nhmm", "Answer")),
        ("deepseek_r1", "hmm</think>Answer", ("hmm", "Answer")),
        ("deepseek_r1", "thinking that never ends", ("thinking that never ends", "")),
        ("deepseek_r1", "", ("", "")),
        ("qwen3", "<think>a < b</think>\nAnswer <think> stays", ("a < b", "Answer <think> stays")),
        ("qwen3", "Answer without thinking </think>", ("", "Answer without thinking </think>")),
        ("qwen3", "<thin", ("", "<thin")),
        ("qwen3", "  <think>cut off", ("cut off", "")),
    ],
)
def test_whole_outputs(name: str, text: str, expected: tuple[str, str]) -> None:
    assert split_reasoning(REASONING_FORMATS[name], text) == expected


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(REASONING_FORMATS)),
    text=st.sampled_from(
        ["<think>\nplan: call f</think>\n\nOK", "plan</think> OK", "<think>x</thi", "no thinking", " <th"]
    ),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_any_split_gives_the_whole_answer(name: str, text: str, cuts: list[int]) -> None:
    stream = ReasoningStream(REASONING_FORMATS[name])
    pieces = [stream.feed(p) for p in split(text, cuts)] + [stream.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == split_reasoning(
        REASONING_FORMATS[name], text
    )
    assert not any("think>" in r for r, _ in pieces)


def chat_request(tools: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m",
        messages=[ChatMessage(role="user", content="hi")],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}] if tools else None,
    )


def card(reasoning: str | None, tools: str | None) -> ModelDeploymentCard:
    c = ModelDeploymentCard.without_files("m")
    c.reasoning_parser, c.tool_call_parser = reasoning, tools
    return c


@settings(max_examples=60, deadline=None)
@given(
    reasoning=st.sampled_from(sorted(REASONING_FORMATS)),
    cuts=st.lists(st.integers(min_value=0), max_size=30),
)
def test_reasoning_then_tool_calls(reasoning: str, cuts: list[int]) -> None:
    text = ("<think>" if reasoning == "qwen3" else "") + "I will call f.</think>\n\nCalling." + CALL
    parser = output_parser(card(reasoning, "hermes"), chat_request(tools=True))
    assert parser is not None
    deltas: list[Delta] = []
    for piece in split(text, cuts):
        deltas += parser.feed(piece)
    deltas += parser.finish()
    assert parser.made_tool_calls
    assert "".join(d.reasoning for d in deltas) == "I will call f."
    assert "".join(d.text for d in deltas) == "Calling."
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    assert calls[0].name == "f"
    assert json.loads("".join(c.arguments for c in calls)) == {"x": "</think>"}
    kinds = [("r" if d.reasoning else "c" if d.text else "t") for d in deltas]
    assert kinds == sorted(kinds, key="rct".index)  # reasoning, then content, then the call


def test_parsers_apply_only_where_they_should() -> None:
    assert output_parser(card(None, "hermes"), chat_request(tools=False)) is None
    assert output_parser(card(None, None), chat_request(tools=True)) is None
    none_choice = chat_request(tools=True)
    none_choice.tool_choice = "none"
    assert output_parser(card(None, "hermes"), none_choice) is None
    parser = output_parser(card("qwen3", "hermes"), chat_request(tools=False))
    assert parser is not None and not parser.made_tool_calls
    assert [d.text for d in parser.feed(CALL) + parser.finish()] == [CALL]  # no tools offered: content


def test_card_refuses_unknown_parser_names() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; valid names: hermes"):
        ModelDeploymentCard(display_name="m", slug="m", source_path="m", tool_call_parser="nope")
    good = card("deepseek_r1", "pythonic")
    again = ModelDeploymentCard.from_json(good.to_json())
    assert (again.reasoning_parser, again.tool_call_parser) == ("deepseek_r1", "pythonic")
    assert again.mdcsum() == good.mdcsum() != card(None, None).mdcsum()
