"""The bench load generator against a real `dyngraph run in=http out=mocker` server: closed and
open loops, every API surface's stream, and failures (HTTP errors, refused connections,
timeouts) recorded per request instead of raised; bounded in count and time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_graph.bench import workload
from dynamo_graph.bench.loadgen import Request, Target, run_closed, run_open
from tests.support.processes import ServerProcess, free_port, running_server


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("cfg") / "mocker.json"
    config.write_text('{"speedup_ratio": 50}')
    args = ["out=mocker", "--model-path", str(tiny_model), "--model-name", "tiny", "--extra-engine-args"]
    with running_server([*args, str(config)], log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


def requests(tiny_model: Path, n: int, output_len: int = 8) -> list[Request]:
    vocab = workload.tokenizer_vocabulary(tiny_model)
    prompts = workload.synthetic(vocab, count=n, input_len=24, output_len=output_len)
    return workload.to_requests(prompts, vocab, api="completions", model="tiny", ignore_eos=True)


def target(server: ServerProcess, path: str = "/v1/completions", keep_alive: bool = True) -> Target:
    return Target("127.0.0.1", server.port, path, keep_alive=keep_alive)


@pytest.mark.parametrize("keep_alive", [True, False])
def test_closed_loop(server: ServerProcess, tiny_model: Path, keep_alive: bool) -> None:
    run = asyncio.run(
        run_closed(
            target(server, keep_alive=keep_alive), requests(tiny_model, 30), concurrency=4, max_seconds=60
        )
    )
    assert len(run.results) == 30 and all(r.ok for r in run.results), {r.error for r in run.results}
    assert sorted(r.index for r in run.results) == list(range(30))
    for r in run.results:
        assert (r.output_tokens, r.prompt_tokens) == (8, 24)  # from the usage chunk
        assert 1 <= r.tokens <= 8 and len(r.gaps) == r.tokens - 1
        assert 0 < r.ttft <= r.total <= run.wall_s
    # four users: never more than four requests overlap
    events = sorted([(r.start, 1) for r in run.results] + [(r.start + r.total, -1) for r in run.results])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 4


def test_open_loop_sends_at_the_given_times_until_max_seconds(
    server: ServerProcess, tiny_model: Path
) -> None:
    base = requests(tiny_model, 4)
    timed = [Request(r.body, at) for r, at in zip(base, (0.0, 0.3, 0.6, 30.0), strict=True)]
    run = asyncio.run(run_open(target(server), timed, max_seconds=2.0))
    assert sorted(r.index for r in run.results) == [0, 1, 2]  # the one due at 30 s is never sent
    for r in run.results:
        assert r.ok and r.start >= timed[r.index].at - 0.005
    assert run.wall_s < 10


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6}),
        ("/v1/responses", {"input": "hi there", "max_output_tokens": 6}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6}),
    ],
)
def test_every_api_surface_streams_are_read(server: ServerProcess, path: str, body: dict) -> None:
    request = Request({"model": "tiny", "stream": True, "nvext": {"ignore_eos": True}, **body})
    run = asyncio.run(run_closed(target(server, path), [request] * 3, concurrency=1, max_seconds=30))
    assert all(r.ok for r in run.results), [r.error for r in run.results]
    assert all(r.output_tokens == 6 and r.tokens >= 1 for r in run.results)


def test_failures_are_recorded_not_raised(server: ServerProcess, tiny_model: Path) -> None:
    wrong_model = [Request({**requests(tiny_model, 1)[0].body, "model": "nope"})]
    run = asyncio.run(run_closed(target(server), wrong_model * 2, concurrency=1, max_seconds=30))
    assert [r.ok for r in run.results] == [False, False]  # and the connection stayed usable
    assert run.results[0].error.startswith("HTTP 404") and "nope" in run.results[0].error

    refused = Target("127.0.0.1", free_port(), "/v1/completions")
    run = asyncio.run(run_closed(refused, requests(tiny_model, 2), concurrency=2, max_seconds=30))
    assert all(not r.ok and "ConnectionRefused" in r.error for r in run.results)

    slow = requests(tiny_model, 3, output_len=400)
    run = asyncio.run(run_open(target(server), slow, max_seconds=30, request_timeout_s=0.01))
    assert len(run.results) == 3 and all(r.error == "TimeoutError" for r in run.results)
    assert run.wall_s < 5
