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
from typing import Any, ClassVar, Protocol

import msgspec

from dynamo_graph.frontend.errors import HTTPError, from_decode_error
from dynamo_graph.frontend.limits import Admission, FrontendLimits
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.openai_asgi import OVERLOADED, OpenAIHandler
from dynamo_graph.frontend.sse import StreamWriter
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.pipeline import Prepared


class ResponseWriter(StreamWriter, Protocol):
    """A surface's writer also builds the whole response, for requests that do not stream."""

    def body(self) -> bytes:
        """The whole response, after `finish`."""


class SurfaceHandler(OpenAIHandler, abc.ABC):
    """The chat route's handler under another API's request and response shapes. Subclasses set
    `endpoint` (the metrics label), `surface_decoder` and `param_names`, and implement `to_chat`,
    `render_error` and `writer`."""

    kind = "chat"
    surface_decoder: msgspec.json.Decoder
    # Chat request field -> the field of this API a client set, for errors the pipeline raises.
    param_names: ClassVar[dict[str, str]] = {}

    def __init__(
        self, models: ModelRegistry, metrics: FrontendMetrics, limits: FrontendLimits, admission: Admission
    ) -> None:
        super().__init__(models, metrics, limits, admission)
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

    _unary = OpenAIHandler._gathered
