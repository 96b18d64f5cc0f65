"""What every generation route shares, as a plain ASGI handler (the hot path): body reading,
limits, admission, the request's lifecycle (metrics, deadline, cancellation on disconnect), the
streaming and gathering loops, and error answers.

Each API surface is a package beside this module (`openai_chat/`, `openai_completions/`,
`openai_responses/`, ...) that subclasses `OpenAIHandler` with its decoder, writers and error
shape, and exports a `Surface` record of its routes for app.py. The handlers sit beside the
FastAPI app rather than inside it: FastAPI's request and streaming layers cost about as much CPU
as everything else a streamed request needs (docs/benchmarks.md). Request bodies decode straight into
msgspec Structs whose errors name the field; the response status is only sent once the first
delta (or error) is known, so failures before the first token are still proper 4xx/5xx answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgspec

from dynamo_graph.frontend.errors import (
    OPENAI_ERROR,
    UNKNOWN_FIELD,
    ErrorSchema,
    HTTPError,
    decode_request,
    post_only,
    strict_decoder,
)
from dynamo_graph.frontend.interval import StreamInterval
from dynamo_graph.frontend.limits import RETRY_AFTER_S, Admission, FrontendLimits
from dynamo_graph.frontend.metrics import FrontendMetrics, ModelMetrics
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.record import Recorder
from dynamo_graph.frontend.routing_headers import apply_routing_headers
from dynamo_graph.frontend.sse import SSE_HEADERS, StreamWriter
from dynamo_graph.frontend.tenant_limits import Tenant, TenantRequest, TenantState
from dynamo_graph.frontend.tenants import TENANT_SCOPE, cache_salt
from dynamo_graph.llm.openai import MAX_CHOICES, AnyRequest, requested_max_tokens
from dynamo_graph.llm.pipeline import Delta, ModelPipeline, Prepared
from dynamo_graph.llm.preprocessor import CONTEXT_LENGTH_EXCEEDED
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.client import NoInstances
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Which frontend process answered: processes share a port (a frontend's replicas, and a
# rollout's old and new run), and tests, benchmarks and the supervisor's probes tell them apart.
PID_HEADER = (b"x-dyngraph-pid", str(os.getpid()).encode())
JSON_HEADERS = [(b"content-type", b"application/json"), PID_HEADER]
STREAM_HEADERS = [*SSE_HEADERS, PID_HEADER]

# Saturated: answered at once, never queued (a client retries after Retry-After).
_RETRY_AFTER = [(b"retry-after", str(RETRY_AFTER_S).encode())]
OVERLOADED_HEADERS = [*JSON_HEADERS, *_RETRY_AFTER]
OVERLOADED = HTTPError(
    503, "The server is at its limit of concurrent requests; retry shortly", code="overloaded"
)
WORKER_POLL_S = 0.05  # how often a request waiting for its model's workers looks again
TRACE_HEADERS = (b"traceparent", b"tracestate")
ACCEPT_ATTEMPTS = 3  # a request whose model's workers all left before its first byte is accepted again


def model_not_found(name: str) -> HTTPError:
    """OpenAI's 404 for a model that is not here, and, the same, for one the key's tenant may not
    use: a key learns nothing about the models it cannot use (docs/security.md)."""
    return HTTPError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


class WorkersLeft(Exception):
    """Raised (not answered) when a request's model lost its last worker before the first byte."""


