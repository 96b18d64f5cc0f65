"""OpenAI request types (chat and completions) as msgspec Structs, with field constraints.

One definition for every input: the HTTP frontend decodes request bodies straight into these
(msgspec names the offending field in its errors, which become OpenAI error bodies), and the
text / batch inputs build them in code. Values out of range are rejected here so nothing
downstream has to re-check them. The types ignore fields they do not declare; the frontend
decodes into a strict subclass unless told to ignore them (`--http-unknown-fields`), so OpenAI
fields that change nothing here are declared (`BookkeepingFields`) to stay accepted.

What the pipeline checks after decoding (preprocessor.py: a non-empty prompt or message list,
text-only content, one choice, ...) is stated beside the field as JSON Schema
(`Meta(extra_json_schema=...)`), so the frontend's OpenAPI document (frontend/openapi.py) says
everything a request is held to; the frontend's fuzz test (tests/system/test_openapi_fuzz.py)
checks the two agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_CHOICES = 1  # choices per request: the pipelines produce one
Choices = Annotated[int, Meta(ge=1, extra_json_schema={"maximum": MAX_CHOICES})]
# max_tokens 0 is refused by the preprocessor (there is nothing to generate).
MaxTokens = Annotated[int, Meta(extra_json_schema={"minimum": 1})]
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# The prompt shapes the preprocessor takes: one prompt (batches of several are refused).
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ]
}
# Text-only models: a part that is not text would vanish from the prompt, so it is refused.
TEXT_PART = {
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
# logit_bias keys are token ids (the vocabulary's bounds are the model's).
TOKEN_ID_KEYS = {"propertyNames": {"pattern": "^[0-9]+$"}}
# response_format: what the preprocessor turns into guided decoding.
RESPONSE_FORMAT = {
    "anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
        {
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {"schema": {"type": "object"}},
                    "required": ["schema"],
                },
            },
            "required": ["type", "json_schema"],
        },
    ]
}
# tool_choice (tool_choice.py): a mode, or the one function to call.
TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required", None]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
            "required": ["function"],
        },
    ]
}


class ContentPart(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Role
    content: str | list[Annotated[ContentPart, Meta(extra_json_schema=TEXT_PART)]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class AgentHints(msgspec.Struct, omit_defaults=True):
    """`nvext.agent_hints`: priority 0 by default, higher is more urgent (the router's queue)."""

    priority: int | None = None


class AgentContext(msgspec.Struct, omit_defaults=True):
    """`nvext.agent_context`: the session whose turns the router keeps on one worker."""

    session_id: str | None = None


class NvExt(msgspec.Struct, omit_defaults=True):
    """Dynamo's request extensions (`nvext`)."""

    ignore_eos: bool | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    greed_sampling: bool | None = None
    annotations: list[str] | None = None
    priority: int | None = None  # as agent_hints.priority
    agent_hints: AgentHints | None = None
    agent_context: AgentContext | None = None

    def routing_priority(self) -> int | None:
        hints = self.agent_hints
        if hints is not None and hints.priority is not None:
            return hints.priority
        return self.priority

    def session_id(self) -> str | None:
        return self.agent_context.session_id if self.agent_context is not None else None


class BookkeepingFields(msgspec.Struct, omit_defaults=True, kw_only=True):
    """OpenAI's request fields that change no output here (usage bookkeeping, billing tiers,
    their own prompt cache's key): accepted, so clients that send them are not refused."""

    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None


class _SamplingFields(BookkeepingFields, omit_defaults=True, kw_only=True):
    """Fields shared by chat and completions requests (OpenAI's plus vLLM/Dynamo extensions)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    n: Choices | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(extra_json_schema=TOKEN_ID_KEYS)
        ]
        | None
    ) = None
    ignore_eos: bool | None = None
    min_tokens: NonNegInt | None = None
    skip_special_tokens: bool | None = None
    nvext: NvExt | None = None
    # vLLM's: requests share cached prefixes only with requests of the same salt (and, behind a
    # keys file, of the same tenant or cache group; docs/security.md).
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # vLLM's guided-decoding extensions.
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(extra_json_schema={"minItems": 1})]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[Any, Meta(extra_json_schema=TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[dict[str, Any], Meta(extra_json_schema=RESPONSE_FORMAT)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: Annotated[str | list[Any], Meta(extra_json_schema={"allOf": [PROMPT_SCHEMA]})]
    echo: bool | None = None
    best_of: Choices | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: Annotated[str, Meta(extra_json_schema={"not": {}})] | None = None  # not supported: null only


AnyRequest = ChatCompletionRequest | CompletionRequest


def stop_strings(request: AnyRequest) -> list[str]:
    stop = request.stop
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def wants_ignore_eos(request: AnyRequest) -> bool:
    if request.ignore_eos:
        return True
    return bool(request.nvext and request.nvext.ignore_eos)


def requested_max_tokens(request: AnyRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


# Optional features an engine may honour. "logprobs": log_probs / top_logprobs per token as
# output_options.logprobs asks; "guided_*": the SamplingOptions field of that name constrains
# decoding (guided_json also serves response_format json_object / json_schema).
CAPABILITIES = ("logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
GUIDED_DECODING = CAPABILITIES[1:]


def requested_capabilities(request: AnyRequest) -> list[tuple[str, str]]:
    """(engine capability, request field) for each optional feature the request asks for."""
    wants = []
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs:
            wants.append(("logprobs", "logprobs"))
        kind = (request.response_format or {}).get("type")
        if kind in ("json_object", "json_schema"):
            wants.append(("guided_json", "response_format"))
    elif request.logprobs is not None:
        wants.append(("logprobs", "logprobs"))
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(request, field) is not None:
            wants.append((field, field))
    return wants
