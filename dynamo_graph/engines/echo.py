"""The echo engines of dynamo-run: test the plumbing around an engine without a model.

- `echo_core` takes pre-processed requests and streams the prompt's token ids back, so the
  response shows the whole chat template (send `nvext.ignore_eos` so the template's own eos
  tokens do not end it; `in=text` sets that for you).
- `echo_full` takes the un-processed OpenAI request and streams the prompt text back one
  character at a time (it has no tokenizer: usage counts characters).

Both are paced by `DYN_TOKEN_ECHO_DELAY_MS` (default 10 ms; 0 = as fast as possible).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from dynamo_graph.backend.engine import EngineConfig, LLMEngine, ModelInput
from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, requested_max_tokens
from dynamo_graph.runtime.context import Context

DEFAULT_DELAY_MS = 10.0


def echo_delay_seconds() -> float:
    raw = os.environ.get("DYN_TOKEN_ECHO_DELAY_MS", "")
    try:
        delay_ms = float(raw) if raw else DEFAULT_DELAY_MS
    except ValueError:
        delay_ms = DEFAULT_DELAY_MS
    return max(delay_ms, 0.0) / 1000.0


class _EchoEngine(LLMEngine):
    """What both echo engines share: the pacing delay and nothing to load or release."""

    model_input: ModelInput

    def __init__(self, delay_s: float | None = None) -> None:
        self.delay_s = echo_delay_seconds() if delay_s is None else delay_s

    async def start(self, worker_id: int = 0) -> EngineConfig:
        return EngineConfig(model_input=self.model_input)

    async def cleanup(self) -> None:
        return None


class EchoCoreEngine(_EchoEngine):
    """Streams the prompt's token ids back, one per chunk."""

    model_input = "tokens"

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        limit = request.stop_conditions.max_tokens
        tokens = request.token_ids if limit is None else request.token_ids[:limit]
        delay = self.delay_s
        for tok in tokens:
            if delay:
                await asyncio.sleep(delay)
            if context.is_stopped():
                yield LLMEngineOutput(finish_reason="cancelled")
                return
            yield LLMEngineOutput(token_ids=[tok])
        truncated = limit is not None and len(request.token_ids) > limit
        yield LLMEngineOutput(finish_reason="length" if truncated else "stop")


def _prompt_text(request: AnyRequest) -> str:
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise InvalidArgument("messages must not be empty", param="messages")
        content = request.messages[-1].content
        if isinstance(content, str):
            return content
        if content:
            return "".join(part.text or "" for part in content if part.type == "text")
        return ""
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise InvalidArgument("echo_full needs a text prompt (it has no tokenizer)", param="prompt")


class EchoFullEngine(_EchoEngine):
    """Streams the last message (chat) or the prompt (completions) back, one character a chunk."""

    model_input = "text"

    async def generate(  # type: ignore[override]
        self, request: AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        text = _prompt_text(request)
        limit = requested_max_tokens(request)
        chars = text if limit is None else text[:limit]
        delay = self.delay_s
        for ch in chars:
            if delay:
                await asyncio.sleep(delay)
            if context.is_stopped():
                yield LLMEngineOutput(finish_reason="cancelled")
                return
            yield LLMEngineOutput(text=ch)
        usage = CompletionUsage(prompt_tokens=len(text), completion_tokens=len(chars))
        finish = "length" if len(chars) < len(text) else "stop"
        yield LLMEngineOutput(finish_reason=finish, completion_usage=usage)
