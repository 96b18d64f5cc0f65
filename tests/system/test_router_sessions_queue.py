"""The kv router's session affinity, priority queue and overload answer end to end: the real
frontend and mocker workers (each its own process, embedded planes), driven by the official
`openai` client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.support.metrics import metric, scrape
from tests.support.priority_load import BLOCKER, first_token_at
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances, served_by
from tests.support.waiting import wait_for, wait_for_async

ENDPOINT = "dyn://rq.mocker.generate"
Deploy = Callable[..., ServerProcess]


@pytest.fixture
def deploy(tiny_model: Path, tmp_path: Path) -> Iterator[Deploy]:
    """`deploy(workers, speedup, *frontend_flags)`: mocker workers and a kv-routing frontend."""
    started: list[ServerProcess | WorkerProcess] = []

    def start(workers: int, speedup: float, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        planes = embedded_planes_env(tmp_path, zmq_events=True)
        args = tmp_path / "mocker.json"
        args.write_text(json.dumps({"block_size": 16, "speedup_ratio": speedup, "num_gpu_blocks": 4096}))
        argv = [
            *DYNGRAPH,
            "run",
            f"in={ENDPOINT}",
            "out=mocker",
            str(tiny_model),
            "--context-length",
            "16384",
        ]
        argv.append("--extra-engine-args")
        for _ in range(workers):
            started.append(WorkerProcess([*argv, str(args)], env=planes, log_dir=tmp_path))
        frontend = ServerProcess(
            ["out=auto", "--router-mode", "kv", *flags], env={**planes, **(env or {})}, log_dir=tmp_path
        )
        started.append(frontend)
        frontend.wait_ready(path="/live")
        wait_for(lambda: len(instances(frontend, tiny_model.name)) == workers, 30, "the mocker workers")
        return frontend

    yield start
    for proc in reversed(started):
        proc.stop()


def client(frontend: ServerProcess) -> openai.AsyncOpenAI:
    # No retries: a 529 must reach the test, not be retried by the client.
    return openai.AsyncOpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _gauge(frontend: ServerProcess, name: str) -> float:
    """The decode pool's `dynamo_frontend_router_{name}` (one worker: one rank), 0 if absent."""
    return metric(frontend, f"dynamo_frontend_router_{name}", pool="decode")


def test_a_session_stays_on_its_worker_across_unrelated_prompts(deploy: Deploy, tiny_model: Path) -> None:
    frontend = deploy(
        2, 50.0, "--router-session-affinity-ttl-secs", "60", "--router-session-affinity-mode", "hard"
    )
    model = tiny_model.name
    sync = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)

    def ask(text: str, **kw: object) -> dict:
        out = sync.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=4, **kw
        )
        return out.model_dump()

    homes = {}
    for session in ("alpha", "beta", "gamma", "delta"):
        served = set()
        for turn in range(3):  # prompts that share nothing but the chat template
            text = f"{session} turn {turn}: " + " ".join(f"w{turn * 97 + i}" for i in range(40))
            home, _ = served_by(
                frontend, model, lambda t=text, s=session: ask(t, extra_headers={"x-session-id": s})
            )
            served.add(home)
        assert len(served) == 1, f"session {session} moved: {served}"
        homes[session] = served.pop()
    # The session id in the body (Dynamo's nvext.agent_context) binds the same way.
    body = {"nvext": {"agent_context": {"session_id": "alpha"}}}
    home, _ = served_by(frontend, model, lambda: ask("something else entirely", extra_body=body))
    assert home == homes["alpha"]
    assert metric(frontend, "dynamo_frontend_router_session_bindings") == 4
    assert "dynamo_frontend_router_ttft_seconds_per_prefill_token{" in scrape(frontend)


async def _wait_blocked(frontend: ServerProcess) -> None:
    """Until the blocker is booked on the worker (its prefill tokens wait there)."""
    await wait_for_async(
        lambda: _gauge(frontend, "queued_prefill_tokens") > 0, 20, "the blocker to reach the worker"
    )


async def _wait_queued(frontend: ServerProcess, n: int) -> None:
    await wait_for_async(lambda: _gauge(frontend, "queue_depth") >= n, 20, f"{n} requests to queue")


