"""A streaming /v1/completions client that records everything the migration, chaos and disagg
tests check of a stream: status, text, chunks, finish reasons, usage, error events, [DONE], TTFT."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# Below the server's keep-alive timeout (uvicorn: 5 s, as httpx's default expiry): a pooled
# connection reused just as the server closes it fails with a ReadError before any byte.
KEEPALIVE_S = 2.0


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    chunks: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: str = ""  # the body of a non-200 answer
    ttft: float | None = None
    latency: float = 0.0
    exception: str | None = None

    @property
    def token_counts(self) -> tuple[int, int, int] | None:
        """(prompt, completion, total) tokens; cached tokens depend on the workers' caches."""
        u = self.usage
        return None if u is None else (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")

    def complete(self, max_tokens: int) -> bool:
        return (
            self.status == 200
            and self.done
            and not self.errors
            and self.finish_reasons == ["length"]
            and self.completion_tokens == max_tokens
        )


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    http: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    on_chunk: Callable[[int], Any] | None = None,
) -> StreamResult:
    """One streaming /v1/completions request; `on_chunk(n)` is called after the n-th content chunk."""
    result = StreamResult()
    start = time.perf_counter()
    try:
        async with http.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.body = (await resp.aread()).decode(errors="replace")
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.errors.append(event["error"])
                    continue
                if event.get("usage"):
                    result.usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        result.text += choice["text"]
                        result.chunks += 1
                        if on_chunk is not None:
                            on_chunk(result.chunks)
                    if choice.get("finish_reason"):
                        result.finish_reasons.append(choice["finish_reason"])
    except httpx.HTTPError as err:
        result.exception = f"{type(err).__name__}: {err}"
    finally:
        result.latency = time.perf_counter() - start
    return result


def run_one(
    base_url: str, body: dict[str, Any], on_chunk: Callable[[int], Any] | None = None
) -> StreamResult:
    async def main() -> StreamResult:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
            return await stream_completion(http, base_url, body, on_chunk)

    return asyncio.run(main())
