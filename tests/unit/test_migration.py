"""Request migration (router/migration.py) over a fake router: token accounting, the limit,
exclusions, what never migrates, and usage / finish reason through a real tokens pipeline."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.engine import LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.handlers import Closing, tokens_handler
from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
)
from dynamo_graph.frontend import metrics as metrics_module
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.frontend.remote import KvRoutedTokensBackend
from dynamo_graph.router import migration as migration_module
from dynamo_graph.router.migration import Migration, continuation
from dynamo_graph.runtime.client import NoInstances
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.transport.base import CannotConnect, StreamBroken
from tests.support.scripted_router import PROMPT, Attempt, FakeRouter
from tests.support.scripted_router import scripted_request as _request
from tests.support.scripted_router import tagged as _tagged
from tests.support.scripted_router import tokens as _tokens


async def _collect(backend: Any, request: PreprocessedRequest, context: Context | None = None) -> list:
    return [out async for out in backend.generate(request, context or Context())]


def test_a_broken_stream_continues_with_the_tokens_so_far_and_the_failed_instance_excluded() -> None:
    fake = FakeRouter(
        [
            Attempt(_tokens(100, 3), _tagged(StreamBroken("connection lost"), 1)),
            Attempt(_tokens(200, 4), _tagged(EngineShutdown("grace over"), 2)),
            Attempt(_tokens(300, 3, finish="length")),
        ]
    )
    seen: list[tuple[str, str]] = []
    op = Migration(fake, 3, model="m", on_migrate=lambda model, kind: seen.append((model, kind)))
    request = _request(max_tokens=10, min_tokens=5)
    outs = asyncio.run(_collect(op, request))

    ids = [t for out in outs for t in out.token_ids]
    assert ids == [100, 101, 102, 200, 201, 202, 203, 300, 301, 302]
    assert [out.finish_reason for out in outs if out.finish_reason] == ["length"]
    first, second, third = fake.calls
    assert first[0].token_ids == PROMPT and first[1] == set()
    assert second[0].token_ids == [*PROMPT, 100, 101, 102]
    assert second[0].stop_conditions.max_tokens == 7 and second[0].stop_conditions.min_tokens == 2
    assert second[1] == {1}
    assert third[0].token_ids == [*PROMPT, 100, 101, 102, 200, 201, 202, 203]
    assert third[0].stop_conditions.max_tokens == 3 and third[0].stop_conditions.min_tokens == 0
    assert third[1] == {1, 2}
    # The caller's request (whose prompt the pipeline reports in usage) is untouched.
    assert request.token_ids == PROMPT and request.stop_conditions.max_tokens == 10
    assert seen == [("m", "ongoing_request"), ("m", "ongoing_request")]
    assert fake.closed == 3


def test_a_failure_before_any_token_is_a_new_request_migration() -> None:
    fake = FakeRouter(
        [Attempt([], _tagged(CannotConnect("refused"), 7)), Attempt(_tokens(1, 2, finish="length"))]
    )
    seen: list[str] = []
    op = Migration(fake, 1, on_migrate=lambda _, kind: seen.append(kind))
    outs = asyncio.run(_collect(op, _request(max_tokens=2)))
    assert [t for o in outs for t in o.token_ids] == [1, 2]
    assert seen == ["new_request"]
    assert fake.calls[1][0].token_ids == PROMPT and fake.calls[1][1] == {7}


def test_past_the_limit_the_last_error_propagates_and_says_so() -> None:
    fake = FakeRouter([Attempt(_tokens(10 * i, 1), _tagged(StreamBroken("lost"), i)) for i in range(1, 4)])
    op = Migration(fake, 2)
    with pytest.raises(StreamBroken, match="migration limit of 2 reached") as caught:
        asyncio.run(_collect(op, _request()))
    assert len(fake.calls) == 3
    assert caught.value.http_status == 503 and caught.value.code == "disconnected"


def test_limit_zero_passes_the_inner_stream_through() -> None:
    fake = FakeRouter([Attempt(_tokens(1, 1), StreamBroken("lost"))])
    op = Migration(fake, 0)
    stream = op.generate(_request(), Context())
    assert type(stream).__name__ == "async_generator" and stream.ag_code is FakeRouter.generate.__code__
    with pytest.raises(StreamBroken, match=r"^lost$"):
        asyncio.run(_collect(op, _request()))
    assert len(fake.calls) == 1


def test_cancellation_never_migrates() -> None:
    context = Context()

    class Cancelling(FakeRouter):
        async def generate(self, request, context, *, exclude=None):  # type: ignore[no-untyped-def]
            async for out in super().generate(request, context, exclude=exclude):
                yield out
                context.stop_generating()

    fake = Cancelling([Attempt(_tokens(1, 2), _tagged(StreamBroken("lost"), 1)), Attempt(_tokens(5, 1))])
    with pytest.raises(StreamBroken):
        asyncio.run(_collect(Migration(fake, 3), _request(), context))
    assert len(fake.calls) == 1


@pytest.mark.parametrize("error", [EngineError("engine failed"), InvalidArgument("bad prompt")])
def test_other_errors_are_not_migrated(error: EngineError) -> None:
    fake = FakeRouter([Attempt(_tokens(1, 1), error), Attempt(_tokens(5, 1, finish="length"))])
    with pytest.raises(type(error)):
        asyncio.run(_collect(Migration(fake, 3), _request()))
    assert len(fake.calls) == 1


def test_guided_decoding_requests_are_not_migrated() -> None:
    fake = FakeRouter([Attempt(_tokens(1, 1), StreamBroken("lost")), Attempt(_tokens(5, 1))])
    with pytest.raises(StreamBroken):
        asyncio.run(_collect(Migration(fake, 3), _request(guided_json={"type": "object"})))
    assert len(fake.calls) == 1


def test_cached_tokens_come_from_the_first_attempt_only() -> None:
    first = _tokens(1, 2)
    first[0].cached_tokens = 16
    second = _tokens(5, 1, finish="length")
    second[0].cached_tokens = 32
    fake = FakeRouter([Attempt(first, StreamBroken("lost")), Attempt(second)])
    outs = asyncio.run(_collect(Migration(fake, 1), _request(max_tokens=3)))
    assert [o.cached_tokens for o in outs if o.cached_tokens is not None] == [16]


def test_all_tokens_received_but_the_finish_lost_ends_with_length() -> None:
    fake = FakeRouter([Attempt(_tokens(1, 3), StreamBroken("lost"))])
    outs = asyncio.run(_collect(Migration(fake, 1), _request(max_tokens=3)))
    assert outs[-1].finish_reason == "length" and len(fake.calls) == 1


def test_waits_for_an_instance_and_gives_up_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(migration_module, "WAIT_FOR_INSTANCE_S", 0.3)
    monkeypatch.setattr(migration_module, "EXCLUDED_ONLY_WAIT_S", 0.1)
    # Only the failed instance is left: after EXCLUDED_ONLY_WAIT_S it is tried again.
    fake = FakeRouter(
        [Attempt(_tokens(1, 1), _tagged(StreamBroken("lost"), 1)), Attempt(_tokens(2, 1, finish="length"))],
        instances=[1],
    )
    outs = asyncio.run(_collect(Migration(fake, 1), _request(max_tokens=2)))
    assert outs[-1].finish_reason == "length" and fake.calls[1][1] == set()

    # A continuation that finds no instance at all waits, then fails with NoInstances.
    class Empty(FakeRouter):
        async def generate(self, request, context, *, exclude=None):  # type: ignore[no-untyped-def]
            if self.calls:
                self.calls.append((request, set(exclude or ())))
                raise NoInstances("none")
            async for out in super().generate(request, context, exclude=exclude):
                yield out

    empty = Empty([Attempt(_tokens(1, 1), _tagged(StreamBroken("lost"), 1))], instances=[])
    loop_time = asyncio.new_event_loop()
    try:
        start = loop_time.time()
        with pytest.raises(NoInstances):
            loop_time.run_until_complete(_collect(Migration(empty, 2), _request()))
        assert loop_time.time() - start < 3.0
    finally:
        loop_time.close()


def test_continuation_copies() -> None:
    request = _request(max_tokens=4, min_tokens=None)
    request.dp_rank = 1
    cont = continuation(request, [9, 9, 9, 9, 9])
    assert cont.token_ids == [*PROMPT, 9, 9, 9, 9, 9]
    assert cont.stop_conditions.max_tokens == 0 and cont.stop_conditions.min_tokens is None
    assert cont.dp_rank is None and request.dp_rank == 1 and request.token_ids == PROMPT


def test_migrations_are_counted_per_model_in_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "MIGRATIONS", {})
    metrics_module.count_migration("m", "new_request")
    metrics_module.count_migration("m", "ongoing_request")
    metrics_module.count_migration("m", "ongoing_request")
    text = FrontendMetrics().render().decode()
    assert 'dynamo_frontend_model_migration_total{migration_type="ongoing_request",model="m"} 2.0' in text
    assert 'dynamo_frontend_model_migration_total{migration_type="new_request",model="m"} 1.0' in text


# ---- the kv router's part: exclusions and bookings -----------------------------------------


class FakeClient:
    name = "ns.comp.ep"

    def __init__(self, fail: dict[int, EngineError]) -> None:
        self.fail = fail
        self.sent: list[int] = []

    def instance_ids(self) -> list[int]:
        return [1, 2]

    def candidates(self, exclude: set[int] | None = None) -> list[int]:
        return [i for i in self.instance_ids() if not exclude or i not in exclude]

    async def generate(  # type: ignore[no-untyped-def]
        self,
        request,
        *,
        instance_id,
        context,
        response_type,
        exclude=None,
        on_pick=None,
        units_sent=0,
        units_of=None,
    ):
        self.sent.append(instance_id)
        yield LLMEngineOutput(token_ids=[42])
        if instance_id in self.fail:
            raise _tagged(self.fail[instance_id], instance_id)
        yield LLMEngineOutput(token_ids=[43], finish_reason="length")


class FakeKvRouter:
    queue = None  # no router queue: requests are routed at once

    def __init__(self) -> None:
        self.booked: dict[str, int] = {}
        self.routed: list[list[int]] = []

    def route(  # type: ignore[no-untyped-def]
        self,
        request_id: str,
        token_ids: list[int],
        instances: list[int],
        *,
        session_id=None,
        prefixes=None,
        explain=None,
        salt=None,
    ):
        self.routed.append(sorted(instances))
        assert request_id not in self.booked, "booked twice: the failed attempt was not freed"
        self.booked[request_id] = instances[0]

        class Choice:
            key = (instances[0], None)

        return Choice()

    def prefill_completed(self, request_id: str) -> None:
        pass

    def free(self, request_id: str) -> None:
        self.booked.pop(request_id, None)


def test_kv_routing_releases_the_booking_and_routes_around_the_failed_worker() -> None:
    client = FakeClient({1: StreamBroken("lost")})
    router = FakeKvRouter()
    op = Migration(KvRoutedTokensBackend(client, router), 2)  # type: ignore[arg-type]
    outs = asyncio.run(_collect(op, _request(max_tokens=3)))
    assert [t for o in outs for t in o.token_ids] == [42, 42, 43]
    assert client.sent == [1, 2]
    assert router.routed == [[1, 2], [2]]
    assert router.booked == {}


# ---- the worker's side: after the grace period, streams end with EngineShutdown ---------------


class EndlessEngine:
    abort = LLMEngine.abort  # the no-op default: no cancellation watcher

    async def generate(self, request, context):  # type: ignore[no-untyped-def]
        i = 0
        while True:
            i += 1
            yield LLMEngineOutput(token_ids=[i])
            await asyncio.sleep(0)


def test_a_closing_worker_ends_its_streams_with_engine_shutdown() -> None:
    closing = Closing()
    handler = tokens_handler(EndlessEngine(), closing)  # type: ignore[arg-type]

    async def main() -> int:
        n = 0
        with pytest.raises(EngineShutdown):
            async for _ in handler(_request(), Context()):
                n += 1
                if n == 5:
                    closing.ended = True
        return n

    assert asyncio.run(main()) == 5


# ---- through a real tokens pipeline: usage and finish reason --------------------------------


def test_the_client_sees_one_stream_with_the_original_usage(tiny_model: Path) -> None:
    from dynamo_graph.llm.card import ModelDeploymentCard
    from dynamo_graph.llm.model_source import resolve_model
    from dynamo_graph.llm.openai import CompletionRequest
    from dynamo_graph.llm.pipeline import tokens_pipeline

    model = resolve_model(str(tiny_model))
    card = ModelDeploymentCard.from_local_model(model)
    first = _tokens(300, 5)
    first[0].cached_tokens = 3
    fake = FakeRouter(
        [
            Attempt(first, _tagged(StreamBroken("lost"), 1)),
            Attempt(_tokens(310, 4), _tagged(EngineShutdown("bye"), 2)),
            Attempt(_tokens(320, 3, finish="length")),
        ]
    )
    pipeline = tokens_pipeline(card, model, Migration(fake, 3))
    request = msgspec.convert(
        {"model": card.display_name, "prompt": "hello there", "max_tokens": 12, "stream": True},
        CompletionRequest,
    )
    prepared = pipeline.prepare(request)
    prompt_tokens = prepared.prompt_tokens

    async def run() -> list:
        return [d async for d in pipeline.stream(prepared, Context())]

    deltas = asyncio.run(run())
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert deltas[-1].finish_reason == "length"
    assert prepared.completion_tokens == 12
    assert prepared.prompt_tokens == prompt_tokens == len(fake.calls[0][0].token_ids)
    assert len(fake.calls[2][0].token_ids) == prompt_tokens + 9
    assert prepared.cached_tokens == 3
