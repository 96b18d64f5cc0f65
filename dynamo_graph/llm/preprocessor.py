"""OpenAI request -> PreprocessedRequest: chat template, tokenization, stop and sampling options.

Runs in the frontend once per request, so it does one template render, one encode (of only
the prompt's new segments: segment_tokenizer.py) and cheap Struct building. Anything a client
can get wrong raises `RequestValidationError` naming the OpenAI field, which the frontend turns
into a 400 error body; nothing here trusts the engine to catch a bad request.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from dynamo_graph.llm.chat_template import (
    RESERVED_TEMPLATE_KWARGS,
    ChatTemplate,
    ChatTemplateError,
    messages_from_request,
)
from dynamo_graph.llm.openai import (
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    NvExt,
    requested_max_tokens,
    stop_strings,
    wants_ignore_eos,
)
from dynamo_graph.llm.protocol import (
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.llm.segment_tokenizer import SegmentTokenizer

# OpenAI allows 4 stop sequences, vLLM any number. 16 strings of up to 1024 characters cover
# real clients while bounding the postprocessor's per-token scan and held-back text.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# OpenAI's default max_tokens for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_PROMPT_SHAPES = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"


# Error codes of the refusals that depend on the model named (its context, vocabulary, chat
# template), which a request's schema cannot state; the rest are `invalid_request`.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for it
OUT_OF_VOCABULARY = "token_out_of_vocabulary"
CHAT_TEMPLATE_ERROR = "chat_template_error"
UNSUPPORTED_BY_MODEL = "unsupported_by_model"  # a field the model's engine or parsers cannot serve
# min_tokens against the completion bound, which is max_tokens or the model's default and context.
MIN_TOKENS_ABOVE_MAX = "min_tokens_above_max_tokens"
# A tool_choice that forces a call to a function `tools` does not hold (or with no tools).
TOOL_CHOICE_WITHOUT_TOOL = "tool_choice_without_tool"


class RequestValidationError(ValueError):
    """A client error: `param` is the OpenAI field at fault (None when no single field is);
    `code` the OpenAI error body's."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Preprocessor:
    """Turns one model's OpenAI requests into token-level requests for its engines."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        eos_token_ids: list[int],
        context_length: int | None,
        model_name: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = list(eos_token_ids)
        self.context_length = context_length
        self.model_name = model_name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._encode = tokenizer.encode
        self.segments = SegmentTokenizer(tokenizer)

    def preprocess_chat(self, req: ChatCompletionRequest) -> PreprocessedRequest:
        _check_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestValidationError("top_logprobs requires logprobs to be true", "top_logprobs")
        if not req.messages:
            raise RequestValidationError("messages must contain at least one message", "messages")
        if self.chat_template is None:
            raise RequestValidationError(
                f"model {self.model_name!r} has no chat template; use /v1/completions", "messages"
            )
        _check_content_parts(req)
        extra = req.chat_template_kwargs or {}
        if extra.keys() & RESERVED_TEMPLATE_KWARGS:
            extra = {k: v for k, v in extra.items() if k not in RESERVED_TEMPLATE_KWARGS}
        try:
            prompt = self.chat_template.render(
                messages_from_request(req),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                **extra,
            )
        except ChatTemplateError as exc:
            raise RequestValidationError(str(exc), "messages", CHAT_TEMPLATE_ERROR) from exc
        token_ids, prefixes = self.segments.encode_prefixed(prompt)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(requested_max_tokens(req), len(token_ids), max_param, "messages", None)
        output = OutputOptions(
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            skip_special_tokens=bool(req.skip_special_tokens),
        )
        sampling = _sampling_options(req, self.vocab_size)
        if req.response_format:
            sampling.guided_json = _guided_json(req.response_format)
        request = self._build(req, token_ids, max_tokens, max_param, sampling, output)
        if prefixes:
            request.routing = request.routing or RoutingHints()
            request.routing.prefixes = prefixes
        return request

    def preprocess_completion(self, req: CompletionRequest) -> PreprocessedRequest:
        _check_unsupported(req)
        if req.suffix is not None:
            raise RequestValidationError("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of > 1:
            raise RequestValidationError("best_of > 1 is not supported yet", "best_of")
        token_ids = self._prompt_token_ids(req.prompt)
        max_tokens = self._max_tokens(
            req.max_tokens, len(token_ids), "max_tokens", "prompt", DEFAULT_COMPLETION_MAX_TOKENS
        )
        output = OutputOptions(logprobs=req.logprobs, skip_special_tokens=bool(req.skip_special_tokens))
        sampling = _sampling_options(req, self.vocab_size)
        return self._build(req, token_ids, max_tokens, "max_tokens", sampling, output)

    def _prompt_token_ids(self, prompt: str | list[Any]) -> list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise RequestValidationError("prompt must not be empty", "prompt")
            if all(type(x) is int for x in prompt):
                return self._checked_ids(prompt)
            if len(prompt) > 1 and all(isinstance(x, str | list) for x in prompt):
                raise RequestValidationError("batched prompts are not supported", "prompt")
            prompt = prompt[0]
            if isinstance(prompt, list):
                if prompt and all(type(x) is int for x in prompt):
                    return self._checked_ids(prompt)
                raise RequestValidationError(
                    "prompt token-id lists must be non-empty lists of integers", "prompt"
                )
            if not isinstance(prompt, str):
                raise RequestValidationError(_PROMPT_SHAPES, "prompt")
        if not prompt:
            raise RequestValidationError("prompt must not be empty", "prompt")
        return self._encode(prompt, add_special_tokens=True).ids

    def _checked_ids(self, ids: list[int]) -> list[int]:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise RequestValidationError(
                f"prompt contains token id {bad}, outside this model's vocabulary [0, {self.vocab_size})",
                "prompt",
                OUT_OF_VOCABULARY,
            )
        return ids

    def _max_tokens(
        self, requested: int | None, prompt_len: int, param: str, prompt_param: str, default: int | None
    ) -> int | None:
        """The completion bound: as requested, else `default`, capped by the context left."""
        if requested is not None and requested < 1:
            raise RequestValidationError(f"{param} must be at least 1, got {requested}", param)
        ctx = self.context_length
        if ctx is None:
            return requested if requested is not None else default
        noun = prompt_param
        if prompt_len >= ctx:
            raise RequestValidationError(
                f"This model's maximum context length is {ctx} tokens. However, your {noun} "
                f"{'have' if noun == 'messages' else 'has'} {prompt_len} tokens, leaving no room for the "
                f"completion. Please reduce the length of the {noun}.",
                prompt_param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        remaining = ctx - prompt_len
        if requested is None:
            return remaining if default is None else min(default, remaining)
        if requested > remaining:
            raise RequestValidationError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {noun}, {requested} in the "
                f"completion). Please reduce the length of the {noun} or completion.",
                prompt_param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        return requested

    def _build(
        self,
        req: AnyRequest,
        token_ids: list[int],
        max_tokens: int | None,
        max_param: str,
        sampling: SamplingOptions,
        output: OutputOptions,
    ) -> PreprocessedRequest:
        stop = [s for s in stop_strings(req) if s]  # an empty stop string cannot mean anything
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestValidationError(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise RequestValidationError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long", "stop"
            )
        min_tokens = req.min_tokens
        if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
            raise RequestValidationError(
                f"min_tokens ({min_tokens}) must be less than or equal to {max_param} ({max_tokens})",
                "min_tokens",
                MIN_TOKENS_ABOVE_MAX,
            )
        nvext = req.nvext
        return PreprocessedRequest(
            model=self.model_name,
            token_ids=token_ids,
            stop_conditions=StopConditions(
                max_tokens=max_tokens,
                stop=stop or None,
                stop_token_ids_hidden=list(self.eos_token_ids),
                stop_token_ids=req.stop_token_ids,
                min_tokens=min_tokens,
                ignore_eos=wants_ignore_eos(req),
            ),
            sampling_options=sampling,
            output_options=output,
            eos_token_ids=list(self.eos_token_ids),
            annotations=list(nvext.annotations) if nvext and nvext.annotations else [],
            routing=routing_hints(nvext),
        )


def routing_hints(nvext: NvExt | None) -> RoutingHints | None:
    """The session and priority a request's nvext gives the router (headers may override)."""
    if nvext is None:
        return None
    session, priority = nvext.session_id(), nvext.routing_priority()
    if session is None and priority is None:
        return None
    return RoutingHints(session_id=session, priority=priority)


