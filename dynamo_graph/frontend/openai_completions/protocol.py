"""The completions request (decoded straight into the pipeline's msgspec type, so errors name the
field) and the whole, non-streamed response body."""

from __future__ import annotations

import time

import msgspec

from dynamo_graph.frontend.errors import request_decoder
from dynamo_graph.frontend.openai_chat.protocol import usage_dict
from dynamo_graph.llm.logprobs import TokenLogprob, completion_logprobs
from dynamo_graph.llm.openai import CompletionRequest
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.runtime.context import unique_hex

__all__ = ["DECODER", "CompletionRequest", "completion_body"]

DECODER = request_decoder(CompletionRequest)


def completion_body(
    model: str,
    text: str,
    finish_reason: str | None,
    prepared: Prepared,
    logprobs: list[TokenLogprob] | None,
) -> bytes:
    """`logprobs`: None when the request did not ask for them."""
    body = {
        "id": "cmpl-" + unique_hex(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else completion_logprobs(logprobs, 0),
            }
        ],
        "usage": usage_dict(prepared),
    }
    return msgspec.json.encode(body)
