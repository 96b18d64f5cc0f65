"""One served model as the inputs see it: OpenAI request in, text deltas out.

A pipeline is used in two steps so that bad input is answered before a response starts:
`prepare()` validates and pre-processes synchronously (raising errors that become 4xx), then
`stream()` runs the engine and yields deltas. `TokensPipeline` wraps a Tokens-input backend
(pre/post-processing happen here, docs/architecture.md); `TextPipeline` forwards the OpenAI
request to an engine that does its own templating. The backend is anything with
`generate(request, context)`: an engine in this process, or (later) a router over workers.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.chat_output import ChatOutputParser, Delta, output_parser
from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.detokenizer import DetokenizerFactory
from dynamo_graph.llm.logprobs import LogprobNamer
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, requested_capabilities
from dynamo_graph.llm.postprocessor import Postprocessor
from dynamo_graph.llm.preprocessor import (
    TOOL_CHOICE_WITHOUT_TOOL,
    UNSUPPORTED_BY_MODEL,
    Preprocessor,
    RequestValidationError,
)
from dynamo_graph.llm.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.llm.token_output import TokenDelta, TokenLimits
from dynamo_graph.llm.tool_choice import forced, forced_schema
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError


class Backend(Protocol):
    def generate(self, request: Any, context: Context) -> AsyncIterator[LLMEngineOutput]: ...


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to stream; usage is filled in as the stream runs."""

    request: AnyRequest
    preprocessed: PreprocessedRequest | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    # Sorts chat output into reasoning / content / tool calls (chat_output.py); None: all content.
    output_parser: ChatOutputParser | None = None
    # The stop string that ended the output (known to pipelines that post-process).
    stop_string: str | None = None
    # Stream the engine's token ids (TokenDelta), not text: token-in/token-out requests.
    tokens_out: bool = False


class ModelPipeline(abc.ABC):
    def __init__(self, card: ModelDeploymentCard, backend: Backend) -> None:
        self.card = card
        self.backend = backend

    @property
    def name(self) -> str:
        return self.card.display_name

    def prepare(self, request: AnyRequest) -> Prepared:
        """Validate and pre-process; raises errors that the inputs report as bad requests."""
        if isinstance(request, ChatCompletionRequest):
            _check_tool_choice(request, self.card)
        _check_capabilities(request, self.card)
        prepared = self._prepare(request)
        pre = prepared.preprocessed
        if pre is not None and isinstance(request, ChatCompletionRequest) and forced(request):
            pre.sampling_options.guided_json = forced_schema(request)
        prepared.output_parser = output_parser(self.card, request)
        return prepared

    def stream(self, prepared: Prepared, context: Context) -> AsyncIterator[Delta]:
        """Run the request; the last delta carries the finish reason ("tool_calls" when the
        model called tools). Without an output parser, the engine's deltas go out as they are
        (no extra generator on the per-token path)."""
        deltas = self._generate(prepared, context)
        parser = prepared.output_parser
        return deltas if parser is None else self._parsed(deltas, parser)

    @staticmethod
    async def _parsed(deltas: AsyncIterator[Delta], parser: ChatOutputParser) -> AsyncIterator[Delta]:
        try:
            async for delta in deltas:
                if delta.logprobs:
                    yield Delta("", logprobs=delta.logprobs)
                for out in parser.feed(delta.text):
                    yield out
                if delta.finish_reason is not None:
                    for out in parser.finish():
                        yield out
                    finish = delta.finish_reason
                    if finish == "stop" and parser.made_tool_calls:
                        finish = "tool_calls"
                    yield Delta("", finish)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    @abc.abstractmethod
    def _prepare(self, request: AnyRequest) -> Prepared:
        """The engine-specific part of `prepare`."""

    @abc.abstractmethod
    def _generate(self, prepared: Prepared, context: Context) -> AsyncIterator[Delta]:
        """The engine's output as text deltas; the last one carries the finish reason."""