def _check_unsupported(req: AnyRequest) -> None:
    if req.n is not None and req.n > 1:
        raise RequestValidationError("n > 1 is not supported yet", "n")


def _check_content_parts(req: ChatCompletionRequest) -> None:
    """Text-only models: an image or audio part would silently vanish from the prompt."""
    for i, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise RequestValidationError(
                    f"messages[{i}].content[{j}]: content part type {part.type!r} is not supported "
                    "by this model (text only)",
                    "messages",
                )
            if part.text is None:
                raise RequestValidationError(
                    f"messages[{i}].content[{j}]: text part without text", "messages"
                )


def _sampling_options(req: AnyRequest, vocab_size: int) -> SamplingOptions:
    nvext = req.nvext
    top_k, repetition_penalty, temperature = req.top_k, req.repetition_penalty, req.temperature
    if nvext is not None:
        top_k = top_k if top_k is not None else nvext.top_k
        if repetition_penalty is None:
            repetition_penalty = nvext.repetition_penalty
        if nvext.greed_sampling:
            temperature = 0.0
    if req.logit_bias:
        _check_logit_bias(req.logit_bias, vocab_size)
    return SamplingOptions(
        n=req.n,
        best_of=req.best_of if isinstance(req, CompletionRequest) else None,
        temperature=temperature,
        top_p=req.top_p,
        top_k=top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=repetition_penalty,
        seed=req.seed,
        logit_bias=req.logit_bias,
        guided_json=req.guided_json,
        guided_regex=req.guided_regex,
        guided_choice=req.guided_choice,
        guided_grammar=req.guided_grammar,
    )


def _check_logit_bias(logit_bias: dict[str, float], vocab_size: int) -> None:
    for key in logit_bias:
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            raise RequestValidationError(
                f"logit_bias key {key!r} is not a token id in this model's vocabulary [0, {vocab_size})",
                "logit_bias",
                OUT_OF_VOCABULARY,
            )


def _guided_json(response_format: dict[str, Any] | None) -> Any:
    """OpenAI's response_format as the engine's guided-decoding JSON schema."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestValidationError(
                "response_format json_schema needs a json_schema.schema object", "response_format"
            )
        return schema
    raise RequestValidationError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )
