"""The baseline: a bare ASGI app on the same server stack (uvicorn, uvloop, httptools) that
streams 64 pre-built SSE chunks and does nothing else. The frontend's CPU per request is
reported as a ratio to this floor (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import os
import sys

import uvicorn

CHUNK = (
    b'data: {"id":"chatcmpl-0","choices":[{"index":0,"delta":{"content":"tok"},'
    b'"finish_reason":null,"logprobs":null}],"created":0,"model":"m","object":"chat.completion.chunk"}\n\n'
)
TOKENS = 64
# Paced like echo_core when the benchmark sets a delay, so the comparison stays like for like.
DELAY_S = float(os.environ.get("DYN_TOKEN_ECHO_DELAY_MS", "0") or 0) / 1000


async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    for _ in range(TOKENS):
        if DELAY_S:
            await asyncio.sleep(DELAY_S)
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
