"""The token-in/token-out request, as vLLM's `/inference/v1/generate` defines it (output_mode
"tokens"): `token_ids`, `sampling_params` (vLLM's SamplingParams names), `stream`.

It becomes a completions request whose prompt is the token ids (so the preprocessor's checks —
vocabulary, context length, max/min tokens, logit_bias, stop ids — and the engine's capabilities
apply as on `/v1/completions`); `param_names` maps that request's fields back to these for errors.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from dynamo_graph.llm.openai import (
    TOKEN_ID_KEYS,
    Choices,
    CompletionRequest,
    MaxTokens,
    NonNegInt,
    Penalty,
    Probability,
    StreamOptions,
    Temperature,
)


class TokenSamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: MaxTokens | None = None
    min_tokens: NonNegInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: int | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: int | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(extra_json_schema=TOKEN_ID_KEYS)
        ]
        | None
    ) = None
    n: Choices | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    token_ids: Annotated[list[NonNegInt], Meta(min_length=1)]
    sampling_params: TokenSamplingParams = msgspec.field(default_factory=TokenSamplingParams)
    # vLLM serves one model and lets this be unset; here it names the model, or is left out when
    # the frontend serves exactly one.
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    output_mode: Literal["tokens"] = "tokens"


# The sampling fields a completions request takes under the same names.
_SAMPLING = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "logprobs",
    "logit_bias",
    "n",
)


def to_completion(request: GenerateRequest, model: str) -> CompletionRequest:
    sp = request.sampling_params
    return CompletionRequest(
        model=model,
        prompt=request.token_ids,
        stream=request.stream,
        stream_options=request.stream_options,
        ignore_eos=sp.ignore_eos,
        **{key: getattr(sp, key) for key in _SAMPLING},
    )


# Completions request field (as the preprocessor names it in errors) -> this request's field.
PARAM_NAMES = {"prompt": "token_ids"} | {key: f"sampling_params.{key}" for key in _SAMPLING}