def test_queued_requests_go_in_priority_order(deploy: Deploy, tiny_model: Path) -> None:
    # One slow worker and a queue whenever a prefill is waiting.
    frontend = deploy(1, 0.05, "--router-queue-threshold", "0")
    model = tiny_model.name

    async def run() -> dict[str, float]:
        api = client(frontend)
        blocker = asyncio.create_task(first_token_at(api, model, BLOCKER, None))
        await _wait_blocked(frontend)
        tasks = {}
        for i in range(3):
            tasks[f"low{i}"] = asyncio.create_task(first_token_at(api, model, f"background job {i}", -1))
            await _wait_queued(frontend, i + 1)
        tasks["high"] = asyncio.create_task(first_token_at(api, model, "the user is waiting", 10))
        await _wait_queued(frontend, 4)
        times = {name: await task for name, task in tasks.items()}
        await blocker
        await api.close()
        return times

    times = asyncio.run(run())
    assert all(times.values()), times
    order = sorted(times, key=times.__getitem__)
    assert order == ["high", "low0", "low1", "low2"], times


def test_past_the_queue_bound_the_answer_is_529_with_retry_after(deploy: Deploy, tiny_model: Path) -> None:
    frontend = deploy(1, 0.05, "--router-queue-threshold", "0", "--router-max-queue-size", "1")
    model = tiny_model.name

    async def run() -> tuple[openai.APIStatusError, list[float]]:
        api = client(frontend)
        served = [asyncio.create_task(first_token_at(api, model, BLOCKER, None))]
        await _wait_blocked(frontend)
        served.append(asyncio.create_task(first_token_at(api, model, "queued", None)))
        await _wait_queued(frontend, 1)
        with pytest.raises(openai.APIStatusError) as refused:
            await first_token_at(api, model, "one too many", 0)  # no more urgent: refused
        firsts = await asyncio.gather(*served)  # nothing admitted was lost
        await api.close()
        return refused.value, firsts

    err, firsts = asyncio.run(run())
    assert err.status_code == 529
    assert err.response.headers["retry-after"] == "1"
    assert err.body["code"] == "overloaded" and "queue" in err.body["message"]  # type: ignore[index]
    assert all(firsts)
    assert metric(frontend, "dynamo_frontend_router_queue_rejected_requests_total") == 1


@pytest.mark.serial  # a race between the blocker's prompt and the held request: run alone
def test_a_second_frontend_sees_the_first_ones_work_in_the_workers_load_reports(
    deploy: Deploy, tiny_model: Path, tmp_path: Path
) -> None:
    """Two frontends share one slow worker. The first sends a long prompt; the second, which
    routed nothing, sees the worker's load in its reports, and with its queue at threshold 0
    holds a request until the worker's backlog is computed (not piling it behind the prompt)."""
    first = deploy(1, 0.05, "--router-queue-threshold", "0")
    second = ServerProcess(
        ["out=auto", "--router-mode", "kv", "--router-queue-threshold", "0"],
        env=embedded_planes_env(tmp_path, zmq_events=True),
        log_dir=tmp_path,
    )
    try:
        second.wait_ready(path="/live")
        wait_for(lambda: len(instances(second, tiny_model.name)) == 1, 30, "the mocker worker")
        model = tiny_model.name

        async def run() -> tuple[float, float, float]:
            api_first, api_second = client(first), client(second)
            blocker = asyncio.create_task(first_token_at(api_first, model, BLOCKER, None))
            await _wait_blocked(first)
            await wait_for_async(
                lambda: (
                    _gauge(second, "reported_running_requests") or _gauge(second, "reported_waiting_requests")
                ),
                20,
                "the second frontend to hear the worker's load",
            )
            assert _gauge(second, "queued_prefill_tokens") == 0  # it sent nothing itself
            reported = _gauge(second, "reported_prefill_tokens")  # the mocker reports its backlog
            assert reported > 0, "the worker's load report carries no queued prefill tokens"
            assert _gauge(second, "counted_prefill_tokens") >= reported
            held = asyncio.create_task(first_token_at(api_second, model, "from the other frontend", None))
            await _wait_queued(second, 1)
            blocked_first = await blocker
            held_first = await held
            await api_first.close()
            await api_second.close()
            return reported, blocked_first, held_first

        reported, blocked_first, held_first = asyncio.run(run())
        assert reported > 0 and held_first >= blocked_first
    finally:
        second.stop()
