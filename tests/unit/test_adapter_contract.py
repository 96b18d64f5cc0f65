"""The contract every engine-library adapter keeps (engines/library.py), one suite for all of them.

Each adapter (vLLM, SGLang, TensorRT-LLM) gets a fake library that plays the same script in the
library's own shapes (vLLM's DELTA `RequestOutput`s, SGLang's `{"output_ids", "meta_info"}` dicts,
TensorRT-LLM's cumulative `RequestOutput`), and the same edge cases must come out the same. No
sockets and no processes: the engines are built with their library handle set to the fake.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import LLMEngineOutput
from dynamo_graph.engines.library import LibraryEngine
from dynamo_graph.engines.sglang.engine import SglangEngine
from dynamo_graph.engines.trtllm.engine import TrtllmEngine
from dynamo_graph.engines.vllm.engine import VllmEngine
from dynamo_graph.runtime.context import Context
from tests.support.engine_adapters import collect, request, tokens

PROMPT_LEN = 4  # engine_adapters.request's prompt


@dataclass
class Script:
    """What the fake library does with the next request: stream `chunks` of ids (with `cached`
    prompt tokens reported), then end with `reason` (None: no finish reason), or raise `error`."""

    chunks: list[list[int]] = field(default_factory=lambda: [[100], [101], [102]])
    reason: str | None = "length"
    cached: int | None = None
    error: BaseException | None = None
    delay: float = 0.0
    calls: int = 0
    aborted: list[str] = field(default_factory=list)


async def play(script: Script, rid: str, emit: Callable[..., Any], cancel_reason: Any) -> AsyncIterator[Any]:
    """The script as (new ids, all ids, reason, finished) outputs, built by `emit`."""
    script.calls += 1
    sent: list[int] = []
    for i, chunk in enumerate(script.chunks):
        await asyncio.sleep(script.delay)
        if rid in script.aborted:
            yield emit([], sent, cancel_reason, True, script.cached)
            return
        if script.error is not None:
            raise script.error
        sent = sent + chunk
        last = i == len(script.chunks) - 1
        reason = script.reason if last else None
        yield emit(chunk, sent, reason, last and reason is not None, script.cached)


# ---- the fake libraries, each in its own shapes -------------------------------------------------


class FakeVllm:
    def __init__(self, script: Script) -> None:
        self.script = script

    def generate(self, prompt: Any, params: Any, rid: str, **_: Any) -> AsyncIterator[Any]:
        def emit(new: list[int], _all: list[int], reason: Any, finished: bool, cached: int | None) -> Any:
            out = SimpleNamespace(token_ids=new, finish_reason=reason, logprobs=None)
            return SimpleNamespace(outputs=[out], finished=finished, num_cached_tokens=cached)

        return play(self.script, rid, emit, "abort")

    async def abort(self, rid: str) -> None:
        self.script.aborted.append(rid)


class FakeSglang:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.tokenizer_manager = self

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.script.aborted.append(rid)

    async def async_generate(self, *, input_ids: list[int], rid: str, **_: Any) -> AsyncIterator[Any]:
        def emit(new: list[int], _all: list[int], reason: Any, finished: bool, cached: int | None) -> Any:
            finish = None if reason is None else {"type": reason}
            return {"output_ids": new, "meta_info": {"finish_reason": finish, "cached_tokens": cached}}

        return play(self.script, rid, emit, "abort")


class FakeTrtllmResult:
    """TensorRT-LLM's RequestOutput: iterated for its updates, aborted through itself."""

    def __init__(self, script: Script, rid: str) -> None:
        self.script, self.rid = script, rid

        def emit(_new: list[int], every: list[int], reason: Any, finished: bool, cached: int | None) -> Any:
            out = SimpleNamespace(token_ids=list(every), finish_reason=reason)
            return SimpleNamespace(outputs=[out], finished=finished, cached_tokens=cached)

        self._stream = play(script, rid, emit, "cancelled")

    def abort(self) -> None:
        self.script.aborted.append(self.rid)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._stream


class FakeTrtllm:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0

    def generate_async(self, **_: Any) -> FakeTrtllmResult:
        self.requests += 1
        return FakeTrtllmResult(self.script, f"trt-{self.requests}")


def _vllm(script: Script) -> LibraryEngine:
    engine = VllmEngine({"model": "/m"})
    engine._llm = FakeVllm(script)
    engine._vllm = {
        "SamplingParams": dict,
        "DELTA": "delta",
        "TokensPrompt": dict,
        "StructuredOutputsParams": dict,
    }
    return engine


