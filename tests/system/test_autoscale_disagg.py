"""The autoscaler on a disaggregated mocker graph sizes its prefill and decode pools apart, by
tokens, at one constant request rate throughout: a prompt-heavy spell (long unique prompts, two
output tokens) grows the prefill pool, sized by prompt tokens against its time to first
response, and leaves the decode pool alone; short requests again shrink it back (a planner
counting requests/s would see the same 12 req/s and keep it); an output-heavy spell (short
prompts, long answers) grows the decode pool, sized by output tokens against the time between
its tokens, and leaves the prefill pool alone. No request is lost through any of it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dynamo_graph.bench.loadgen import Request, Target, run_open
from dynamo_graph.bench.replicas import ReplicaSampler
from dynamo_graph.graph.paths import state_dir
from tests.support.processes import free_port, run_cli

WORDS = ("sea", "ship", "wind", "storm", "harbor", "sail", "wave", "tide", "island", "anchor")
RATE = 12.0  # requests/s throughout
# (kind, seconds): short requests, the prompt-heavy spell, short ones until the prefill pool is
# back to one, the output-heavy spell, short ones.
PHASES = (("short", 5.0), ("prompts", 18.0), ("short", 14.0), ("outputs", 18.0), ("short", 4.0))
SLOW = 0.25  # the mockers' speedup_ratio: simulated time runs 4x slower, so 12 req/s is a load


def _pool(role: str, engine_args: dict, target: dict[str, float]) -> dict:
    """An autoscaled mocker pool of one role, slowed by SLOW."""
    return {
        "kind": "worker",
        "model": "tiny-model",
        "engine": "mocker",
        "role": role,
        "engine_args": {"speedup_ratio": SLOW, "block_size": 16, **engine_args},
        "autoscale": {
            "min_replicas": 1,
            "max_replicas": 3,
            "target": target,
            "interval_s": 1.0,
            "scale_down_delay_s": 4.0,
        },
    }


def _body(kind: str, index: int) -> dict:
    """A prompt-heavy request has ~450 unique prompt tokens (no prefix cache can help) and two
    output tokens; an output-heavy one a short prompt and 60; a short one a short prompt and 2."""
    rng = random.Random(index)
    words = 105 if kind == "prompts" else 4
    text = " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))
    return {
        "model": "tiny-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 60 if kind == "outputs" else 2,
        "stream": True,
        "nvext": {"ignore_eos": True},
    }


def _load() -> tuple[list[Request], dict[str, tuple[float, float]]]:
    """The requests, and each spell's (start, end) in seconds from the start (a kind's first)."""
    requests: list[Request] = []
    spans: dict[str, tuple[float, float]] = {}
    start = 0.0
    for kind, seconds in PHASES:
        for i in range(int(seconds * RATE)):
            requests.append(Request(_body(kind, len(requests)), start + i / RATE))
        spans.setdefault(kind, (start, start + seconds))
        start += seconds
    return requests, spans


@pytest.fixture
def graph(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Path, int]]:
    port = free_port()
    file = tmp_path / "autoscale-disagg.yaml"
    file.write_text(
        yaml.safe_dump(
            {
                "name": "autoscale-disagg",
                "models": {"tiny-model": {"path": str(tiny_model), "kv_cache_block_size": 16}},
                "components": {
                    "frontend": {
                        "kind": "frontend",
                        "http": {"port": port},
                        "router": {"mode": "round-robin"},
                        "disagg": {"conditional": False},
                    },
                    # one ~450-token prompt a forward pass: prefill is the work that queues
                    "prefill": _pool("prefill", {"max_num_batched_tokens": 512}, {"ttft_p90_ms": 300.0}),
                    # a small KV cache: many long answers at once fill it, and a pass slows with
                    # KV usage (the mocker's vLLM fit)
                    "decode": _pool("decode", {"num_gpu_blocks": 400}, {"itl_p90_ms": 90.0}),
                },
            }
        )
    )
    try:
        yield file, port
    finally:
        run_cli(["down", str(file)], timeout=120)


def _most(sampler: ReplicaSampler, started: float, span: tuple[float, float]) -> int:
    return max(n for t, n in sampler.samples if span[0] <= t - started <= span[1] + 1.0)


@pytest.mark.slow  # a minute of load
def test_prefill_and_decode_pools_follow_their_own_tokens_at_a_constant_request_rate(
    graph: tuple[Path, int],
) -> None:
    file, port = graph
    up = run_cli(["up", "-d", str(file)], timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    samplers = {pool: ReplicaSampler(state_dir(file), pool) for pool in ("prefill", "decode")}
    for sampler in samplers.values():
        sampler.start()
    requests, spans = _load()
    started = time.monotonic()
    target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=False)
    run = asyncio.run(run_open(target, requests, max_seconds=sum(s for _, s in PHASES) + 5))
    for sampler in samplers.values():
        sampler.stop()

    failed = [r for r in run.results if not r.ok]
    assert not failed, f"{len(failed)} of {len(run.results)} failed: {[r.error for r in failed[:3]]}"
    prefill, decode = samplers["prefill"], samplers["decode"]
    trace = f"prefill {prefill.samples}\ndecode {decode.samples}"
    assert _most(prefill, started, spans["prompts"]) >= 2, trace
    assert _most(decode, started, spans["prompts"]) == 1, trace
    assert _most(decode, started, spans["outputs"]) >= 2, trace
    # Back to one before the output-heavy spell, at the same 12 requests/s, and kept there.
    assert _most(prefill, started, spans["outputs"]) == 1, trace
