"""Tool-call parsers: whole outputs, and the same outputs split into deltas anywhere."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_graph.llm.tool_calls import (
    TOOL_FORMATS,
    ToolCallDelta,
    ToolCallStream,
    merge_events,
    parse_tool_calls,
)

WEATHER = {"city": "Paris", "units": ["c", "}"], "note": 'say "hi" ]'}
# Per format: an output with content before two calls, the content expected, and the calls.
OUTPUTS = {
    "hermes": (
        "Let me check.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>\n'
        '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
    ),
    "mistral": (
        f'Let me check.\n[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}, '
        '{"name": "get_time", "arguments": "{}"}]',
        "Let me check.\n",
    ),
    "pythonic": ("[get_weather(city='Paris', units=['c', '}'], note='say \"hi\" ]'), get_time()]", ""),
    "deepseek_v3": (
        "Let me check.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        f"```json\n{json.dumps(WEATHER)}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "Let me check.\n",
    ),
}
MARKUP = ["<tool_call", "</tool_call", "python_tag", "TOOL_CALLS", "get_weather", "get_time", "tool▁", "｜"]


def test_every_format_has_an_output_here() -> None:
    assert sorted(OUTPUTS) == sorted(TOOL_FORMATS)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_whole_output(name: str) -> None:
    text, content = OUTPUTS[name]
    parsed = parse_tool_calls(TOOL_FORMATS[name], text)
    assert parsed.content == content
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [WEATHER, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


def stream_pieces(name: str, pieces: list[str]) -> list[str | ToolCallDelta]:
    stream = ToolCallStream(TOOL_FORMATS[name])
    events: list[str | ToolCallDelta] = []
    for piece in pieces:
        events += stream.feed(piece)
    return events + stream.finish()


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(OUTPUTS)), cuts=st.lists(st.integers(min_value=0), max_size=40))
def test_any_split_streams_like_the_whole(name: str, cuts: list[int]) -> None:
    text, content = OUTPUTS[name]
    events = stream_pieces(name, split(text, cuts))
    contents = [e for e in events if isinstance(e, str)]
    assert "".join(contents) == content
    assert not any(m in piece for piece in contents for m in MARKUP)
    seen: set[int] = set()
    for ev in events:
        if isinstance(ev, ToolCallDelta):
            if ev.index not in seen:  # the first delta of a call: id and name, no arguments yet
                assert ev.id is not None and ev.name is not None and ev.arguments == ""
                seen.add(ev.index)
            else:
                assert ev.id is None and ev.name is None and ev.arguments
    merged = merge_events(events)
    whole = parse_tool_calls(TOOL_FORMATS[name], text)
    assert [c["function"] for c in merged.tool_calls] == [c["function"] for c in whole.tool_calls]


def test_json_arguments_stream_before_the_call_ends() -> None:
    events = stream_pieces(
        "hermes", ['<tool_call>{"name": "f", "arguments": {"q": "abc', 'def"}}</tool_call>']
    )
    assert events[0] == ToolCallDelta(index=0, id=events[0].id, name="f")  # type: ignore[union-attr]
    assert [e.arguments for e in events[1:]] == ['{"q": "abc', 'def"}']  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", "I use <tool_call> tags like <b> and <tool_call>not json</tool_call> here"),
        ("hermes", "a < b and c <tool"),
        ("llama3_json", "{ this is not a call"),
        ("llama3_json", '{"name": "f", "parameters": [1]}'),  # arguments must be an object
        ("pythonic", "[1, 2] is a list"),
        ("pythonic", "[f(*args)]"),
        ("mistral", "[TOOL_CALLS] oops"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>nothing<｜tool▁calls▁end｜>"),
        ("hermes", "plain answer"),
    ],
)
def test_text_that_is_not_a_call_stays_content(name: str, text: str) -> None:
    parsed = parse_tool_calls(TOOL_FORMATS[name], text)
    assert parsed.tool_calls == []
    assert parsed.content == text
    assert "".join(e for e in stream_pieces(name, list(text)) if isinstance(e, str)) == text


def test_unterminated_call_at_the_end_of_the_output_counts() -> None:
    parsed = parse_tool_calls(TOOL_FORMATS["hermes"], '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [
        ("f", '{"a": 1}')
    ]


def test_llama3_bare_json_after_leading_whitespace_and_content_after_calls() -> None:
    parsed = parse_tool_calls(TOOL_FORMATS["llama3_json"], '  \n{"name": "f", "parameters": {"a": 1}}')
    assert parsed.content == "" and parsed.tool_calls[0]["function"]["name"] == "f"
    parsed = parse_tool_calls(TOOL_FORMATS["hermes"], '<tool_call>{"name": "f"}</tool_call>\n\nDone.')
    assert parsed.content == "Done."
    assert parsed.tool_calls[0]["function"]["arguments"] == "{}"
