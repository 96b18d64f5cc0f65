"""Priority reaches the engine: a mocker worker process (one sequence slot) behind a frontend
without a router queue admits a request marked `x-dynamo-request-priority` ahead of the
low-priority ones already waiting on the worker; with `scheduling_policy: fcfs` it does not. The
official `openai` client, real processes, embedded planes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.metrics import metric
from tests.support.priority_load import BLOCKER, first_token_at
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances
from tests.support.waiting import wait_for, wait_for_async

ENDPOINT = "dyn://prio.mocker.generate"
# BLOCKER keeps the worker's one sequence busy for seconds (prefill passes of ~3.4 s and ~0.9 s
# at speedup 0.05), so the test's requests wait on the worker even on a loaded machine.


@pytest.fixture(params=["priority", "fcfs"])
def deployment(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path: Path
) -> Iterator[tuple[ServerProcess, str]]:
    """A frontend and one mocker worker (one sequence slot) with the param's scheduling policy."""
    planes = embedded_planes_env(tmp_path)
    settings = {"block_size": 16, "speedup_ratio": 0.05, "num_gpu_blocks": 4096, "max_num_seqs": 1}
    if request.param == "fcfs":
        settings["scheduling_policy"] = "fcfs"  # explicit; the default is priority
    args = tmp_path / "mocker.json"
    args.write_text(json.dumps(settings))
    argv = [*DYNGRAPH, "run", f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--context-length", "16384"]
    worker = WorkerProcess([*argv, "--extra-engine-args", str(args)], env=planes, log_dir=tmp_path)
    server = ServerProcess(["out=auto", "--router-mode", "round-robin"], env=planes, log_dir=tmp_path)
    try:
        server.wait_ready(path="/live")
        wait_for(lambda: len(instances(server, tiny_model.name)) == 1, 30, "the mocker worker")
        yield server, request.param
    finally:
        server.stop()
        worker.stop()


async def wait_inflight(server: ServerProcess, n: int) -> None:
    await wait_for_async(
        lambda: metric(server, "dynamo_frontend_inflight_requests") >= n, 20, f"{n} requests in the frontend"
    )


def test_the_worker_admits_the_urgent_request_first(
    deployment: tuple[ServerProcess, str], tiny_model: Path
) -> None:
    frontend, policy = deployment
    model = tiny_model.name

    async def run() -> dict[str, float]:
        api = openai.AsyncOpenAI(
            base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=90
        )
        blocker = asyncio.create_task(first_token_at(api, model, BLOCKER, None))
        tasks: dict[str, asyncio.Task[float]] = {}
        for name, priority in (("low0", -1), ("low1", -1), ("high", 10)):
            await wait_inflight(frontend, len(tasks) + 1)  # the previous one is in
            # and on the worker: nothing outside the worker tells when a request has reached its
            # queue, so this one wait stays a time (the worker takes a request within milliseconds)
            await asyncio.sleep(0.2)
            tasks[name] = asyncio.create_task(first_token_at(api, model, f"job {name} please", priority))
        times = {name: await task for name, task in tasks.items()}
        first_of_blocker = await blocker
        await api.close()
        assert all(t > first_of_blocker for t in times.values()), "they did not wait on the worker"
        return times

    times = asyncio.run(run())
    order = sorted(times, key=times.__getitem__)
    assert order == (["high", "low0", "low1"] if policy == "priority" else ["low0", "low1", "high"]), times