def _check_capabilities(request: AnyRequest, card: ModelDeploymentCard) -> None:
    """Fields whose answer the engine must produce: a 400 naming the field where it cannot."""
    wants = requested_capabilities(request)
    missing = [field for cap, field in wants if cap not in card.capabilities]
    if missing:
        field = missing[0]
        engine = f"engine {card.engine!r}" if card.engine else "this model's engine"
        raise RequestValidationError(
            f"{field} is not supported by {engine} of model {card.display_name!r}",
            field,
            UNSUPPORTED_BY_MODEL,
        )


def _check_tool_choice(request: ChatCompletionRequest, card: ModelDeploymentCard) -> None:
    """tool_choice "auto" needs a parser to find the calls in the output; "required" or a named
    function are forced by guided decoding (tool_choice.py), which the engine must do."""
    choice = request.tool_choice
    if not forced(request):
        if choice == "auto" and request.tools and card.tool_call_parser is None:
            raise RequestValidationError(
                f'tool_choice "auto" needs a tool call parser, and model {card.display_name!r} has none '
                "(start its workers with --dyn-tool-call-parser)",
                "tool_choice",
                UNSUPPORTED_BY_MODEL,
            )
        return
    if not request.tools:
        raise RequestValidationError("tool_choice needs tools", "tool_choice", TOOL_CHOICE_WITHOUT_TOOL)
    forced_schema(request)  # a bad choice is a 400 before the engine's ability is
    if "guided_json" not in card.capabilities:
        engine = f"engine {card.engine!r}" if card.engine else "this model's engine"
        shown = choice if isinstance(choice, str) else "a named function"
        raise RequestValidationError(
            f"tool_choice {shown!r} needs guided decoding, which {engine} of model "
            f'{card.display_name!r} does not do; use "auto" or "none"',
            "tool_choice",
            UNSUPPORTED_BY_MODEL,
        )
    if request.response_format or request.guided_json is not None:
        raise RequestValidationError(
            "tool_choice forcing a call cannot be combined with response_format or guided_json", "tool_choice"
        )


def _engine_failure(out: LLMEngineOutput) -> RequestError:
    return RequestError(out.error or f"engine ended the stream with {out.finish_reason!r}")


