"""A scripted router for migration tests (router/migration.py): each generate() call plays one
Attempt — outputs, then an error or a normal end — and records what it was asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamo_graph.backend.errors import EngineError
from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.runtime.context import Context

PROMPT = [5, 6, 7, 8]


def scripted_request(
    max_tokens: int | None = 10, min_tokens: int | None = None, **sampling: Any
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m",
        token_ids=list(PROMPT),
        stop_conditions=StopConditions(max_tokens=max_tokens, min_tokens=min_tokens),
        sampling_options=SamplingOptions(**sampling),
    )


def tagged(err: EngineError, instance_id: int) -> EngineError:
    err.instance_id = instance_id  # type: ignore[attr-defined]
    return err


class Attempt:
    """One scripted stream: these outputs, then this error (or a normal end)."""

    def __init__(self, outputs: list[LLMEngineOutput], error: BaseException | None = None) -> None:
        self.outputs = outputs
        self.error = error


class FakeRouter:
    """Plays one scripted Attempt per generate() call and records what it was asked."""

    def __init__(self, attempts: list[Attempt], instances: list[int] | None = None) -> None:
        self.attempts = list(attempts)
        self.instances = instances if instances is not None else [1, 2, 3, 4]
        self.calls: list[tuple[PreprocessedRequest, set[int]]] = []
        self.closed = 0

    def instance_ids(self) -> list[int]:
        return list(self.instances)

    async def generate(
        self, request: PreprocessedRequest, context: Context, *, exclude: set[int] | None = None
    ) -> AsyncIterator[LLMEngineOutput]:
        self.calls.append((msgspec.structs.replace(request), set(exclude or ())))
        attempt = self.attempts.pop(0)
        try:
            for out in attempt.outputs:
                await asyncio.sleep(0)
                yield out
            if attempt.error is not None:
                raise attempt.error
        finally:
            self.closed += 1


def tokens(start: int, n: int, finish: str | None = None) -> list[LLMEngineOutput]:
    outs = [LLMEngineOutput(token_ids=[start + i]) for i in range(n)]
    if finish is not None:
        outs[-1].finish_reason = finish  # type: ignore[assignment]
    return outs
