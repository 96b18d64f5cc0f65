"""Request migration: a stream that breaks because its worker went away continues on another.

An operator between the pre/post-processing and the router (docs/contracts.md, "Migration"; Dynamo's
`Migration` in lib/llm/src/migration.rs). It works on token ids
(`PreprocessedRequest` in, `LLMEngineOutput` out), so only Tokens-input models migrate: a
Text-input worker's stream is OpenAI text whose exact tokens the frontend never sees, so it
cannot be resumed (Dynamo migrates tokens only, too).

Per request it keeps the request as it must be re-sent, the token ids generated so far, the
instances that failed it and the retries left (`migration_limit`; 0 turns migration off and
costs nothing). When the stream fails with a migratable error it is re-sent through the router
with the generated tokens appended to the prompt, max_tokens (and min_tokens) reduced by as
many, and every failed instance excluded; the consumer sees one continuous stream.

- Migratable: `StreamBroken` (the worker died or the connection was lost mid-stream),
  `CannotConnect` (it vanished before the stream opened), `ShuttingDown` (its grace period
  ended). Never: cancellation (the request's Context is stopped), or any other error.
- Never migrated: guided decoding (the grammar's state cannot be replayed as a prompt).
- Past the limit the last error propagates, so the frontend answers it as usual: a 503 with an
  OpenAI error body before the first byte, an error event in the SSE stream after it.
- Usage stays the original request's: the pipeline counts prompt tokens before the first
  attempt and completion tokens across attempts; `cached_tokens` is kept from the first attempt
  only (a continuation's prefix hit counts the migrated request's own output).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import msgspec

from dynamo_graph.llm.protocol import LLMEngineOutput, PreprocessedRequest, SamplingOptions
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.client import NoInstances
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError, ShuttingDown
from dynamo_graph.runtime.transport.base import CannotConnect, StreamBroken

log = logging.getLogger(__name__)

MIGRATABLE: tuple[type[RequestError], ...] = (StreamBroken, CannotConnect, ShuttingDown)
# How long a migration waits for an instance to route to (e.g. every worker restarting).
WAIT_FOR_INSTANCE_S = 10.0
# When only excluded instances are left, how long to wait for another before trying them again.
EXCLUDED_ONLY_WAIT_S = 1.0
_POLL_S = 0.05


class RoutedBackend(Protocol):
    """What migration wraps: a router over instances that can leave some out."""

    def generate(
        self, request: PreprocessedRequest, context: Context, *, exclude: set[int] | None = None
    ) -> AsyncIterator[LLMEngineOutput]: ...

    def instance_ids(self) -> list[int]: ...


def failed_instance(err: BaseException) -> int | None:
    """The instance a stream error came from (the runtime client tags what it raises)."""
    return getattr(err, "instance_id", None)


def is_guided(options: SamplingOptions) -> bool:
    return (
        options.guided_json is not None
        or options.guided_regex is not None
        or bool(options.guided_choice)
        or options.guided_grammar is not None
    )


def continuation(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request to send to the next instance: prompt + generated tokens, limits reduced.
    A copy: the original request (its prompt and limits) is what the pipeline reports."""
    n = len(generated)
    sc = request.stop_conditions
    stop = msgspec.structs.replace(
        sc,
        max_tokens=None if sc.max_tokens is None else max(sc.max_tokens - n, 0),
        min_tokens=None if sc.min_tokens is None else max(sc.min_tokens - n, 0),
    )
    return msgspec.structs.replace(
        request, token_ids=[*request.token_ids, *generated], stop_conditions=stop, dp_rank=None
    )


def _exhausted(err: RequestError, limit: int) -> RequestError:
    """The last error, saying that migration gave up (same type: same code and HTTP status)."""
    exhausted = type(err)(f"{err.message} (migration limit of {limit} reached)", param=err.param)
    exhausted.instance_id = failed_instance(err)  # type: ignore[attr-defined]
    return exhausted


MigrationHook = Callable[[str, str], None]
"""Called as (model, "new_request" | "ongoing_request") on each migration."""


class Migration:
    """Wraps a `RoutedBackend`; `generate(request, context)` as any pipeline backend."""

    def __init__(
        self,
        inner: RoutedBackend,
        migration_limit: int,
        *,
        model: str = "",
        on_migrate: MigrationHook | None = None,
    ) -> None:
        self.inner = inner
        self.migration_limit = max(int(migration_limit), 0)
        self.model = model
        self.on_migrate = on_migrate

    def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        if self.migration_limit <= 0 or is_guided(request.sampling_options):
            return self.inner.generate(request, context)
        return self._migrating(request, context)

    async def _migrating(
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        original = request
        retries_left = self.migration_limit
        generated: list[int] = []
        exclude: set[int] = set()
        attempt = 0
        no_route_since: float | None = None
        while True:
            stream = self.inner.generate(request, context, exclude=exclude or None)
            try:
                async for out in stream:
                    if attempt:
                        out.cached_tokens = None  # usage keeps the first attempt's prefix hit
                    if out.token_ids and retries_left:
                        generated.extend(out.token_ids)
                    yield out
                    if out.finish_reason is not None:
                        return
                return
            except MIGRATABLE as err:
                if context.is_stopped():
                    raise
                if retries_left <= 0:
                    raise _exhausted(err, self.migration_limit) from err
                failed = failed_instance(err)
                if failed is not None:
                    exclude.add(failed)
                kind = "ongoing_request" if generated else "new_request"
                retries_left -= 1
                attempt += 1
                context.migrations = attempt
                log.warning(
                    "request %s: %s from instance %s after %d tokens; migrating (%d retries left)",
                    context.id,
                    type(err).__name__,
                    "?" if failed is None else f"{failed:x}",
                    len(generated),
                    retries_left,
                )
                tracing.event(
                    context,
                    "migration",
                    {
                        "migration.kind": kind,
                        "migration.failed_instance": "" if failed is None else f"{failed:x}",
                        "migration.tokens_generated": len(generated),
                        "migration.retries_left": retries_left,
                    },
                )
                if self.on_migrate is not None:
                    self.on_migrate(self.model, kind)
            except NoInstances:
                # A continuation found every instance gone or unreachable (e.g. all restarting):
                # wait for one, within WAIT_FOR_INSTANCE_S, without spending a retry.
                if not attempt or context.is_stopped():
                    raise
                now = asyncio.get_running_loop().time()
                no_route_since = no_route_since or now
                if now - no_route_since >= WAIT_FOR_INSTANCE_S:
                    raise
                await asyncio.sleep(_POLL_S * 4)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            max_tokens = original.stop_conditions.max_tokens
            if max_tokens is not None and len(generated) >= max_tokens:
                # Everything asked for arrived; only the finish was lost with the worker.
                yield LLMEngineOutput(finish_reason="length")
                return
            request = continuation(original, generated)
            if not await self._wait_for_instance(exclude, context):
                if context.is_stopped():
                    return
                exclude.clear()  # only instances that failed us are left: try them again

    async def _wait_for_instance(self, exclude: set[int], context: Context) -> bool:
        """Wait until an instance outside `exclude` can be routed to; False when only excluded
        ones remained for EXCLUDED_ONLY_WAIT_S (or nothing for WAIT_FOR_INSTANCE_S), or the
        request was cancelled."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not context.is_stopped():
            ids = self.inner.instance_ids()
            if any(i not in exclude for i in ids):
                return True
            waited = loop.time() - start
            if (ids and waited >= EXCLUDED_ONLY_WAIT_S) or waited >= WAIT_FOR_INSTANCE_S:
                return False
            await asyncio.sleep(_POLL_S)
        return False
