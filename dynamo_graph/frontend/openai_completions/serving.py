"""`POST /v1/completions`: the shared handler (openai_asgi.py) with the completions request, its
SSE chunks and its whole body."""

from __future__ import annotations

from typing import Any

from dynamo_graph.frontend.limits import Admission, FrontendLimits
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import OpenAIHandler
from dynamo_graph.frontend.openai_completions.protocol import DECODER, completion_body
from dynamo_graph.frontend.responses import ChunkWriter, chunk_writer
from dynamo_graph.llm.logprobs import TokenLogprob
from dynamo_graph.llm.pipeline import Prepared


class CompletionsHandler(OpenAIHandler):
    """Serves `/v1/completions` for every model whose card lists `completions`."""

    decoder = DECODER

    def __init__(
        self,
        models: ModelRegistry,
        metrics: FrontendMetrics,
        limits: FrontendLimits | int,
        admission: Admission | None = None,
    ) -> None:
        super().__init__("completions", models, metrics, limits, admission)

    def writer(self, request: Any, prepared: Prepared) -> ChunkWriter:
        return chunk_writer(request, prepared, chat=False)

    def full_body(
        self,
        model: str,
        text: str,
        finish_reason: str,
        prepared: Prepared,
        *,
        reasoning: str,
        tool_calls: list[dict] | None,
        logprobs: list[TokenLogprob] | None,
    ) -> bytes:
        """Reasoning and tool calls are chat's: a completion has only its text."""
        return completion_body(model, text, finish_reason, prepared, logprobs)
