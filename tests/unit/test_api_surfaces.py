"""The Responses and Messages requests as the chat requests the pipeline runs (no server)."""

from __future__ import annotations

import msgspec
import pytest

from dynamo_graph.frontend.anthropic_messages.protocol import MessagesRequest
from dynamo_graph.frontend.anthropic_messages.serving import to_chat as messages_to_chat
from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.frontend.openai_responses.protocol import ResponsesRequest
from dynamo_graph.frontend.openai_responses.serving import to_chat as responses_to_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def responses(**body) -> ResponsesRequest:
    return msgspec.convert({"model": "m", **body}, ResponsesRequest)


def messages(**body) -> MessagesRequest:
    return msgspec.convert({"model": "m", "max_tokens": 9, **body}, MessagesRequest)


def as_dicts(chat) -> list[dict]:
    return [msgspec.to_builtins(m) for m in chat.messages]


def test_responses_items_become_chat_messages() -> None:
    chat = responses_to_chat(
        responses(
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "Weather?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Looking."}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "A"}'},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "B"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
            ],
            tools=[{"type": "function", "name": "w", "parameters": SCHEMA}],
            tool_choice={"type": "function", "name": "w"},
            max_output_tokens=7,
            text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        )
    )
    calls = [
        {"id": c, "type": "function", "function": {"name": "w", "arguments": f'{{"city": "{city}"}}'}}
        for c, city in (("c1", "A"), ("c2", "B"))
    ]
    assert as_dicts(chat) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": SCHEMA}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.max_tokens == 7
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "w"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ],
)
def test_responses_refusals_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(HTTPError) as caught:
        responses_to_chat(responses(**body))
    assert caught.value.status == 400 and caught.value.param == param


def test_messages_blocks_become_chat_messages() -> None:
    chat = messages_to_chat(
        messages(
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": "Weather in A?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "A"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Thanks."},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                    ],
                },
            ],
            tools=[{"name": "w", "input_schema": SCHEMA}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
            top_k=5,
        )
    )
    call = {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city":"A"}'}}
    assert as_dicts(chat) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in A?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},  # the result first, then the text
        {"role": "user", "content": "Thanks."},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": SCHEMA}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 9


def test_messages_tool_choice_kinds() -> None:
    def choice(tc: dict | None):
        extra = {} if tc is None else {"tool_choice": tc}
        req = messages(
            messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "w", "input_schema": SCHEMA}],
            **extra,
        )
        return messages_to_chat(req).tool_choice

    assert choice(None) is None
    assert choice({"type": "auto"}) == "auto"
    assert choice({"type": "none"}) == "none"
    assert choice({"type": "tool", "name": "w"}) == {"type": "function", "function": {"name": "w"}}


def test_messages_tool_use_in_a_user_turn_is_refused() -> None:
    req = messages(
        messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]}]
    )
    with pytest.raises(HTTPError) as caught:
        messages_to_chat(req)
    assert caught.value.param == "messages[0].content[0].type"
