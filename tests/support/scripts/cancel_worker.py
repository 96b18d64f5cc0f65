"""A Backend-type worker (Python worker API) that streams slowly and records, in the file named
by CANCEL_LOG, the wall-clock time at which its context reported the caller's cancellation."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from dynamo_graph.llm import ModelType, register_llm
from dynamo_graph.runtime import DistributedRuntime, dynamo_worker


@dynamo_worker(static=False)
async def worker(runtime: DistributedRuntime, model_path: str) -> None:
    endpoint = runtime.namespace("cancel").component("backend").endpoint("generate")
    await register_llm(ModelType.Backend, endpoint, model_path, "slow")
    await endpoint.serve_endpoint(generate)


async def generate(request, context):
    for token_id in request["token_ids"] * 50:
        stop = asyncio.ensure_future(context.stopped())
        done, _ = await asyncio.wait({stop}, timeout=0.05)
        if done:
            seen = time.time()
            Path(os.environ["CANCEL_LOG"]).write_text(f"{seen}\n")  # noqa: ASYNC240 - a tiny test file
            return
        stop.cancel()
        yield {"token_ids": [token_id]}
    yield {"token_ids": [], "finish_reason": "length"}


if __name__ == "__main__":
    asyncio.run(worker(sys.argv[1]))
