"""`POST /v1/embeddings`: a validated request to the model's embedding pipeline, one JSON answer.

Same admission, body limit, API keys, request deadline (504) and cancellation on disconnect as
the generation routes (openai_asgi.py); metrics count it under endpoint `embeddings`, with the
request's prompt tokens as its input sequence length. A model whose card does not list
`embedding` answers 400 naming the model (and a chat request to an embedding model likewise).
"""

from __future__ import annotations

import asyncio
from typing import Any

from dynamo_graph.frontend.errors import HTTPError, request_decoder
from dynamo_graph.frontend.metrics import ModelMetrics
from dynamo_graph.frontend.openai_asgi import OpenAIHandler, Scope, Send, WorkersLeft, send_json
from dynamo_graph.frontend.openai_embeddings.protocol import EmbeddingsRequest, embeddings_body
from dynamo_graph.llm.embeddings import EmbeddingPipeline
from dynamo_graph.llm.preprocessor import RequestValidationError
from dynamo_graph.llm.protocol import PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context


def _tokens(prepared: PreprocessedEmbeddingRequest) -> int:
    return sum(len(ids) for ids in prepared.token_ids)


class EmbeddingsHandler(OpenAIHandler):
    """Serves `/v1/embeddings` for every model whose card says `embedding`: the shared request
    lifecycle (openai_asgi.py `_serve`), with one call to the embedding pipeline as its answer."""

    kind = "embedding"
    endpoint = "embeddings"
    decoder = request_decoder(EmbeddingsRequest)

    def _accept(  # type: ignore[override]
        self, request: EmbeddingsRequest, scope: Scope
    ) -> tuple[EmbeddingPipeline, PreprocessedEmbeddingRequest]:
        pipeline: EmbeddingPipeline = self._model(request.model)
        try:
            return pipeline, pipeline.prepare(request.input, request.dimensions)
        except RequestValidationError as err:
            raise HTTPError(400, err.message, param=err.param, code=err.code) from None

    async def _unary(  # type: ignore[override]
        self,
        pipeline: EmbeddingPipeline,
        prepared: PreprocessedEmbeddingRequest,
        request: EmbeddingsRequest,
        context: Context,
        send: Send,
        metrics: ModelMetrics,
        start: float,
        deadline: float | None,
        retry: bool = False,
    ) -> bool:
        try:
            async with asyncio.timeout_at(deadline):
                out = await pipeline.embed(prepared, context)
        except Exception as err:
            if context.is_stopped():  # the client went away: nobody is listening
                return False
            if self._left(err, pipeline, retry):
                raise WorkersLeft from err
            http_err = await self._failure(err, context)
            await send_json(send, http_err.status, self.error_body(http_err))
            return False
        body = embeddings_body(request.model, out.embeddings, _tokens(prepared), request.encoding_format)
        await send_json(send, 200, body)
        return True

    @staticmethod
    def _tokens_used(prepared: Any) -> tuple[int, int]:
        return _tokens(prepared), 0

    @staticmethod
    def _count_tokens(metrics: ModelMetrics, prepared: Any) -> None:
        """An embedding's only token count is its input's."""
        metrics.isl.observe(_tokens(prepared))
