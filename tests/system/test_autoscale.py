"""The autoscaler on a mocker pool under an open-loop load low -> high -> low (ramped up over
nine seconds, as a day's traffic rises, then dropped at once): it grows while the load is
high, holds the TTFT target over the busy phase's second half, shrinks back to `min_replicas`
after the delay, loses no request, and runs fewer replica-seconds than `max_replicas` would."""

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


@pytest.fixture
def graph(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Path, int]]:
    port = free_port()
    file = tmp_path / "autoscale.yaml"
    file.write_text(
        yaml.safe_dump(
            {
                "name": "autoscale",
                "models": {"tiny-model": {"path": str(tiny_model)}},
                "components": {
                    "frontend": {
                        "kind": "frontend",
                        "http": {"port": port},
                        "router": {"mode": "round-robin"},
                    },
                    "backend": {
                        "kind": "worker",
                        "model": "tiny-model",
                        "engine": "mocker",
                        "replicas": 1,
                        "engine_args": {"max_num_seqs": 2, "speedup_ratio": 1.0},
                        "autoscale": {
                            "min_replicas": 1,
                            "max_replicas": MAX_REPLICAS,
                            "target": {"ttft_p90_ms": TTFT_TARGET_MS},
                            "interval_s": 1.0,
                            "scale_down_delay_s": 4.0,
                        },
                    },
                },
            }
        )
    )
    try:
        yield file, port
    finally:
        run_cli(["down", str(file)], timeout=120)


@pytest.mark.slow  # a minute of load; the planner's rules run in the default set (tests/unit/test_planner.py)
def test_the_pool_grows_under_load_holds_its_target_and_shrinks_back_losing_nothing(
    graph: tuple[Path, int],
) -> None:
    file, port = graph
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