def model_unavailable(name: str) -> HTTPError:
    """A listed model with no worker for now (they are being replaced, or restarting): 503 and
    Retry-After, which clients retry, where 404 would say the model is gone for good."""
    return HTTPError(
        503,
        f"The model `{name}` has no worker available right now; retry shortly",
        param="model",
        code="model_unavailable",
        headers=_RETRY_AFTER,
    )


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = JSON_HEADERS if headers is None else [*JSON_HEADERS, *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPError(
                413, f"Request body is larger than the limit of {limit} bytes", code="body_too_large"
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# curl's `-d` sends form-urlencoded by default; its body is still JSON, so accept it.
_JSON_MEDIA = (b"", b"application/json", b"application/x-www-form-urlencoded")


def _check_content_type(scope: Scope) -> None:
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if media not in _JSON_MEDIA and not media.endswith(b"+json"):
                raise HTTPError(
                    415,
                    f"Unsupported content type {media.decode(errors='replace')!r}; send application/json",
                    code="unsupported_media_type",
                )


async def watch_disconnect(receive: Receive, context: Context) -> None:
    """Cancel the request's generation when the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            context.stop_generating()
            return


def as_http_error(err: Exception) -> HTTPError:
    if isinstance(err, HTTPError):
        return err
    if isinstance(err, RequestError):
        return HTTPError.from_engine_error(err)
    if isinstance(err, TimeoutError):  # the request's deadline (--request-timeout-s)
        return HTTPError(504, "The request did not complete within the server's time limit", code="timeout")
    log.exception("request failed", exc_info=err)
    return HTTPError(500, f"Internal error: {err}", code="internal")


class Answer(Protocol):
    """A request's whole answer, gathered from the pipeline's deltas when it does not stream."""

    def delta(self, delta: Delta) -> object:
        """Gathers a visible delta."""

    def finish(self, reason: str) -> object:
        """Takes the finish reason, after the last delta."""

    def body(self) -> bytes:
        """The whole answer, after `finish`."""


class OpenAIHandler:
    """Serves one endpoint kind ("chat", "completions", "embedding") for every registered model.

    Each API surface subclasses it (openai_chat/, openai_completions/, api_surface.py, ...): it
    sets `kind`, `endpoint` and `decoder` (and `convert` when the pipeline runs another request
    type), and provides `writer` for a streamed answer and `answer` for a whole one; error bodies
    are OpenAI's unless it overrides `render_error`.
    """

    kind: ClassVar[str]  # the model card's model_type a model needs to be served here
    endpoint: ClassVar[str]  # the metrics label
    # The request as the client sends it; its type is the route's request body in the OpenAPI doc.
    decoder: ClassVar[msgspec.json.Decoder]
    # The pipeline request's field -> the field of this API a client set, for errors the pipeline raises.
    param_names: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        models: ModelRegistry,
        metrics: FrontendMetrics,
        limits: FrontendLimits,
        admission: Admission,
        recorder: Recorder | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`recorder`: where the requests served are recorded as a trace (frontend/record.py);
        `stream_interval`: tokens per streamed event after the first (frontend/interval.py)."""
        self.stream_interval = stream_interval
        self.models = models
        self.recorder = recorder
        self.metrics = metrics
        self.limits = limits
        self.body_limit = limits.body_limit
        self.timeout_s = limits.request_timeout_s
        self.admission = admission
        self.overloaded_body = self.error_body(OVERLOADED)
        if limits.reject_unknown_fields:
            self.decoder = strict_decoder(type(self).decoder)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            refused = post_only()
            await send_json(send, 405, self.error_body(refused), refused.headers)
            return
        admission = self.admission
        if not admission.try_acquire():
            await send({"type": "http.response.start", "status": 503, "headers": OVERLOADED_HEADERS})
            await send({"type": "http.response.body", "body": self.overloaded_body})
            return
        try:
            deadline = None
            if self.timeout_s is not None:
                deadline = asyncio.get_running_loop().time() + self.timeout_s
            if tracing.ON:
                await self._traced(scope, receive, send, deadline)
            else:
                await self._handle(scope, receive, send, deadline)
        finally:
            admission.release()

    async def _traced(self, scope: Scope, receive: Receive, send: Send, deadline: float | None) -> None:
        """`_handle` inside the request's server span, continuing the client's W3C `traceparent`
        (or starting a trace); `root` carries the span to the request's stages."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS
        }
        root = Context()
        path = scope["path"]
        attributes = {"http.request.method": "POST", "url.path": path}
        with tracing.span(f"POST {path}", root, attributes, kind="server", headers=carrier) as http:
            if not http.recording:  # sampled out: nothing more to record
                await self._handle(scope, receive, send, deadline, root)
                return

            async def traced_send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    http.set("http.response.status_code", message["status"])
                await send(message)

            await self._handle(scope, receive, traced_send, deadline, root)

    async def _read(self, scope: Scope, receive: Receive, deadline: float | None) -> bytes:
        """The request body, within the body limit and the request's deadline."""
        _check_content_type(scope)
        if deadline is None:
            return await read_body(receive, self.body_limit)
        try:
            async with asyncio.timeout_at(deadline):
                return await read_body(receive, self.body_limit)
        except TimeoutError:
            self.admission.count("timeout")
            raise HTTPError(
                408, "The request body was not received within the server's time limit", code="timeout"
            ) from None

    def _model(self, name: str) -> Any:
        """The model's pipeline; 404 for an unknown model and, as OpenAI answers, for one that
        serves other endpoints (`wrong_endpoint`): no such model here."""
        pipeline = self.models.get(name)
        if pipeline is None:
            raise model_not_found(name)
        if self.kind not in pipeline.card.model_type:
            raise HTTPError(
                404,
                f"The model `{name}` does not serve this endpoint; it serves "
                f"{', '.join(pipeline.card.model_type)}",
                param="model",
                code="wrong_endpoint",
            )
        return pipeline

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, deadline: float | None, root: Context | None = None
    ) -> None:
        try:
            body = await self._read(scope, receive, deadline)
            request, original = self.decode(body)
        except HTTPError as err:
            await self._refuse(send, err)
            return
        except ConnectionResetError:
            return
        tenant: TenantState | None = scope.get(TENANT_SCOPE)
        if tenant is None:
            await self._attempts(scope, receive, send, deadline, request, original, None, root)
            return
        try:
            charge = self._admit_tenant(tenant, request.model)
        except HTTPError as err:
            await self._refuse(send, err)
            return
        try:
            await self._attempts(scope, receive, send, deadline, request, original, charge, root)
        finally:
            charge.release()

    @staticmethod
    def _admit_tenant(tenant: TenantState, model: str) -> TenantRequest:
        """The tenant's request; raises its 404 for a model it may not use, or its 429 past one
        of its limits."""
        if not tenant.tenant.allows(model):
            tenant.refuse("model_not_found")
            raise model_not_found(model)
        return tenant.admit()

    async def _attempts(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        deadline: float | None,
        request: AnyRequest,
        original: Any,
        tenant: TenantRequest | None,
        root: Context | None,
    ) -> None:
        """Accept and serve the request, again if its model's workers left under it
        (WorkersLeft); `tenant`: what it is charged to; `root`: the request's trace."""
        for attempt in range(ACCEPT_ATTEMPTS):
            try:
                await self._await_worker(request.model, receive, deadline)
                with tracing.span("preprocess", root, {"llm.model": request.model}) as preprocess:
                    pipeline, prepared = self._accept(request, scope)
                    preprocess.set("llm.prompt_tokens", self._tokens_used(prepared)[0])
            except HTTPError as err:
                await self._refuse(send, err)
                return
            except ConnectionResetError:
                return
            if tenant is not None:
                tenant.prompt(self._tokens_used(prepared)[0])
            retry = attempt + 1 < ACCEPT_ATTEMPTS
            try:
                await self._serve(pipeline, prepared, original, receive, send, deadline, retry, tenant, root)
                return
            except WorkersLeft:
                continue  # accepted again: by the model's new pipeline, once it has a worker

    async def _await_worker(self, name: str, receive: Receive, deadline: float | None) -> None:
        """While a listed model has no worker to route to (every replica being replaced, or
        restarting), wait for one: up to --model-wait-s, the request's deadline or the client's
        disconnect; then `model_unavailable`. Before `_accept`, so a model whose workers came
        back with another card is served by its new pipeline. An unknown model returns at once
        (`_model` answers 404)."""
        models = self.models
        if models.routable(name) or models.get(name) is None:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + self.limits.model_wait_s
        if deadline is not None:
            until = min(until, deadline)
        gone = asyncio.ensure_future(receive())  # the body is read: only a disconnect comes
        try:
            while not models.routable(name):
                if gone.done():
                    raise ConnectionResetError("client disconnected while waiting for a worker")
                if loop.time() >= until or models.get(name) is None:
                    raise model_unavailable(name)
                await asyncio.wait((gone,), timeout=WORKER_POLL_S)
        finally:
            gone.cancel()

    def _accept(self, request: AnyRequest, scope: Scope) -> tuple[ModelPipeline, Prepared]:
        """The request's model and the request as it prepared it; HTTPError when refused."""
        _check_caps(request)
        pipeline = self._model(request.model)
        _check_context(pipeline, request)
        prepared = self._prepare(pipeline, request)
        apply_routing_headers(prepared.preprocessed, scope["headers"])
        salt = cache_salt(_tenant_of(scope), getattr(request, "cache_salt", None))
        if salt is not None and prepared.preprocessed is not None:
            prepared.preprocessed.cache_salt = salt
        return pipeline, prepared

    async def _refuse(self, send: Send, err: HTTPError) -> None:
        """Answer a request refused before it ran."""
        if err.status == 413:
            self.admission.count("body_too_large")
        await send_json(send, err.status, self.error_body(err), err.headers)

    def decode(self, body: bytes) -> tuple[AnyRequest, Any]:
        """(the request the pipeline runs, the request as the client sent it)."""
        request = decode_request(self.decoder, body)
        return self.convert(request), request

    def convert(self, request: Any) -> Any:
        """The request the pipeline runs: the client's own here; another API's request becomes a
        chat or completions request (raising HTTPError that names this API's field)."""
        return request

    def error_body(self, err: HTTPError) -> bytes:
        """An error as this API's clients expect it, naming the field they set (`param_names`;
        an unknown field is already named as they sent it)."""
        param = self.param_names.get(err.param or "")
        if param is not None and err.code != UNKNOWN_FIELD:
            message = re.sub(rf"\b{re.escape(err.param or '')}\b", param, err.message)
            err = HTTPError(err.status, message, param=param, code=err.code, error_type=err.error_type)
        return self.render_error(err)

    def render_error(self, err: HTTPError) -> bytes:
        """An error body in this API's shape: OpenAI's here."""
        return err.body()

    def writer(self, request: Any, prepared: Prepared) -> StreamWriter:
        """Formats one streamed response: each surface's own."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def answer(self, request: Any, prepared: Prepared) -> Answer:
        """Gathers one whole response: each surface's own."""
        raise NotImplementedError(f"{type(self).__name__} has no gathered answer")

    async def _failure(
        self, err: Exception, context: Context, deltas: AsyncIterator[Any] | None = None
    ) -> HTTPError:
        if isinstance(err, TimeoutError):
            # Cancel the generation: the engine (or the worker, through the request plane) stops.
            context.stop_generating()
            self.admission.count("timeout")
            if deltas is not None:
                with contextlib.suppress(Exception):
                    await deltas.aclose()  # type: ignore[attr-defined]
        return as_http_error(err)

    @staticmethod
    def _prepare(pipeline: ModelPipeline, request: AnyRequest) -> Prepared:
        try:
            return pipeline.prepare(request)
        except RequestError as err:
            raise HTTPError.from_engine_error(err) from None
        except ValueError as err:  # the preprocessor's and chat template's input errors
            code = getattr(err, "code", "invalid_request")
            raise HTTPError(400, str(err), param=getattr(err, "param", None), code=code) from None

    async def _serve(
        self,
        pipeline: ModelPipeline,
        prepared: Prepared,
        request: Any,
        receive: Receive,
        send: Send,
        deadline: float | None = None,
        retry: bool = False,
        tenant: TenantRequest | None = None,
        root: Context | None = None,
    ) -> None:
        """The request's lifecycle around its answer, streamed (`_stream`) or whole (`_unary`):
        in-flight and request metrics, cancellation when the client goes away. `request`: as the
        client sent it (`decode`). With `retry`, a model whose workers all left before the first
        byte raises WorkersLeft instead of answering (see `_left`). `tenant`: what it is charged to;
        `root`: the request's trace."""
        metrics = self.metrics.model(pipeline.name)
        context = Context()
        if root is not None:
            context.trace = root.trace
        watcher = asyncio.create_task(watch_disconnect(receive, context))
        metrics.inflight += 1
        arrival = time.time()
        start = time.perf_counter()
        request_type = "stream" if request.stream else "unary"
        status: str | None = "error"
        try:
            if request.stream:
                ok = await self._stream(
                    pipeline, prepared, request, context, send, metrics, start, deadline, retry
                )
            else:
                ok = await self._unary(
                    pipeline, prepared, request, context, send, metrics, start, deadline, retry
                )
            disconnected = watcher.done() and not watcher.cancelled()
            status = "cancelled" if disconnected else ("success" if ok else "error")
        except WorkersLeft:
            status = None  # not answered: it is accepted again
            raise
        finally:
            metrics.inflight -= 1
            watcher.cancel()
            if status is not None:
                metrics.count_request(self.endpoint, request_type, status)
                metrics.duration.observe(time.perf_counter() - start)
                self._count_tokens(metrics, prepared)
                if tenant is not None:
                    tenant.ended(status, *self._tokens_used(prepared))
            if status == "success" and self.recorder is not None:
                self.recorder.record(arrival, self.endpoint, prepared, request)

    def _left(self, err: Exception, pipeline: ModelPipeline, retry: bool) -> bool:
        """Whether a request that failed before its first byte should be accepted again: the
        model's last worker left under it (NoInstances) while the model stays listed, e.g. a
        rolling update whose new workers serve another model card and take over the model
        with a new pipeline at that moment."""
        return retry and isinstance(err, NoInstances) and self.models.get(pipeline.name) is not None

    @staticmethod
    def _tokens_used(prepared: Any) -> tuple[int, int]:
        """(prompt, completion) tokens of a request: what its tenant is charged."""
        return prepared.prompt_tokens, prepared.completion_tokens

    @staticmethod
    def _count_tokens(metrics: ModelMetrics, prepared: Prepared) -> None:
        """The request's token histograms: prompt, completion, cached prompt."""
        metrics.isl.observe(prepared.prompt_tokens)
        metrics.osl.observe(prepared.completion_tokens)
        if prepared.cached_tokens is not None:
            metrics.cached_tokens.observe(prepared.cached_tokens)

    async def _stream(
        self,
        pipeline: ModelPipeline,
        prepared: Prepared,
        request: Any,
        context: Context,
        send: Send,
        metrics: ModelMetrics,
        start: float,
        deadline: float | None,
        retry: bool = False,
    ) -> bool:
        writer = self.writer(request, prepared)
        started = False
        first_content = True
        last = start
        itl = metrics.itl
        interval = StreamInterval(self.stream_interval) if self.stream_interval > 1 else None
        deltas = pipeline.stream(prepared, context)
        try:
            async with asyncio.timeout_at(deadline):
                async for delta in deltas:
                    if not started:
                        await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
                        started = True
                        head = writer.start()
                        if head:
                            await send({"type": "http.response.body", "body": head, "more_body": True})
                    if delta.visible():
                        now = time.perf_counter()
                        if first_content:
                            metrics.ttft.observe(now - start)
                            first_content = False
                        else:
                            itl.observe(now - last)
                        last = now
                        if interval is None:
                            body = writer.delta(delta)
                        else:
                            due = interval.take(delta, prepared.completion_tokens)
                            body = b"".join([writer.delta(d) for d in due]) if due else b""
                        if body:
                            await send({"type": "http.response.body", "body": body, "more_body": True})
                    if delta.finish_reason is not None:
                        if interval is not None:
                            held = b"".join([writer.delta(d) for d in interval.rest()])
                            if held:
                                await send({"type": "http.response.body", "body": held, "more_body": True})
                        tail = writer.finish(delta.finish_reason)
                        await send({"type": "http.response.body", "body": tail, "more_body": False})
                        return True
        except Exception as err:
            if not started and self._left(err, pipeline, retry):
                raise WorkersLeft from err
            http_err = await self._failure(err, context, deltas)
            if not started:
                await send_json(send, http_err.status, self.error_body(http_err), http_err.headers)
            else:
                with contextlib.suppress(Exception):
                    body = writer.failure(http_err)
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            return False
        # The stream ended without a finish reason: the client went away and we stopped.
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEADERS})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return False

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
        retry: bool = False,
    ) -> bool:
        """The stream gathered into one JSON answer by the surface's `answer`."""
        answer = self.answer(request, prepared)
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
                        answer.delta(delta)
                    if delta.finish_reason is not None:
                        answer.finish(delta.finish_reason)
                        finished = True
        except Exception as err:
            if first and self._left(err, pipeline, retry):
                raise WorkersLeft from err
            http_err = await self._failure(err, context, deltas)
            await send_json(send, http_err.status, self.error_body(http_err), http_err.headers)
            return False
        if not finished:  # cancelled by the client: nobody is listening
            return False
        await send_json(send, 200, answer.body())
        return True