class TokensPipeline(ModelPipeline):
    """Pre-processes to token ids, calls the backend, post-processes token ids to text."""

    def __init__(
        self,
        card: ModelDeploymentCard,
        backend: Backend,
        preprocessor: Preprocessor,
        detokenizers: DetokenizerFactory,
    ) -> None:
        super().__init__(card, backend)
        self.preprocessor = preprocessor
        self.detokenizers = detokenizers
        self.logprobs = LogprobNamer(preprocessor.tokenizer)

    def stream(self, prepared: Prepared, context: Context) -> AsyncIterator[Any]:
        """Text deltas, or for a token-in/token-out request the engine's ids (TokenDelta)."""
        if prepared.tokens_out:
            return self._token_deltas(prepared, context)
        return super().stream(prepared, context)

    async def _token_deltas(self, prepared: Prepared, context: Context) -> AsyncIterator[TokenDelta]:
        pre = prepared.preprocessed
        assert pre is not None
        limits = TokenLimits(pre.stop_conditions)
        outputs = self.backend.generate(pre, context)
        try:
            async for out in outputs:
                if out.error is not None or out.finish_reason == "error":
                    raise _engine_failure(out)
                if out.cached_tokens is not None:
                    prepared.cached_tokens = out.cached_tokens
                ids, finish, stop_id = limits.cut(out.token_ids)
                prepared.completion_tokens = limits.count
                n = len(ids)
                log_probs = out.log_probs[:n] if out.log_probs is not None else None
                top = out.top_logprobs[:n] if out.top_logprobs is not None else None
                if finish is None and out.finish_reason is not None:
                    finish = "stop" if out.finish_reason == "eos" else out.finish_reason
                if finish is not None:
                    yield TokenDelta(ids, finish, log_probs, top, stop_id)
                    return
                if ids:
                    yield TokenDelta(ids, None, log_probs, top)
            raise RequestError("engine stream ended before generation completed")
        finally:
            if not context.is_stopped():
                context.stop_generating()
            await outputs.aclose()  # type: ignore[attr-defined]

    def _prepare(self, request: AnyRequest) -> Prepared:
        if isinstance(request, ChatCompletionRequest):
            pre = self.preprocessor.preprocess_chat(request)
        else:
            pre = self.preprocessor.preprocess_completion(request)
        return Prepared(request=request, preprocessed=pre, prompt_tokens=len(pre.token_ids))

    async def _generate(self, prepared: Prepared, context: Context) -> AsyncIterator[Delta]:
        pre = prepared.preprocessed
        assert pre is not None
        post = Postprocessor.for_request(self.detokenizers, pre)
        wants_logprobs = pre.output_options.logprobs is not None
        outputs = self.backend.generate(pre, context)
        try:
            async for out in outputs:
                if out.error is not None or out.finish_reason == "error":
                    raise _engine_failure(out)
                if out.cached_tokens is not None:
                    prepared.cached_tokens = out.cached_tokens
                text, finish = post.process(out)
                prepared.completion_tokens = post.completion_tokens
                logprobs = self.logprobs.entries(out, post.shown) if wants_logprobs else None
                if finish is not None:  # the postprocessor has flushed everything it held
                    prepared.stop_string = post.stop_string
                    yield Delta(text, finish, logprobs=logprobs)
                    return
                if text or logprobs:
                    yield Delta(text, logprobs=logprobs)
            raise RequestError("engine stream ended before generation completed")
        finally:
            if not context.is_stopped():
                # We stopped reading early (a stop condition, or our consumer went away).
                context.stop_generating()
            await outputs.aclose()  # type: ignore[attr-defined]


def tokens_pipeline(card: ModelDeploymentCard, model: LocalModel, backend: Backend) -> TokensPipeline:
    """A Tokens-input model's pipeline: the card's limits, the model's tokenizer and template."""
    tokenizer = model.load_tokenizer()
    source = card.chat_template or model.chat_template
    template = ChatTemplate(source, bos_token=model.bos_token, eos_token=model.eos_token) if source else None
    preprocessor = Preprocessor(
        tokenizer=tokenizer,
        chat_template=template,
        eos_token_ids=card.eos_token_ids or model.eos_token_ids,
        context_length=card.context_length,
        model_name=card.display_name,
    )
    return TokensPipeline(card, backend, preprocessor, DetokenizerFactory(tokenizer))


class TextPipeline(ModelPipeline):
    """For engines that take the OpenAI request and return text (echo_full, chat-type workers)."""

    def _prepare(self, request: AnyRequest) -> Prepared:
        return Prepared(request=request, preprocessed=None)

    async def _generate(self, prepared: Prepared, context: Context) -> AsyncIterator[Delta]:
        outputs = self.backend.generate(prepared.request, context)
        try:
            async for out in outputs:
                if out.error is not None or out.finish_reason == "error":
                    raise _engine_failure(out)
                if out.text:
                    prepared.completion_tokens += max(len(out.token_ids), 1)
                if out.finish_reason is not None:
                    usage = out.completion_usage
                    if usage is not None:
                        prepared.prompt_tokens = usage.prompt_tokens
                        prepared.completion_tokens = usage.completion_tokens
                        prepared.cached_tokens = usage.cached_tokens
                    yield Delta(out.text or "", "stop" if out.finish_reason == "eos" else out.finish_reason)
                    return
                if out.text:
                    yield Delta(out.text)
            raise RequestError("engine stream ended before generation completed")
        finally:
            if not context.is_stopped():
                context.stop_generating()
            await outputs.aclose()  # type: ignore[attr-defined]
