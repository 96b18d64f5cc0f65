"""The planner's load targets end to end (Dynamo's load mode): a mocker pool whose only target is
`waiting_requests`, sized from the load reports its workers publish on the event plane, which the
supervisor subscribes to. A queue of streams grows the pool; once it drains, the pool shrinks back
after the delay; no request is lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dynamo_graph.bench.loadgen import Target, run_open
from dynamo_graph.bench.replicas import ReplicaSampler, phased
from dynamo_graph.graph.paths import state_dir
from tests.support.processes import free_port, run_cli

# 10 requests/s of 60-token streams; a replica runs two at once (about 4 requests/s), so the rest wait.
PHASES = ((8.0, 10.0),)
BODY = {
    "model": "tiny-model",
    "messages": [{"role": "user", "content": "tell me a long story about the sea"}],
    "max_tokens": 60,
    "stream": True,
    "nvext": {"ignore_eos": True},
}


@pytest.fixture
def graph(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Path, int]]:
    port = free_port()
    file = tmp_path / "autoscale-load.yaml"
    backend = {
        "kind": "worker",
        "model": "tiny-model",
        "engine": "mocker",
        "engine_args": {"max_num_seqs": 2, "speedup_ratio": 1.0},
        "autoscale": {
            "min_replicas": 1,
            "max_replicas": 3,
            "target": {"waiting_requests": 2},
            "interval_s": 1.0,
            "scale_down_delay_s": 3.0,
        },
    }
    doc = {
        "name": "autoscale-load",
        "models": {"tiny-model": {"path": str(tiny_model)}},
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": port}, "router": {"mode": "round-robin"}},
            "backend": backend,
        },
    }
    file.write_text(yaml.safe_dump(doc))
    try:
        yield file, port
    finally:
        run_cli(["down", str(file)], timeout=120)


@pytest.mark.slow  # 16 s alone, timing-bound: a queue to build, replicas to start, a delay to wait out
def test_a_pool_sized_by_its_workers_waiting_requests_grows_and_shrinks_back(graph: tuple[Path, int]) -> None:
    file, port = graph
    up = run_cli(["up", "-d", str(file)], timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    sampler = ReplicaSampler(state_dir(file), "backend")
    sampler.start()
    target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=False)
    run = asyncio.run(run_open(target, phased(BODY, PHASES), max_seconds=40))
    deadline = time.monotonic() + 20  # drained: back to one replica after the delay
    while time.monotonic() < deadline and (not sampler.samples or sampler.samples[-1][1] != 1):
        time.sleep(0.5)
    sampler.stop()

    failed = [r for r in run.results if not r.ok]
    assert not failed, f"{len(failed)} of {len(run.results)} failed: {[r.error for r in failed[:3]]}"
    assert max(n for _, n in sampler.samples) >= 2, sampler.samples
    assert sampler.samples[-1][1] == 1, f"not back to one replica: {sampler.samples[-8:]}"
    log = state_dir(file) / "autoscale.jsonl"
    decisions = [json.loads(line) for line in log.open()]
    grew = [d for d in decisions if d["desired"] > d["ready"]]
    assert grew and "waiting_requests at" in grew[0]["reason"], grew[:1]
    assert grew[0]["waiting_requests"] > 2, grew[0]
