"""The chat completion request (decoded straight into the pipeline's msgspec type, so errors name
the field) and the whole, non-streamed response body."""

from __future__ import annotations

import time
import uuid

import msgspec

from dynamo_graph.frontend.responses import usage_dict
from dynamo_graph.llm.logprobs import TokenLogprob, chat_logprobs
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.pipeline import Prepared

__all__ = ["DECODER", "ChatCompletionRequest", "chat_completion_body"]

DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def chat_completion_body(
    model: str,
    text: str,
    finish_reason: str | None,
    prepared: Prepared,
    *,
    reasoning: str = "",
    tool_calls: list[dict] | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> bytes:
    """`logprobs`: None when the request did not ask for them."""
    message: dict = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            }
        ],
        "usage": usage_dict(prepared),
    }
    return msgspec.json.encode(body)
