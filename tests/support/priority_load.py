"""Requests that queue behind a long prompt on a slow mocker worker, and when each one's first
token comes: the order of first tokens is what the router-queue and engine-priority tests check."""

from __future__ import annotations

import time

import openai

# A prompt that keeps the slow worker busy for seconds (two prefill passes of ~2.8 s and ~0.9 s
# at speedup 0.05), so the test's requests queue behind it even on a loaded machine.
BLOCKER = [100 + i % 500 for i in range(10_000)]


async def first_token_at(
    api: openai.AsyncOpenAI, model: str, prompt: str | list[int], priority: int | None
) -> float:
    """The time (time.monotonic) the first token of a 2-token stream came, 0 if none did;
    `priority`: the x-dynamo-request-priority header."""
    headers = {} if priority is None else {"x-dynamo-request-priority": str(priority)}
    stream = await api.completions.create(
        model=model, prompt=prompt, max_tokens=2, stream=True, extra_headers=headers
    )
    first = 0.0
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].text:
            first = time.monotonic()
    return first
