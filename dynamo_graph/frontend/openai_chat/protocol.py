"""The chat completion request (decoded straight into the pipeline's msgspec type, so errors name
the field), the whole, non-streamed response body, and OpenAI's usage object (completions and
token-in/token-out report it too)."""

from __future__ import annotations

import time

import msgspec

from dynamo_graph.frontend.errors import request_decoder
from dynamo_graph.llm.logprobs import TokenLogprob, chat_logprobs
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.runtime.context import unique_hex

__all__ = ["DECODER", "ChatCompletionRequest", "chat_completion_body", "usage_dict"]

DECODER = request_decoder(ChatCompletionRequest)


def usage_dict(prepared: Prepared) -> dict:
    usage = {
        "prompt_tokens": prepared.prompt_tokens,
        "completion_tokens": prepared.completion_tokens,
        "total_tokens": prepared.prompt_tokens + prepared.completion_tokens,
    }
    if prepared.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": prepared.cached_tokens}
    return usage


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
        "id": "chatcmpl-" + unique_hex(),
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
