"""`POST /v1/chat/completions`: the shared handler (openai_asgi.py) with the chat request, its SSE
chunks and its whole body (text, reasoning and tool calls)."""

from __future__ import annotations

from typing import Any

from dynamo_graph.frontend.openai_asgi import OpenAIHandler
from dynamo_graph.frontend.openai_chat.events import ChunkWriter, WholeAnswer, chunk_writer
from dynamo_graph.frontend.openai_chat.protocol import DECODER, chat_completion_body
from dynamo_graph.llm.pipeline import Prepared


class ChatHandler(OpenAIHandler):
    """Serves `/v1/chat/completions` for every model whose card lists `chat`."""

    kind = "chat"
    endpoint = "chat_completions"
    decoder = DECODER

    def writer(self, request: Any, prepared: Prepared) -> ChunkWriter:
        return chunk_writer(request, prepared, chat=True)

    def answer(self, request: Any, prepared: Prepared) -> WholeAnswer:
        return WholeAnswer(request.model, prepared, chat_completion_body)
