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

Engines that pair the two halves of a request themselves (SGLang: its prefill engine sends the
KV and the first token to the decode engine that joins the same bootstrap room) publish the
prefill worker's bootstrap address in its card (`bootstrap_address`), and step 2 goes as Dynamo
does it with SGLang: the prefill pool's router picks a prefill worker, the frontend draws a room,
and the prompt goes to that worker and to the decode pool at once, both with the worker's
bootstrap host, port and the room (`BootstrapInfo`). The decode worker streams the whole answer;
the prefill worker's own stream is drained in the background.

A prefill that fails (the worker died, was overloaded or unreachable) is not the request's end:
the next prefill worker is tried under `enforce`, else the decode pool prefills locally. With
bootstrap rooms, a prefill that fails before the decode worker's first token abandons that decode
request too, and the pair is tried again with another prefill worker while one is left (a decode
engine of that kind cannot prefill locally), then as above. A decode worker that fails mid-stream
is migration's business: the tokens so far go back through this router, prefill included.
Everything counted goes to `DisaggHooks` (the frontend's metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import msgspec

from dynamo_graph.llm.protocol import BootstrapInfo, KvImportReport, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.router.config import DisaggConfig
from dynamo_graph.router.migration import RoutedBackend, continuation
from dynamo_graph.runtime import tracing
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
# Called with the instance a prefill pool routes a request to, just before it is sent there.
OnRoute = Callable[[int, PreprocessedRequest], None]


class PrefillPool(Protocol):
    """The prefill workers' router: a routed backend that can say where a request goes."""

    def generate(
        self, request: PreprocessedRequest, context: Context, **routing: Any
    ) -> AsyncIterator[LLMEngineOutput]:
        """As RoutedBackend's, whose `exclude` it takes, and `on_route`: an OnRoute called with
        the instance the request goes to and the request, just before it is sent there."""
        ...

    def instance_ids(self) -> list[int]: ...


def bootstrap_address(runtime_config: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """A prefill worker's bootstrap server, from its card's runtime_config (backend/worker.py)."""
    config = runtime_config or {}
    host, port = config.get("bootstrap_host"), config.get("bootstrap_port")
    return (str(host), int(port)) if host and port else None


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
        self.prefill: PrefillPool | None = None
        # Prefill instances -> their bootstrap servers (engines that pair by room), kept by the
        # model watcher from their cards.
        self.bootstraps: Mapping[int, tuple[str, int]] = {}
        self._prefills: set[asyncio.Task[None]] = set()  # paired prefills still draining

    def instance_ids(self) -> list[int]:
        """The decode pool's: it is what must be up for a request to be served at all."""
        return self.decode.instance_ids()

    def generate(
        self, request: PreprocessedRequest, context: Context, *, exclude: set[int] | None = None
    ) -> AsyncIterator[LLMEngineOutput]:
        """Where the model has no prefill pool at all (aggregated serving), the decode pool's
        stream as it is: no generator of ours on the per-token path."""
        if self.prefill is None and not self.config.enforce:
            self._local_prefill(context, "no_prefill_worker")
            return self.decode.generate(request, context, exclude=exclude)
        return self._routed(request, context, exclude)

    def _local_prefill(self, context: Context, reason: str) -> None:
        tracing.event(context, "local_prefill", {"disagg.reason": reason})
        self._count("local", reason)

    async def _routed(
        self, request: PreprocessedRequest, context: Context, exclude: set[int] | None
    ) -> AsyncIterator[LLMEngineOutput]:
        reason = self._local_reason(request, exclude)
        first: LLMEngineOutput | None = None
        if reason is None and self.bootstraps:
            paired = self._paired(request, context, exclude)
            try:
                async for out in paired:
                    yield out
                return
            except _PrefillFailed:
                reason = "prefill_failed"
            finally:
                await paired.aclose()
        elif reason is None:
            with tracing.span(
                "remote_prefill", context, {"llm.prompt_tokens": len(request.token_ids)}
            ) as span:
                first, reason = await self._remote_prefill(request, context, exclude)
                span.set("disagg.outcome", reason)
        if first is None:
            self._local_prefill(context, reason)
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

    async def _paired(
        self, request: PreprocessedRequest, context: Context, exclude: set[int] | None
    ) -> AsyncIterator[LLMEngineOutput]:
        """The request on a prefill and a decode worker at once, paired by a bootstrap room; a
        prefill that fails before the decode's first output is tried on the next prefill worker
        (`_PrefillFailed` once none is left and not `enforce`: the caller prefills locally)."""
        failed: set[int] = set(exclude or ())
        while True:
            try:
                first, decode, prefill = await self._pair_once(request, context, failed, exclude)
            except _PrefillError as failure:
                err, instance = failure.error, failure.instance
                if isinstance(err, InvalidArgument) or context.is_stopped():
                    raise err from None
                log.warning("request %s: paired prefill failed (%s: %s)", context.id, type(err).__name__, err)
                if instance is not None:
                    failed.add(instance)
                if instance is None or not self._prefill_instances(failed):
                    if self.config.enforce:
                        raise NoPrefillWorkers(
                            f"every prefill worker of {self.model!r} failed the request "
                            f"(--enforce-disagg): {err}"
                        ) from err
                    raise _PrefillFailed from err
                continue
            break
        self._count("remote", "prefill_worker")
        ended = False
        try:
            if first is not None:
                yield first
                async for out in decode:
                    yield out
            ended = True
        finally:
            if not ended:  # the decode failed or the caller left: the prefill goes too
                prefill.cancel()
            self._prefills.add(prefill)
            prefill.add_done_callback(self._prefill_done)
            await decode.aclose()  # type: ignore[attr-defined]

    def _prefill_done(self, task: asyncio.Task[None]) -> None:
        self._prefills.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a paired prefill failed after its decode had started: %s", task.exception())

    async def _pair_once(
        self, request: PreprocessedRequest, context: Context, failed: set[int], exclude: set[int] | None
    ) -> tuple[LLMEngineOutput | None, AsyncIterator[LLMEngineOutput], asyncio.Task[None]]:
        """One pairing: the decode worker's first output (None: it ended without one), its
        stream, and the prefill's task. A prefill error before that first output is raised as
        `_PrefillError` and the decode request abandoned; a decode error is raised as it is."""
        assert self.prefill is not None
        room = secrets.randbits(63)
        routed: asyncio.Future[tuple[int, BootstrapInfo]] = asyncio.get_running_loop().create_future()

        def on_route(instance_id: int, sent: PreprocessedRequest) -> None:
            if routed.done():  # the paired worker was unreachable: the pair cannot change now
                err = RequestError(f"prefill worker {routed.result()[0]:x} could not be reached")
                err.instance_id = routed.result()[0]  # type: ignore[attr-defined]
                raise err
            address = self.bootstraps.get(instance_id)
            if address is None:
                raise RequestError(f"prefill worker {instance_id:x} published no bootstrap address")
            sent.bootstrap_info = BootstrapInfo(host=address[0], port=address[1], room=room)
            routed.set_result((instance_id, sent.bootstrap_info))

        # The prompt alone and one token: SGLang sends that token on with the KV.
        stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
        half = msgspec.structs.replace(request, stop_conditions=stop)
        prefill = asyncio.create_task(self._drain(half, context, failed, on_route))
        decode: AsyncIterator[LLMEngineOutput] | None = None
        first: asyncio.Future[LLMEngineOutput] | None = None
        try:
            await asyncio.wait({routed, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not routed.done():  # sent nowhere: why
                raise _PrefillError.of(prefill.exception(), None)
            instance, info = routed.result()
            decode = self.decode.generate(
                msgspec.structs.replace(request, bootstrap_info=info), context, exclude=exclude
            )
            first = asyncio.ensure_future(anext(decode))
            await asyncio.wait({first, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and prefill.exception() is not None:
                raise _PrefillError.of(prefill.exception(), instance)
            try:
                return await first, decode, prefill
            except StopAsyncIteration:
                return None, decode, prefill
        except BaseException:
            prefill.cancel()
            if first is not None and not first.done():
                first.cancel()  # the decode waits for KV that will not come
                with contextlib.suppress(BaseException):
                    await first
            if decode is not None:
                await decode.aclose()  # type: ignore[attr-defined]
            raise

    async def _drain(
        self, request: PreprocessedRequest, context: Context, failed: set[int], on_route: OnRoute
    ) -> None:
        """The prefill worker's half of a paired request: its answer is the decode worker's."""
        assert self.prefill is not None
        stream = self.prefill.generate(request, context, exclude=failed or None, on_route=on_route)
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

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


class _PrefillFailed(Exception):
    """Every paired prefill failed: prefill locally."""


class _PrefillError(Exception):
    """A paired prefill failed before its decode's first output (on `instance`, when known)."""

    def __init__(self, error: RequestError, instance: int | None) -> None:
        super().__init__(str(error))
        self.error, self.instance = error, instance

    @classmethod
    def of(cls, error: BaseException | None, instance: int | None) -> _PrefillError:
        """A request-plane error as such (tagged with the instance it came from, if any); any
        other error is a bug and goes on as it is."""
        if error is None:
            error = RequestError("the prefill pool routed the request nowhere")
        if not isinstance(error, RequestError):
            raise error
        return cls(error, getattr(error, "instance_id", None) or instance)


def _merged(a: LLMEngineOutput, b: LLMEngineOutput) -> LLMEngineOutput:
    """Two chunks of a prefill answer as one (an engine may send the token and the finish apart)."""
    return msgspec.structs.replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        cached_tokens=a.cached_tokens if a.cached_tokens is not None else b.cached_tokens,
    )
