"""Routes whose requests run as chat completions: OpenAI's Responses API, Anthropic's Messages.

Each surface is a package beside this module (`openai_responses/`, `anthropic_messages/`): its
request types (msgspec Structs, so decode errors name the field), the conversion of a request into
a `ChatCompletionRequest`, and a writer that turns the pipeline's deltas into that API's events and
whole response. The handler is the chat route's own (openai_asgi.py), so the model's template,
tool-call and reasoning parsers, routing, migration, limits, API keys, metrics, timeouts and
cancellation on disconnect apply unchanged; only decoding, error bodies and output differ.
"""

from __future__ import annotations

import abc
import asyncio
import time
from typing import Any, ClassVar, Protocol

import msgspec

from dynamo_graph.frontend.errors import HTTPError, from_decode_error
from dynamo_graph.frontend.limits import Admission, FrontendLimits
from dynamo_graph.frontend.metrics import FrontendMetrics, ModelMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import OVERLOADED, OpenAIHandler, Send, send_json
from dynamo_graph.frontend.responses import StreamWriter
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.pipeline import ModelPipeline, Prepared
from dynamo_graph.runtime.context import Context


class ResponseWriter(StreamWriter, Protocol):
    """A surface's writer also builds the whole response, for requests that do not stream."""

    def body(self) -> bytes:
        """The whole response, after `finish`."""


class SurfaceHandler(OpenAIHandler, abc.ABC):
    """The chat route's handler under another API's request and response shapes. Subclasses set
    `endpoint` (the metrics label), `surface_decoder` and `param_names`, and implement `to_chat`,
    `render_error` and `writer`."""

    endpoint = ""
    surface_decoder: msgspec.json.Decoder
    # Chat request field -> the field of this API a client set, for errors the pipeline raises.
    param_names: ClassVar[dict[str, str]] = {}

    def __init__(
        self, models: ModelRegistry, metrics: FrontendMetrics, limits: FrontendLimits, admission: Admission
    ) -> None:
        endpoint = self.endpoint
        super().__init__("chat", models, metrics, limits, admission)
        self.endpoint = endpoint
        self.overloaded_body = self.error_body(OVERLOADED)

    def decode(self, body: bytes) -> tuple[ChatCompletionRequest, Any]:
        try:
            request = self.surface_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise from_decode_error(err) from None
        return self.to_chat(request), request

    def error_body(self, err: HTTPError) -> bytes:
        param = self.param_names.get(err.param or "")
        if param is not None:
            message = err.message.replace(err.param or "", param)
            err = HTTPError(err.status, message, param=param, code=err.code, error_type=err.error_type)
        return self.render_error(err)

    @abc.abstractmethod
    def to_chat(self, request: Any) -> ChatCompletionRequest:
        """The chat request the pipeline runs; raises HTTPError naming this API's field."""

    @abc.abstractmethod
    def render_error(self, err: HTTPError) -> bytes:
        """An error body in this API's shape."""

    @abc.abstractmethod
    def writer(self, request: Any, prepared: Prepared) -> ResponseWriter:
        """Formats one response, streamed or whole."""

    async def _unary(
        self,
        pipeline: ModelPipeline,
        prepared: Prepared,
        request: Any,
        context: Context,
        send: Send,
        metrics: ModelMetrics,
        start: float,
        deadline: float | None,
    ) -> bool:
        """The stream, gathered by the surface's writer into one response."""
        writer = self.writer(request, prepared)
        first = True
        finished = False
        deltas = pipeline.stream(prepared, context)
        try:
            async with asyncio.timeout_at(deadline):
                async for delta in deltas:
                    if delta.visible():
                        if first:
                            metrics.ttft.observe(time.perf_counter() - start)
                            first = False
                        writer.delta(delta)
                    if delta.finish_reason is not None:
                        writer.finish(delta.finish_reason)
                        finished = True
        except Exception as err:
            http_err = await self._failure(err, context, deltas)
            await send_json(send, http_err.status, self.error_body(http_err), http_err.headers)
            return False
        if not finished:  # cancelled by the client: nobody is listening
            return False
        await send_json(send, 200, writer.body())
        return True
