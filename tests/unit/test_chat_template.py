"""Chat templates render as transformers renders them, and fail with ChatTemplateError."""

from __future__ import annotations

import msgspec
import pytest

from dynamo_graph.dev.tiny_tokenizer import CHAT_TEMPLATE
from dynamo_graph.llm.chat_template import ChatTemplate, ChatTemplateError, messages_from_request
from dynamo_graph.llm.openai import ChatCompletionRequest

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED_SYSTEM_USER = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE, BOS, EOS)


def test_system_user_exact(template: ChatTemplate) -> None:
    assert template.render(SYSTEM_USER) == RENDERED_SYSTEM_USER


def test_without_generation_prompt(template: ChatTemplate) -> None:
    assert template.render(SYSTEM_USER, add_generation_prompt=False) == RENDERED_SYSTEM_USER.removesuffix(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_list_of_parts_equals_string_content(template: ChatTemplate) -> None:
    parts = [
        SYSTEM_USER[0],
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
    ]
    # The template trims each part, as the Llama-3 template does with string content.
    assert template.render(parts) == template.render([SYSTEM_USER[0], {"role": "user", "content": "Hithere"}])
    one_part = [SYSTEM_USER[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    assert template.render(one_part) == RENDERED_SYSTEM_USER


def test_tools_rendered_with_hf_tojson(template: ChatTemplate) -> None:
    tool = {"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}
    out = template.render(SYSTEM_USER, tools=[tool])
    # Not HTML-escaped and not ASCII-escaped, unlike Jinja's own tojson.
    assert (
        '{"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}' in out
    )
    assert out.startswith(BOS + "<|start_header_id|>system<|end_header_id|>\n\nYou may call these tools:\n")


def test_assistant_tool_calls(template: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out = template.render(messages)
    assert '{"name": "get", "arguments": {"city": "Paris"}}' in out
    assert "<|start_header_id|>tool<|end_header_id|>\n\nsunny<|eot_id|>" in out


def test_continue_final_message(template: ChatTemplate) -> None:
    messages = [*SYSTEM_USER, {"role": "assistant", "content": "The answer is "}]
    out = template.render(messages, continue_final_message=True)
    # The template trims the content; the cut keeps what the template rendered, no eot, no prompt.
    assert out == RENDERED_SYSTEM_USER + "The answer is"


def test_continue_final_message_needs_text(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="no text to continue"):
        template.render([{"role": "assistant", "tool_calls": []}], continue_final_message=True)


def test_raise_exception_message_surfaces() -> None:
    tpl = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tpl.render(SYSTEM_USER)


def test_syntax_error_at_construction() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0]['content'] + 1 }}",  # TypeError inside the template
        "{{ undefined_thing.attr }}",  # undefined misuse
        "{{ messages.append(1) }}",  # the sandbox is immutable
    ],
)
def test_render_errors_are_chat_template_errors(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(SYSTEM_USER)


def test_hf_environment_features() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['role'] }}{% endfor %}\n"
        "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}|{{ [1, 2] | tojson(indent=2) }}|"
        "{% generation %}{{ bos_token }}{% endgeneration %}|{{ strftime_now('%Y') | length }}|{{ flavour }}"
    )
    out = ChatTemplate(source, "<s>", "</s>").render(SYSTEM_USER, flavour="x")
    # trim_blocks drops the newline after a block tag.
    assert out == 'system{"a": "é", "b": 1}|[\n  1,\n  2\n]|<s>|4|x'


def test_messages_from_request_drops_none_and_parses_arguments() -> None:
    req = msgspec.convert(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                    ],
                },
                {"role": "tool", "content": "1", "tool_call_id": "c1", "name": "f"},
            ],
        },
        ChatCompletionRequest,
    )
    assert messages_from_request(req) == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "content": "1", "tool_call_id": "c1", "name": "f"},
    ]
