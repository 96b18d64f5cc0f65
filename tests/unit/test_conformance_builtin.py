"""The built-in engines (echo_core, echo_full, mocker) against the conformance kit, and the kit
itself against engines that break the contract on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamo_graph.backend.conformance import (
    CHECKS,
    ConformanceError,
    check_engine,
    conformance_tests,
)
from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, StopConditions
from dynamo_graph.engines.echo import EchoCoreEngine, EchoFullEngine
from dynamo_graph.engines.mocker.args import MockerArgs
from dynamo_graph.engines.mocker.engine import MockerEngine
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.runtime.context import Context


def token_request(max_tokens: int) -> PreprocessedRequest:
    # Long enough for echo_core to stream max_tokens ids (it echoes the prompt).
    return PreprocessedRequest(
        model="tiny",
        token_ids=[10 + i % 500 for i in range(max_tokens + 4)],
        stop_conditions=StopConditions(max_tokens=max_tokens),
    )


def chat_request(max_tokens: int) -> ChatCompletionRequest:
    return msgspec.convert(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "abcdefghij" * (max_tokens // 10 + 1)}],
            "max_tokens": max_tokens,
        },
        ChatCompletionRequest,
    )


BUILTIN = {
    "echo_core": (lambda: EchoCoreEngine(delay_s=0.002), token_request),
    "echo_full": (lambda: EchoFullEngine(delay_s=0.002), chat_request),
    "mocker": (lambda: MockerEngine(MockerArgs(speedup_ratio=20.0)), token_request),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("engine", sorted(BUILTIN))
async def test_builtin_engine_conforms(engine: str, check: str) -> None:
    make_engine, make_request = BUILTIN[engine]
    report = await check_engine(make_engine, make_request, only=[check])
    assert report.passed == [check]


# The pytest wrapper, as an engine's own test module would use it.
test_echo_core_wrapper = conformance_tests(*BUILTIN["echo_core"], concurrency=4)


# ---- engines that break the contract: the kit must say so, naming the check ------------------


class _Broken(LLMEngine):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.task: asyncio.Task[None] | None = None

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self.mode == "leak":
            self.task = asyncio.create_task(asyncio.sleep(3600), name="forgotten")
        return EngineConfig(model_input="tokens")

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        limit = request.stop_conditions.max_tokens or 16
        if self.mode == "two_finals":
            yield LLMEngineOutput(token_ids=[1], finish_reason="stop")
            yield LLMEngineOutput(finish_reason="stop")
            return
        for i in range(limit if self.mode != "over" else limit + 2):
            await asyncio.sleep(0.001)
            if context.is_stopped() and self.mode != "deaf":
                yield LLMEngineOutput(finish_reason="cancelled")
                return
            yield LLMEngineOutput(token_ids=[i + 1])
        yield LLMEngineOutput(finish_reason="length")

    async def cleanup(self) -> None:
        if self.mode == "cleanup_raises" and self.task is None:
            raise RuntimeError("nothing to clean")


@pytest.mark.parametrize(
    ("mode", "check", "says"),
    [
        ("two_finals", "stream", "exactly one chunk with a finish_reason"),
        ("over", "max_tokens", "max_tokens=3: 5 token ids"),
        ("deaf", "cancellation", "stop_generating() was not observed"),
        ("leak", "cleanup_after_use", "task 'forgotten'"),
        ("cleanup_raises", "cleanup_without_start", "cleanup() before start() raised RuntimeError"),
    ],
)
async def test_kit_reports_broken_engines(mode: str, check: str, says: str) -> None:
    made: list[_Broken] = []

    def make() -> _Broken:
        made.append(_Broken(mode))
        return made[-1]

    with pytest.raises(ConformanceError) as err:
        await check_engine(make, token_request, only=[check], cleanup_within_s=0.2, cancel_max_tokens=64)
    for engine in made:
        if engine.task is not None:
            engine.task.cancel()
    assert check in err.value.failures
    assert says in err.value.failures[check], err.value.failures[check]


async def test_text_request_for_a_tokens_engine_is_named() -> None:
    report = await check_engine(
        lambda: EchoCoreEngine(delay_s=0), chat_request, only=["start_returns_config"], raise_on_failure=False
    )
    assert "model_input is 'tokens'" in report.failed["start_returns_config"]
