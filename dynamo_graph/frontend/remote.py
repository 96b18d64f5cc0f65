"""Backends that live in other processes, reached through a runtime `Client`.

Tokens-input (Backend-type) workers speak the engine wire types directly. Text-input
(Chat/Completion-type) workers take the OpenAI request and stream OpenAI chunks, which are
turned back into engine outputs so the same pipeline code serves both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.context import Context


class RemoteTokensBackend:
    def __init__(self, client: Client) -> None:
        self.client = client

    def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        return self.client.generate(request, context=context, response_type=LLMEngineOutput)


def _usage(raw: Any) -> CompletionUsage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    return CompletionUsage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=details.get("cached_tokens") if isinstance(details, dict) else None,
    )


def chunk_to_output(chunk: Any) -> LLMEngineOutput:
    """One OpenAI chat/completion chunk (or whole response) as an engine output."""
    if not isinstance(chunk, dict):
        return LLMEngineOutput(error=f"worker sent {type(chunk).__name__}, expected an OpenAI chunk object")
    choices = chunk.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    delta = choice.get("delta") or choice.get("message") or {}
    text = delta.get("content") if isinstance(delta, dict) else None
    if text is None:
        text = choice.get("text")
    return LLMEngineOutput(
        text=text or None,
        finish_reason=choice.get("finish_reason"),
        completion_usage=_usage(chunk.get("usage")),
    )


class RemoteTextBackend:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def generate(self, request: AnyRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        # OpenAI streams may send usage in a chunk after the finish reason: hold the finish back
        # until the stream ends so the usage can ride on it.
        final: LLMEngineOutput | None = None
        async for chunk in self.client.generate(request, context=context):
            out = chunk_to_output(chunk)
            if final is not None:
                final.completion_usage = out.completion_usage or final.completion_usage
                continue
            if out.finish_reason is not None:
                final = out
                continue
            if out.text or out.error:
                yield out
        if final is not None:
            yield final