def _sglang(script: Script) -> LibraryEngine:
    engine = SglangEngine({"model_path": "/m"})
    engine._backend = FakeSglang(script)
    engine.incremental = True
    return engine


def _trtllm(script: Script) -> LibraryEngine:
    engine = TrtllmEngine({"model": "/m"})
    engine._backend = FakeTrtllm(script)
    engine._make_sampling_params = dict  # type: ignore[method-assign]
    return engine


ADAPTERS = {"vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm}


@pytest.fixture(params=sorted(ADAPTERS))
def make(request: pytest.FixtureRequest) -> Callable[[Script], LibraryEngine]:
    return ADAPTERS[request.param]


def _last(outs: list[LLMEngineOutput]) -> LLMEngineOutput:
    assert outs and all(out.finish_reason is None for out in outs[:-1])
    return outs[-1]


# ---- the contract --------------------------------------------------------------------------------


async def test_a_finished_stream(make: Callable[[Script], LibraryEngine]) -> None:
    script = Script(cached=2)
    outs = await collect(make(script), request(3))
    assert tokens(outs) == [100, 101, 102] and _last(outs).finish_reason == "length"
    assert outs[0].cached_tokens == 2 and all(out.cached_tokens is None for out in outs[1:])
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        4,
        3,
        2,
    )


async def test_cached_tokens_are_capped_at_the_prompt(make: Callable[[Script], LibraryEngine]) -> None:
    outs = await collect(make(Script(cached=99)), request(3))
    usage = outs[-1].completion_usage
    assert outs[0].cached_tokens == PROMPT_LEN and usage is not None and usage.cached_tokens == PROMPT_LEN


async def test_a_stream_without_a_finish_reason_is_an_error(make: Callable[[Script], LibraryEngine]) -> None:
    outs = await collect(make(Script(reason=None)), request(3))
    last = _last(outs)
    assert tokens(outs) == [100, 101, 102]
    assert (
        last.finish_reason == "error" and last.error is not None and "without a finish reason" in last.error
    )


async def test_an_unknown_finish_reason_is_stop_with_a_warning(
    make: Callable[[Script], LibraryEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = make(Script(reason=f"odd-{id(make)}"))
    with caplog.at_level(logging.WARNING):
        outs = await collect(engine, request(3))
    assert _last(outs).finish_reason == "stop"
    assert f"odd-{id(make)}" in caplog.text


async def test_a_client_error_of_the_library_is_invalid_argument(
    make: Callable[[Script], LibraryEngine],
) -> None:
    with pytest.raises(InvalidArgument, match="refused the request"):
        await collect(make(Script(error=ValueError("prompt too long"))), request(3))


async def test_stopped_before_it_starts(make: Callable[[Script], LibraryEngine]) -> None:
    script = Script()
    ctx = Context()
    ctx.stop_generating()
    outs = await collect(make(script), request(3), ctx)
    assert [out.finish_reason for out in outs] == ["cancelled"] and script.calls == 0


async def test_a_cancelled_request_is_aborted_in_the_library(make: Callable[[Script], LibraryEngine]) -> None:
    script = Script(chunks=[[100 + i] for i in range(100)], delay=0.005)
    engine = make(script)
    ctx = Context("stop-me")
    outs = []
    async for out in engine.generate(request(100), ctx):
        outs.append(out)
        if len(outs) == 2:
            ctx.stop_generating()
    assert _last(outs).finish_reason == "cancelled" and len(tokens(outs)) < 100
    assert len(script.aborted) == 1
    await engine.drain()


async def test_a_consumer_that_leaves_aborts_in_the_library(make: Callable[[Script], LibraryEngine]) -> None:
    script = Script(chunks=[[100 + i] for i in range(100)], delay=0.005)
    engine = make(script)
    stream = engine.generate(request(100), Context("gone"))
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    assert len(script.aborted) == 1
    await engine.drain()


async def test_abort_by_context_and_cleanup(make: Callable[[Script], LibraryEngine]) -> None:
    script = Script(chunks=[[100 + i] for i in range(100)], delay=0.005)
    engine = make(script)
    ctx = Context("hooked")
    stream = engine.generate(request(100), ctx)
    await stream.__anext__()
    await engine.abort(ctx)
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "cancelled" and len(script.aborted) == 1
    await engine.cleanup()
    await engine.cleanup()  # idempotent
    with pytest.raises(Exception, match="shut down"):
        await collect(engine, request(3))
