"""Backends that live in other processes, reached through a runtime `Client`.

Tokens-input (Backend-type) workers speak the engine wire types directly. Text-input
(Chat/Completion-type) workers take the OpenAI request and stream OpenAI chunks, which are
turned back into engine outputs so the same pipeline code serves both.

The tokens backends are routers (round-robin / random through the client's picker, or the KV
router) that can leave instances out (`exclude`): request migration (router/migration.py) wraps
them and re-sends a broken stream's continuation with the failed instances excluded. Text-input
models are not migrated: their streams are text, whose tokens the frontend never sees. Both send
through `send_tokens`, which leaves out what only the frontend's router reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.llm.protocol import (
    CompletionUsage,
    EmbeddingOutput,
    LLMEngineOutput,
    PreprocessedEmbeddingRequest,
    PreprocessedRequest,
)
from dynamo_graph.router.disagg import OnRoute
from dynamo_graph.router.migration import MIGRATABLE, MigrationHook, failed_instance
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.client import Client, NoInstances, PickHook
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError
from dynamo_graph.runtime.transport.base import CannotConnect

if TYPE_CHECKING:
    from dynamo_graph.router.decisions import PoolDecisions
    from dynamo_graph.router.kv.cost import Choice
    from dynamo_graph.router.kv.router import KvRouter

log = logging.getLogger(__name__)


def send_tokens(
    client: Client,
    request: PreprocessedRequest,
    context: Context,
    *,
    instance_id: int | None = None,
    exclude: set[int] | None = None,
    on_pick: PickHook | None = None,
) -> AsyncIterator[LLMEngineOutput]:
    """A tokens request to a worker. The routing hints' `prefixes` (keys of cached prompt
    segments, for the frontend's block hashing) stay here: no engine reads them, and a long
    chat carries one per cached segment. Session and priority go on (engines schedule by the
    priority). The request itself keeps them: migration and disaggregation route it again."""
    hints = request.routing
    if hints is not None and hints.prefixes is not None:
        request = msgspec.structs.replace(request, routing=msgspec.structs.replace(hints, prefixes=None))
    return client.generate(
        request,
        instance_id=instance_id,
        context=context,
        response_type=LLMEngineOutput,
        exclude=exclude,
        on_pick=on_pick,
        units_sent=len(request.token_ids),
        units_of=_tokens_of,
    )


def _tokens_of(output: LLMEngineOutput) -> int:
    """The work one response of a worker carries, for the autoscaler: its tokens."""
    return len(output.token_ids)


class RemoteTokensBackend:
    """Tokens-input workers chosen by the client's picker (round-robin, random); `decisions`:
    where its choices are logged."""

    def __init__(self, client: Client, decisions: PoolDecisions | None = None) -> None:
        self.client = client
        self.decisions = decisions

    def generate(
        self,
        request: PreprocessedRequest,
        context: Context,
        *,
        exclude: set[int] | None = None,
        on_route: OnRoute | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """`on_route(instance, request)` hears where the request goes before it is sent (a
        paired prefill's bootstrap address, router/disagg.py); the instance is the picker's."""
        hook = None if self.decisions is None else self.decisions.picked(context, request, exclude)
        if on_route is None:
            return send_tokens(self.client, request, context, exclude=exclude, on_pick=hook)
        instance = self.client.pick(exclude, on_pick=hook)
        on_route(instance, request)
        return send_tokens(self.client, request, context, instance_id=instance)

    def instance_ids(self) -> list[int]:
        return self.client.instance_ids()


class KvRoutedTokensBackend:
    """Tokens-input workers chosen by the KV router: the request goes to the rank whose cache
    and load make it cheapest, and the router hears when its first token and its end arrive.
    A worker that cannot be reached is left out and the request routed again (nothing was
    generated yet, so that is always safe); so are the workers in `exclude` (those that failed a
    migrated request). The router's booking is released whenever a stream ends, failed or not,
    so a migrated request is booked afresh on the worker it moves to.

    With the router's queue on, a request first waits for its turn (`admit`: priority from its
    routing hints) while every worker is saturated, or is refused (`QueueFull`: 529) past the
    queue's bound; its session id (routing hints) lets session affinity pick its worker.
    `on_route(instance, request)` hears each worker chosen, just before the request goes there
    (a paired prefill's bootstrap address, router/disagg.py). `decisions`: where each choice is
    logged, with every candidate's cost terms."""

    def __init__(self, client: Client, router: KvRouter, decisions: PoolDecisions | None = None) -> None:
        self.client = client
        self.router = router
        self.decisions = decisions

    def instance_ids(self) -> list[int]:
        return self.client.instance_ids()

    async def generate(
        self,
        request: PreprocessedRequest,
        context: Context,
        *,
        exclude: set[int] | None = None,
        on_route: OnRoute | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        router = self.router
        request_id = context.id
        unreachable: set[int] = set(exclude) if exclude else set()
        hints = request.routing
        session = hints.session_id if hints is not None else None
        prefixes = hints.prefixes if hints is not None else None
        admitted = False
        decisions = self.decisions
        queue_wait: float | None = None
        if router.queue is not None:
            priority = hints.priority if hints is not None and hints.priority is not None else 0
            instance_ids = self.client.instance_ids()
            queued_at = time.monotonic()
            with tracing.span("router.queue", context, {"llm.priority": priority}):
                waited = await router.admit(
                    priority, context, instance_ids, request.token_ids, prefixes, request.cache_salt
                )
            if not waited:
                return  # the client went away while the request waited
            queue_wait = time.monotonic() - queued_at
            admitted = True
        while True:
            terms: list[dict[str, Any]] | None = None if decisions is None else []
            try:
                instances = self.client.candidates(unreachable)
                if not instances:
                    raise NoInstances(f"no instances of {self.client.name} are available")
                with tracing.span("route", context, {"router.mode": "kv"}) as routing:
                    choice = router.route(
                        request_id,
                        request.token_ids,
                        instances,
                        session_id=session,
                        prefixes=prefixes,
                        explain=terms,
                        salt=request.cache_salt,
                    )
                    _describe(routing, choice, len(instances))
            finally:
                if admitted:
                    admitted = False
                    router.dispatched()
            worker_id, request.dp_rank = choice.key
            if decisions is not None:
                assert terms is not None
                decisions.record(
                    context,
                    request,
                    terms,
                    worker_id,
                    request.dp_rank,
                    queue_wait_s=queue_wait,
                    excluded=unreachable,
                )
            started = False
            try:
                if on_route is not None:
                    on_route(worker_id, request)
                async for out in send_tokens(self.client, request, context, instance_id=worker_id):
                    if not started:
                        started = True
                        router.prefill_completed(request_id)
                    yield out
                return
            except CannotConnect:
                if started:
                    raise
                unreachable.add(worker_id)
            finally:
                router.free(request_id)


def _describe(span: tracing.Span | tracing.NoSpan, choice: Choice, candidates: int) -> None:
    """The KV router's decision as a route span's attributes."""
    if span is tracing.NO_SPAN:
        return
    worker_id, rank = choice.key
    span.set("router.candidates", candidates)
    span.set("router.worker.instance_id", f"{worker_id:x}")
    span.set("router.worker.dp_rank", rank)
    span.set("router.overlap_blocks", choice.overlap_blocks)
    span.set("router.prefill_tokens", choice.prefill_tokens)
    span.set("router.cost", choice.logit)


def _usage(raw: Any) -> CompletionUsage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    return CompletionUsage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=details.get("cached_tokens") if isinstance(details, dict) else None,
    )


def chunk_to_output(chunk: Any) -> LLMEngineOutput:
    """One OpenAI chat/completion chunk (or whole response) as an engine output."""
    if not isinstance(chunk, dict):
        return LLMEngineOutput(error=f"worker sent {type(chunk).__name__}, expected an OpenAI chunk object")
    choices = chunk.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    delta = choice.get("delta") or choice.get("message") or {}
    text = delta.get("content") if isinstance(delta, dict) else None
    if text is None:
        text = choice.get("text")
    return LLMEngineOutput(
        text=text or None,
        finish_reason=choice.get("finish_reason"),
        completion_usage=_usage(chunk.get("usage")),
    )


class RemoteTextBackend:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def generate(self, request: AnyRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        # OpenAI streams may send usage in a chunk after the finish reason: hold the finish back
        # until the stream ends so the usage can ride on it.
        final: LLMEngineOutput | None = None
        async for chunk in self.client.generate(request, context=context):
            out = chunk_to_output(chunk)
            if final is not None:
                final.completion_usage = out.completion_usage or final.completion_usage
                continue
            if out.finish_reason is not None:
                final = out
                continue
            if out.text or out.error:
                yield out
        if final is not None:
            yield final


class RemoteEmbedder:
    """Embedding workers, round-robin (or random) through the client's picker. A request whose
    worker went away is sent again to another one, up to `migration_limit` times: embedding is
    idempotent, so unlike a broken generation nothing needs carrying over."""

    def __init__(
        self,
        client: Client,
        migration_limit: int,
        *,
        model: str = "",
        on_migrate: MigrationHook | None = None,
    ) -> None:
        self.client = client
        self.migration_limit = max(int(migration_limit), 0)
        self.model = model
        self.on_migrate = on_migrate

    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        exclude: set[int] = set()
        retries = self.migration_limit
        while True:
            try:
                async for out in self.client.generate(
                    request, context=context, response_type=EmbeddingOutput, exclude=exclude or None
                ):
                    return out
                raise RequestError("the embedding worker ended its stream without an answer")
            except MIGRATABLE as err:
                if retries <= 0 or context.is_stopped():
                    raise
                retries -= 1
                failed = failed_instance(err)
                if failed is not None:
                    exclude.add(failed)
                log.warning(
                    "embedding request %s: %s from instance %s; sending it to another (%d retries left)",
                    context.id,
                    type(err).__name__,
                    "?" if failed is None else f"{failed:x}",
                    retries,
                )
                if self.on_migrate is not None:
                    self.on_migrate(self.model, "new_request")
