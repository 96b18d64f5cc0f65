"""The autoscaler on a mocker pool under an open-loop load low -> high -> low (ramped up over
nine seconds, as a day's traffic rises, then dropped at once): it grows while the load is
high, holds the TTFT target over the busy phase's second half, shrinks back to `min_replicas`
after the delay, loses no request, and runs fewer replica-seconds than `max_replicas` would.
The same pool with a load target instead (Dynamo's load mode) grows on its workers' queue."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from dynamo_graph.bench.loadgen import Target, run_open
from dynamo_graph.bench.replicas import ReplicaSampler, phased
from dynamo_graph.graph.paths import state_dir
from tests.support.processes import free_port, run_cli

LOW_RPS, HIGH_RPS = 2.0, 16.0
# (seconds, requests/s): low, a ramp, the busy phase, low again
PHASES = ((6.0, LOW_RPS), (3.0, 5.0), (3.0, 9.0), (3.0, 13.0), (24.0, HIGH_RPS), (24.0, LOW_RPS))
BUSY = (sum(s for s, _ in PHASES[:4]), sum(s for s, _ in PHASES[:5]))  # the busy phase, from start
TTFT_TARGET_MS = 250.0
MAX_REPLICAS = 4


BODY = {
    "model": "tiny-model",
    "messages": [{"role": "user", "content": "tell me a long story about the sea"}],
    "max_tokens": 60,
    "stream": True,
    "nvext": {"ignore_eos": True},
}


def _graph(directory: Path, tiny_model: Path, name: str, autoscale: dict) -> tuple[Path, int]:
    """A frontend (round-robin) and an autoscaled mocker pool running two requests at once."""
    port = free_port()
    file = directory / f"{name}.yaml"
    scaled = {"min_replicas": 1, "interval_s": 1.0, **autoscale}
    mocker = {"max_num_seqs": 2, "speedup_ratio": 1.0}
    backend = {
        "kind": "worker",
        "model": "tiny-model",
        "engine": "mocker",
        "engine_args": mocker,
        "autoscale": scaled,
    }
    doc = {
        "name": name,
        "models": {"tiny-model": {"path": str(tiny_model)}},
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": port}, "router": {"mode": "round-robin"}},
            "backend": backend,
        },
    }
    file.write_text(yaml.safe_dump(doc))
    return file, port


@pytest.fixture
def pools(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[[str, dict], tuple[Path, int]]]:
    """Makes `_graph`s (file, port) and brings each down at the end."""
    made: list[Path] = []

    def make(name: str, autoscale: dict) -> tuple[Path, int]:
        file, port = _graph(tmp_path, tiny_model, name, autoscale)
        made.append(file)
        return file, port

    try:
        yield make
    finally:
        for file in made:
            run_cli(["down", str(file)], timeout=120)


@pytest.mark.slow  # a minute of load; the planner's rules run in the default set (tests/unit/test_planner.py)
def test_the_pool_grows_under_load_holds_its_target_and_shrinks_back_losing_nothing(
    pools: Callable[[str, dict], tuple[Path, int]],
) -> None:
    scale = {
        "max_replicas": MAX_REPLICAS,
        "target": {"ttft_p90_ms": TTFT_TARGET_MS},
        "scale_down_delay_s": 4.0,
    }
    file, port = pools("autoscale", scale)
    up = run_cli(["up", "-d", str(file)], timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    sampler = ReplicaSampler(state_dir(file), "backend")
    sampler.start()
    started = time.monotonic()
    target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=False)
    run = asyncio.run(run_open(target, phased(BODY, PHASES), max_seconds=sum(s for s, _ in PHASES) + 5))
    time.sleep(2)
    sampler.stop()

    failed = [r for r in run.results if not r.ok]
    assert not failed, f"{len(failed)} of {len(run.results)} failed: {[r.error for r in failed[:3]]}"
    low, high = BUSY
    busy = [n for t, n in sampler.samples if low <= t - started <= high]
    assert max(busy) >= 3, f"the pool never reached 3 ready replicas: {sampler.samples}"
    second_half = [r.ttft * 1000 for r in run.results if (low + high) / 2 <= r.start <= high]
    second_half.sort()
    p90 = second_half[int(0.9 * (len(second_half) - 1))]
    assert p90 <= TTFT_TARGET_MS * 1.5, f"TTFT p90 {p90:.0f} ms in the busy phase's second half"
    assert sampler.samples[-1][1] == 1, f"not back to min_replicas: {sampler.samples[-8:]}"
    replica_seconds, elapsed = sampler.replica_seconds(), sampler.elapsed()
    assert replica_seconds < 0.75 * MAX_REPLICAS * elapsed, (replica_seconds, elapsed)

    decisions = [
        json.loads(line) for line in (file.parent / ".dyngraph" / "autoscale" / "autoscale.jsonl").open()
    ]
    assert any(d["desired"] > d["ready"] for d in decisions) and any(
        d["desired"] < d["ready"] for d in decisions
    )
    status = json.loads(run_cli(["status", str(file), "--json"]).stdout)
    assert status["components"]["backend"]["autoscale"]["last"]["pool"] == "backend"


@pytest.mark.slow  # 16 s alone, timing-bound: a queue to build, replicas to start, a delay to wait out
def test_a_pool_sized_by_its_workers_waiting_requests_grows_and_shrinks_back(
    pools: Callable[[str, dict], tuple[Path, int]],
) -> None:
    """Dynamo's load mode: the pool's only target is `waiting_requests`, read from the load
    reports its workers publish on the event plane (the supervisor subscribes). 10 requests/s
    for 8 s, where a replica serves about 4: a queue grows the pool; drained, it shrinks back."""
    scale = {"max_replicas": 3, "target": {"waiting_requests": 2}, "scale_down_delay_s": 3.0}
    file, port = pools("autoscale-load", scale)
    up = run_cli(["up", "-d", str(file)], timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    sampler = ReplicaSampler(state_dir(file), "backend")
    sampler.start()
    target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=False)
    run = asyncio.run(run_open(target, phased(BODY, ((8.0, 10.0),)), max_seconds=40))
    deadline = time.monotonic() + 20  # drained: back to one replica after the delay
    while time.monotonic() < deadline and (not sampler.samples or sampler.samples[-1][1] != 1):
        time.sleep(0.5)
    sampler.stop()

    failed = [r for r in run.results if not r.ok]
    assert not failed, f"{len(failed)} of {len(run.results)} failed: {[r.error for r in failed[:3]]}"
    assert max(n for _, n in sampler.samples) >= 2, sampler.samples
    assert sampler.samples[-1][1] == 1, f"not back to one replica: {sampler.samples[-8:]}"
    decisions = [json.loads(line) for line in (state_dir(file) / "autoscale.jsonl").open()]
    grew = [d for d in decisions if d["desired"] > d["ready"]]
    assert grew and "waiting_requests at" in grew[0]["reason"], grew[:1]
    assert grew[0]["waiting_requests"] > 2, grew[0]
