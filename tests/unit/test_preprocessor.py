"""Requests -> PreprocessedRequest, and every client error names its OpenAI field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from dynamo_graph.backend.protocol import PreprocessedRequest
from dynamo_graph.dev.tiny_tokenizer import BOS_ID, CHAT_TEMPLATE, END_OF_TEXT_ID, EOT_ID, SPECIAL_TOKENS
from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.openai import ChatCompletionRequest, CompletionRequest
from dynamo_graph.llm.preprocessor import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    Preprocessor,
    RequestValidationError,
)

CONTEXT_LENGTH = 512
EOS = [EOT_ID, END_OF_TEXT_ID]
SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def pre(tokenizer: Tokenizer) -> Preprocessor:
    template = ChatTemplate(CHAT_TEMPLATE, SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOT_ID])
    return Preprocessor(tokenizer, template, EOS, CONTEXT_LENGTH, "tiny")


def chat(**fields: Any) -> ChatCompletionRequest:
    """As the HTTP frontend builds it: decoded from the JSON body."""
    return msgspec.convert({"model": "tiny", "messages": SYSTEM_USER, **fields}, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"model": "tiny", "prompt": "Hello", **fields}, CompletionRequest)


def test_chat_tokens_are_the_rendered_template(pre: Preprocessor, tokenizer: Tokenizer) -> None:
    out = pre.preprocess_chat(chat())
    assert out.token_ids == tokenizer.encode(RENDERED, add_special_tokens=False).ids
    assert out.token_ids[0] == BOS_ID and out.token_ids.count(BOS_ID) == 1  # no double bos
    assert tokenizer.decode(out.token_ids, skip_special_tokens=False) == RENDERED
    assert out.model == "tiny"
    assert out.eos_token_ids == EOS
    sc = out.stop_conditions
    assert sc.stop_token_ids_hidden == EOS
    # No max_tokens asked: bounded by the context left.
    assert sc.max_tokens == CONTEXT_LENGTH - len(out.token_ids)
    assert not sc.ignore_eos and sc.stop is None
    msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=PreprocessedRequest)


def test_chat_list_of_parts_equals_string(pre: Preprocessor) -> None:
    parts = [SYSTEM_USER[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    assert pre.preprocess_chat(chat(messages=parts)).token_ids == pre.preprocess_chat(chat()).token_ids


def test_chat_tools_in_prompt(pre: Preprocessor, tokenizer: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = pre.preprocess_chat(chat(tools=[tool]))
    assert '"name": "get_weather"' in tokenizer.decode(out.token_ids, skip_special_tokens=False)


def test_chat_template_kwargs_cannot_override_render_arguments(pre: Preprocessor) -> None:
    out = pre.preprocess_chat(chat(chat_template_kwargs={"add_generation_prompt": False, "messages": []}))
    assert out.token_ids == pre.preprocess_chat(chat()).token_ids


def test_max_tokens_and_stop_conditions(pre: Preprocessor) -> None:
    out = pre.preprocess_chat(
        chat(max_tokens=50, max_completion_tokens=20, stop="###", stop_token_ids=[7], min_tokens=3)
    )
    sc = out.stop_conditions
    assert (sc.max_tokens, sc.stop, sc.stop_token_ids, sc.min_tokens) == (20, ["###"], [7], 3)
    assert pre.preprocess_chat(chat(stop=["a", "", "b"])).stop_conditions.stop == ["a", "b"]


def test_ignore_eos_top_level_and_nvext(pre: Preprocessor) -> None:
    assert pre.preprocess_chat(chat(ignore_eos=True)).stop_conditions.ignore_eos
    assert pre.preprocess_chat(chat(nvext={"ignore_eos": True})).stop_conditions.ignore_eos


def test_sampling_and_output_options(pre: Preprocessor) -> None:
    out = pre.preprocess_chat(
        chat(
            temperature=0.5,
            top_p=0.9,
            min_p=0.1,
            presence_penalty=0.2,
            frequency_penalty=-0.2,
            seed=3,
            logit_bias={"10": 5.0},
            logprobs=True,
            top_logprobs=2,
            skip_special_tokens=True,
            nvext={"top_k": 40, "repetition_penalty": 1.1, "annotations": ["formatted_prompt"]},
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        )
    )
    so = out.sampling_options
    assert (so.temperature, so.top_p, so.top_k, so.min_p, so.seed) == (0.5, 0.9, 40, 0.1, 3)
    assert (so.presence_penalty, so.frequency_penalty, so.repetition_penalty) == (0.2, -0.2, 1.1)
    assert so.logit_bias == {"10": 5.0} and so.guided_json == {"type": "object"}
    assert out.output_options.logprobs == 2 and out.output_options.skip_special_tokens
    assert out.annotations == ["formatted_prompt"]
    # The top-level field wins over nvext; logprobs alone means the sampled token's only.
    out = pre.preprocess_chat(chat(top_k=5, nvext={"top_k": 40}, logprobs=True))
    assert out.sampling_options.top_k == 5 and out.output_options.logprobs == 0
    assert pre.preprocess_chat(chat(nvext={"greed_sampling": True})).sampling_options.temperature == 0.0


def test_completion_string_prompt_gets_bos(pre: Preprocessor, tokenizer: Tokenizer) -> None:
    out = pre.preprocess_completion(completion())
    assert out.token_ids == tokenizer.encode("Hello", add_special_tokens=True).ids
    assert out.token_ids[0] == BOS_ID
    assert out.stop_conditions.max_tokens == 16  # OpenAI's default for completions


@pytest.mark.parametrize("prompt", [[5, 70, 80], [[5, 70, 80]]])
def test_completion_token_ids_as_is(pre: Preprocessor, prompt: list[Any]) -> None:
    assert pre.preprocess_completion(completion(prompt=prompt, max_tokens=4)).token_ids == [5, 70, 80]


def test_completion_single_string_in_list(pre: Preprocessor) -> None:
    assert pre.preprocess_completion(completion(prompt=["Hello"])).token_ids == (
        pre.preprocess_completion(completion()).token_ids
    )


def test_completion_default_max_tokens_capped_by_context(pre: Preprocessor) -> None:
    out = pre.preprocess_completion(completion(prompt=[70] * (CONTEXT_LENGTH - 5)))
    assert out.stop_conditions.max_tokens == 5


def test_context_length_error_states_numbers(pre: Preprocessor) -> None:
    n = len(pre.preprocess_chat(chat()).token_ids)
    with pytest.raises(RequestValidationError) as err:
        pre.preprocess_chat(chat(max_tokens=600))
    assert err.value.param == "messages"
    assert str(err.value) == (
        f"This model's maximum context length is {CONTEXT_LENGTH} tokens. However, you requested "
        f"{n + 600} tokens ({n} in the messages, 600 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    with pytest.raises(RequestValidationError, match=r"500 in the prompt, 100 in the completion") as err:
        pre.preprocess_completion(completion(prompt=[70] * 500, max_tokens=100))
    assert err.value.param == "prompt"


def test_prompt_alone_too_long(pre: Preprocessor) -> None:
    with pytest.raises(
        RequestValidationError, match=r"512 tokens\. However, your prompt has 512 tokens"
    ) as err:
        pre.preprocess_completion(completion(prompt=[70] * CONTEXT_LENGTH))
    assert err.value.param == "prompt"
    long_chat = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(RequestValidationError, match="your messages have") as err:
        pre.preprocess_chat(chat(messages=long_chat))
    assert err.value.param == "messages"


def test_no_context_length_leaves_max_tokens_unset(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(tokenizer, ChatTemplate(CHAT_TEMPLATE, "<|begin_of_text|>"), EOS, None, "tiny")
    assert pre.preprocess_chat(chat()).stop_conditions.max_tokens is None
    assert pre.preprocess_completion(completion()).stop_conditions.max_tokens == 16


@pytest.mark.parametrize(
    ("make", "fields", "param", "message"),
    [
        ("chat", {"messages": []}, "messages", "at least one message"),
        ("chat", {"n": 2}, "n", "n > 1 is not supported yet"),
        ("chat", {"max_tokens": 0}, "max_tokens", "at least 1"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
        ("chat", {"max_tokens": 5, "min_tokens": 6}, "min_tokens", "min_tokens (6)"),
        ("chat", {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", "stop strings"),
        ("chat", {"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", "at most"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ("chat", {"logit_bias": {"99999": 1.0}}, "logit_bias", "99999"),
        ("chat", {"logit_bias": {"abc": 1.0}}, "logit_bias", "abc"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "image_url",
        ),
        (
            "chat",
            {"messages": [{"role": "assistant", "tool_calls": []}], "continue_final_message": True},
            "messages",
            "continue",
        ),
        ("completion", {"prompt": ""}, "prompt", "empty"),
        ("completion", {"prompt": []}, "prompt", "empty"),
        ("completion", {"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ("completion", {"prompt": [[1, 2], [3]]}, "prompt", "batched prompts are not supported"),
        ("completion", {"prompt": [70, 2048]}, "prompt", "2048"),
        ("completion", {"prompt": [-1, 70]}, "prompt", "-1"),
        ("completion", {"prompt": [[]]}, "prompt", "non-empty"),
        ("completion", {"prompt": [1.5]}, "prompt", "must be a string"),
        ("completion", {"prompt": [True, 3]}, "prompt", "must be a string"),
        ("completion", {"suffix": "x"}, "suffix", "suffix"),
        ("completion", {"best_of": 2}, "best_of", "best_of"),
        ("completion", {"min_tokens": 20}, "min_tokens", "max_tokens (16)"),
    ],
)
def test_validation_errors_name_their_param(
    pre: Preprocessor, make: str, fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(RequestValidationError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        if make == "chat":
            pre.preprocess_chat(chat(**fields))
        else:
            pre.preprocess_completion(completion(**fields))
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


def test_template_error_is_a_messages_error(tokenizer: Tokenizer) -> None:
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    pre = Preprocessor(tokenizer, template, EOS, CONTEXT_LENGTH, "tiny")
    with pytest.raises(RequestValidationError, match="roles must alternate") as err:
        pre.preprocess_chat(chat())
    assert err.value.param == "messages"


def test_model_without_template(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(tokenizer, None, EOS, CONTEXT_LENGTH, "tiny")
    with pytest.raises(RequestValidationError, match="no chat template") as err:
        pre.preprocess_chat(chat())
    assert err.value.param == "messages"
    assert pre.preprocess_completion(completion()).token_ids[0] == BOS_ID


def test_a_chat_names_its_cached_prefix_for_the_router(pre: Preprocessor) -> None:
    """A long system message is a cached segment: the request names the prefix it ends (for the
    KV router's hash reuse), the same key for every question after it, and the name crosses the
    wire; a short chat names none."""
    system = {"role": "system", "content": "serving router prefix cache " * 12}
    outs = [
        pre.preprocess_chat(chat(messages=[system, {"role": "user", "content": q}]))
        for q in ("Why?", "How so?")
    ]
    named = [out.routing.prefixes if out.routing else None for out in outs]
    assert named[0] and named[0] == named[1]
    count, key = named[0][-1]
    assert outs[0].token_ids[:count] == outs[1].token_ids[:count] and len(key) == 16
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(outs[0]), type=PreprocessedRequest)
    assert wire.routing is not None and wire.routing.prefixes == named[0]
    assert pre.preprocess_chat(chat()).routing is None
