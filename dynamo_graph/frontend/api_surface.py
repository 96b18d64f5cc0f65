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
from typing import Any, Protocol

from dynamo_graph.frontend.openai_asgi import Answer, OpenAIHandler
from dynamo_graph.frontend.sse import StreamWriter
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.pipeline import Prepared


class ResponseWriter(StreamWriter, Answer, Protocol):
    """A surface's writer streams the events and also builds the whole response (`body`)."""


class SurfaceHandler(OpenAIHandler, abc.ABC):
    """The chat route's handler under another API's request and response shapes. Subclasses set
    `endpoint` (the metrics label), `decoder` and `param_names`, implement `convert` and `writer`,
    and `render_error` where the API's errors are not OpenAI's."""

    kind = "chat"

    @abc.abstractmethod
    def convert(self, request: Any) -> ChatCompletionRequest:
        """The chat request the pipeline runs; raises HTTPError naming this API's field."""

    @abc.abstractmethod
    def writer(self, request: Any, prepared: Prepared) -> ResponseWriter:
        """Formats one response, streamed or whole."""

    def answer(self, request: Any, prepared: Prepared) -> ResponseWriter:
        """The writer gathers the whole response too."""
        return self.writer(request, prepared)
