"""`POST /v1/completions`: the shared handler (openai_asgi.py) with the completions request, its
SSE chunks (chat's writer: openai_chat/events.py) and its whole body."""

from __future__ import annotations

from typing import Any

from dynamo_graph.frontend.openai_asgi import OpenAIHandler
from dynamo_graph.frontend.openai_chat.events import ChunkWriter, WholeAnswer, chunk_writer
from dynamo_graph.frontend.openai_completions.protocol import DECODER, completion_body
from dynamo_graph.llm.pipeline import Prepared


def _body(model: str, text: str, finish_reason: str, prepared: Prepared, **fields: Any) -> bytes:
    """Of the gathered fields only `logprobs` is a completion's: reasoning and tool calls are chat's."""
    return completion_body(model, text, finish_reason, prepared, fields["logprobs"])


class CompletionsHandler(OpenAIHandler):
    """Serves `/v1/completions` for every model whose card lists `completions`."""

    kind = "completions"
    endpoint = "completions"
    decoder = DECODER

    def writer(self, request: Any, prepared: Prepared) -> ChunkWriter:
        return chunk_writer(request, prepared, chat=False)

    def answer(self, request: Any, prepared: Prepared) -> WholeAnswer:
        return WholeAnswer(request.model, prepared, _body)
