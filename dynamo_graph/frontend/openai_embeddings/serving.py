"""`POST /v1/embeddings`: a validated request to the model's embedding pipeline, one JSON answer.

Same admission, body limit, API keys, request deadline (504) and cancellation on disconnect as
the generation routes (openai_asgi.py); metrics count it under endpoint `embeddings`, with the
request's prompt tokens as its input sequence length. A model whose card does not list
`embedding` answers 400 naming the model (and a chat request to an embedding model likewise).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from dynamo_graph.frontend.errors import HTTPError, from_decode_error
from dynamo_graph.frontend.openai_asgi import (
    OpenAIHandler,
    Receive,
    Scope,
    Send,
    as_http_error,
    send_json,
    watch_disconnect,
)
from dynamo_graph.frontend.openai_embeddings.protocol import EmbeddingsRequest, embeddings_body
from dynamo_graph.llm.embeddings import EmbeddingPipeline
from dynamo_graph.llm.preprocessor import RequestValidationError
from dynamo_graph.llm.protocol import PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

_DECODER = msgspec.json.Decoder(EmbeddingsRequest)


class EmbeddingsHandler(OpenAIHandler):
    """Serves `/v1/embeddings` for every model whose card says `embedding`."""

    kind = "embedding"
    endpoint = "embeddings"

    async def _handle(self, scope: Scope, receive: Receive, send: Send, deadline: float | None) -> None:
        try:
            body = await self._read(scope, receive, deadline)
            try:
                request = _DECODER.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                raise from_decode_error(err) from None
            pipeline: EmbeddingPipeline = self._model(request.model)
            try:
                prepared = pipeline.prepare(request.input, request.dimensions)
            except RequestValidationError as err:
                raise HTTPError(400, err.message, param=err.param, code="invalid_request") from None
        except HTTPError as err:
            await self._refuse(send, err)
            return
        except ConnectionResetError:
            return
        await self._embed(pipeline, request, prepared, receive, send, deadline)

    async def _embed(
        self,
        pipeline: EmbeddingPipeline,
        request: EmbeddingsRequest,
        prepared: PreprocessedEmbeddingRequest,
        receive: Receive,
        send: Send,
        deadline: float | None,
    ) -> None:
        metrics = self.metrics.model(pipeline.name)
        context = Context()
        watcher = asyncio.create_task(watch_disconnect(receive, context))
        tokens = sum(len(ids) for ids in prepared.token_ids)
        metrics.inflight += 1
        start = time.perf_counter()
        status = "error"
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    out = await pipeline.embed(prepared, context)
            except Exception as err:
                if watcher.done() and not watcher.cancelled():
                    status = "cancelled"  # nobody is listening
                    return
                if isinstance(err, TimeoutError):
                    context.stop_generating()
                    self.admission.count("timeout")
                http_err = as_http_error(err)
                await send_json(send, http_err.status, self.error_body(http_err))
                return
            body = embeddings_body(request.model, out.embeddings, tokens, request.encoding_format)
            await send_json(send, 200, body)
            status = "success"
        finally:
            metrics.inflight -= 1
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            metrics.count_request(self.endpoint, "unary", status)
            metrics.duration.observe(time.perf_counter() - start)
            metrics.isl.observe(tokens)