@dataclass(frozen=True, slots=True)
class Route:
    """One generation route: where it is, who serves it, and its OpenAPI summary (the request
    body's schema is the handler's `decoder` type)."""

    path: str
    handler: type[OpenAIHandler]
    summary: str


@dataclass(frozen=True, slots=True)
class Surface:
    """What an API surface's package exports for app.py to serve and document it."""

    routes: tuple[Route, ...]
    error: ErrorSchema = OPENAI_ERROR  # the shape of its error bodies, for the OpenAPI doc


def _tenant_of(scope: Scope) -> Tenant | None:
    state: TenantState | None = scope.get(TENANT_SCOPE)
    return None if state is None else state.tenant


def _check_caps(request: AnyRequest) -> None:
    """Caps that hold for every model: choices per request."""
    if request.n is not None and request.n > MAX_CHOICES:
        raise HTTPError(
            400, f"n must be at most {MAX_CHOICES}, not {request.n}", param="n", code="invalid_request"
        )
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of > MAX_CHOICES:
        raise HTTPError(
            400,
            f"best_of must be at most {MAX_CHOICES}, not {best_of}",
            param="best_of",
            code="invalid_request",
        )


def _check_context(pipeline: ModelPipeline, request: AnyRequest) -> None:
    """max_tokens never above the model's context; pipelines that tokenize also count the prompt."""
    ctx = pipeline.card.context_length
    max_tokens = requested_max_tokens(request)
    if ctx and max_tokens is not None and max_tokens > ctx:
        param = "max_tokens" if request.max_tokens == max_tokens else "max_completion_tokens"
        raise HTTPError(
            400,
            f"This model's maximum context length is {ctx} tokens, but {param} is {max_tokens}",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
