"""Disaggregated prefill/decode in the frontend: a request's prompt on a prefill worker, the rest on
a decode worker that continues from the prompt's KV cache.

`DisaggRouter` sits where a model's router sits (migration wraps it, as it wraps any router) and
holds two pools, each behind its own router (kv-aware when the frontend routes by KV, so a
repeated prefix goes back to the prefill worker that holds it): the decode pool (decode workers,
or aggregated ones) and, once a prefill worker has registered, the prefill pool. Per request:

1. No prefill worker up, or (with conditional disaggregation) fewer uncached prompt tokens than
   `max_local_prefill_length` by the decode pool's cache: the decode pool serves the whole
   request (local prefill). With `enforce`, local prefill is refused instead: 503.
2. Otherwise the request goes to a prefill worker, which computes the prompt and answers with
   the first token and `kv_transfer_params` (where the prompt's KV waits). The first token is
   passed on at once — the client's time to first token is the prefill's.
3. The continuation (prompt + first token, max_tokens one less, as migration builds it) goes to
   the decode pool with those parameters; the decode worker fetches the KV from the prefill
   worker itself and generates the rest. Its first chunk says how the import went
   (`kv_import`), which is counted and not passed on.

A prefill that fails (the worker died, was overloaded or unreachable) is not the request's end:
the next prefill worker is tried under `enforce`, else the decode pool prefills locally. A
decode worker that fails mid-stream is migration's business: the tokens so far go back through
this router, prefill included. Everything counted goes to `DisaggHooks` (the frontend's metrics).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import msgspec

from dynamo_graph.llm.protocol import KvImportReport, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.router.config import DisaggConfig
from dynamo_graph.router.migration import RoutedBackend, continuation
from dynamo_graph.runtime.client import NoInstances
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import InvalidArgument, RequestError

log = logging.getLogger(__name__)


class NoPrefillWorkers(NoInstances):
    """--enforce-disagg and no prefill worker could take the request (503)."""

    code = "no_prefill_workers"


class DisaggHooks(Protocol):
    def prefill(self, model: str, where: str, reason: str) -> None:
        """One request prefilled `where` ("remote" | "local"), for `reason`."""

    def kv_import(self, model: str, report: KvImportReport) -> None:
        """A decode worker's account of one KV transfer."""


# Uncached prompt tokens on the decode pool's best worker; None: not known (no KV routing there).
UncachedTokens = Callable[[PreprocessedRequest, list[int]], int | None]


class DisaggRouter:
    """`generate(request, context, exclude=...)` and `instance_ids()`, as any routed backend."""

    def __init__(
        self,
        decode: RoutedBackend,
        config: DisaggConfig | None = None,
        *,
        model: str = "",
        hooks: DisaggHooks | None = None,
        decode_uncached: UncachedTokens | None = None,
    ) -> None:
        self.decode = decode
        self.config = config or DisaggConfig()
        self.model = model
        self.hooks = hooks
        self.decode_uncached = decode_uncached
        # Set when the model's first prefill worker registers; its instances come and go.
        self.prefill: RoutedBackend | None = None

    def instance_ids(self) -> list[int]:
        """The decode pool's: it is what must be up for a request to be served at all."""
        return self.decode.instance_ids()

    async def generate(
        self, request: PreprocessedRequest, context: Context, *, exclude: set[int] | None = None
    ) -> AsyncIterator[LLMEngineOutput]:
        reason = self._local_reason(request, exclude)
        first: LLMEngineOutput | None = None
        if reason is None:
            first, reason = await self._remote_prefill(request, context, exclude)
        if first is None:
            self._count("local", reason)
            async for out in self.decode.generate(request, context, exclude=exclude):
                yield out
            return
        self._count("remote", "prefill_worker")
        params = first.kv_transfer_params
        if params is None:  # the request ended at its first token
            yield first
            return
        first.kv_transfer_params = None
        first.finish_reason = None
        first.completion_usage = None
        yield first
        follow = continuation(request, first.token_ids)
        follow.kv_transfer_params = params
        async for out in self.decode.generate(follow, context, exclude=exclude):
            if out.kv_import is not None:
                if self.hooks is not None:
                    self.hooks.kv_import(self.model, out.kv_import)
                out.kv_import = None
            out.cached_tokens = None  # the prefill worker's prefix hit is the request's
            yield out

    def _local_reason(self, request: PreprocessedRequest, exclude: set[int] | None) -> str | None:
        """Why this request is prefilled by the decode pool, or None to prefill remotely."""
        if not self._prefill_instances(exclude):
            if self.config.enforce:
                raise NoPrefillWorkers(f"no prefill worker of {self.model!r} is up (--enforce-disagg)")
            return "no_prefill_worker"
        if self.config.conditional and not self.config.enforce:
            uncached = None
            if self.decode_uncached is not None:
                uncached = self.decode_uncached(request, self.decode.instance_ids())
            if uncached is None:
                uncached = len(request.token_ids)
            if uncached < self.config.max_local_prefill_length:
                return "short_prompt"
        return None

    def _prefill_instances(self, exclude: set[int] | None) -> list[int]:
        if self.prefill is None:
            return []
        return [i for i in self.prefill.instance_ids() if not exclude or i not in exclude]

    async def _remote_prefill(
        self, request: PreprocessedRequest, context: Context, exclude: set[int] | None
    ) -> tuple[LLMEngineOutput | None, str]:
        """The prefill worker's answer, or (None, why) when it must be done locally. Under
        `enforce` every prefill worker is tried before giving up with the last error."""
        assert self.prefill is not None
        failed: set[int] = set(exclude or ())
        while True:
            try:
                return await self._prefill_once(request, context, failed), "prefill_worker"
            except InvalidArgument:
                raise  # the request itself is wrong: the decode pool would say the same
            except RequestError as err:
                if context.is_stopped():
                    raise
                instance = getattr(err, "instance_id", None)
                log.warning(
                    "request %s: prefill on %s failed (%s: %s)",
                    context.id,
                    "?" if instance is None else f"{instance:x}",
                    type(err).__name__,
                    err,
                )
                if not self.config.enforce:
                    return None, "prefill_failed"
                if instance is not None:
                    failed.add(instance)
                if instance is None or not self._prefill_instances(failed):
                    raise NoPrefillWorkers(
                        f"every prefill worker of {self.model!r} failed the request (--enforce-disagg): {err}"
                    ) from err

    async def _prefill_once(
        self, request: PreprocessedRequest, context: Context, exclude: set[int]
    ) -> LLMEngineOutput:
        assert self.prefill is not None
        stream = self.prefill.generate(request, context, exclude=exclude or None)
        answer: LLMEngineOutput | None = None
        try:
            async for out in stream:
                answer = out if answer is None else _merged(answer, out)
                if out.finish_reason is not None:
                    break
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if answer is None or not answer.token_ids:
            raise RequestError("the prefill worker answered without a first token")
        return answer

    def _count(self, where: str, reason: str) -> None:
        if self.hooks is not None:
            self.hooks.prefill(self.model, where, reason)


def _merged(a: LLMEngineOutput, b: LLMEngineOutput) -> LLMEngineOutput:
    """Two chunks of a prefill answer as one (an engine may send the token and the finish apart)."""
    return msgspec.structs.replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        cached_tokens=a.cached_tokens if a.cached_tokens is not None else b.cached_tokens,
    )
