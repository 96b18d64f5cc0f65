"""Overload (issue 17): 1.5x the request rate the workers sustain, 20% of requests high priority.

    .venv/bin/python benchmarks/bench_overload.py            # ~2 minutes

Fresh processes per phase (bench_routing.py's `Deployment`: `--workers` mocker workers and one
kv-routing frontend on 127.0.0.1). Requests: unique random prompts of `--prompt-tokens` token
ids (no prefix sharing, so routing cannot help), `--output-tokens` out, streamed from
/v1/completions; high-priority ones carry `x-dynamo-request-priority: 10`.

1. Capacity: a closed loop of `--capacity-concurrency` clients for `--capacity-seconds`; the
   completed requests per second are the sustainable rate R.
2. Unloaded TTFT: `--unloaded-requests` requests one at a time; its p90 is the reference.
3. Overload, one deployment per frontend setting: Poisson arrivals at `--overload` x R (1.5)
   for `--seconds`, each request high priority with probability `--high-share` (0.2).
   Settings: `no-queue` (every request goes straight to a worker, as without
   --router-queue-threshold), `queue-fcfs` and `queue-priority` (--router-queue-threshold
   `--threshold` prompt tokens per worker, --router-max-queue-size `--max-queue`).

Per setting: completed, refused (529 or 503 before any output: the client may retry) and lost
(anything else: an error mid-stream, a timeout, a dropped connection) requests; TTFT p50/p90 of
high- and low-priority requests, and high-priority p90 / unloaded p90 (target: <= 2, with
nothing lost). Results: benchmarks/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import (  # noqa: E402
    Deployment,
    TurnResult,
    completion_body,
    mocker_settings,
    vocab_range,
    warm_up,
)

from dynamo_graph.bench.loadgen import Connections, Target, encode_request, send  # noqa: E402
from dynamo_graph.bench.report import write_json  # noqa: E402
from dynamo_graph.bench.stats import percentile  # noqa: E402

HIGH_PRIORITY = 10
SETTINGS = ("no-queue", "queue-fcfs", "queue-priority")


def target(port: int, priority: int | None = None) -> Target:
    headers = () if priority is None else (("x-dynamo-request-priority", str(priority)),)
    return Target("127.0.0.1", port, "/v1/completions", headers=headers)


def build(port: int, model: str, prompt: list[int], max_tokens: int, priority: int | None) -> bytes:
    return encode_request(target(port, priority), completion_body(model, prompt, max_tokens))


class Prompts:
    def __init__(self, args: argparse.Namespace, vocab: tuple[int, int], salt: str) -> None:
        self.rng = random.Random(f"{args.seed}:{salt}")
        self.vocab = vocab
        self.tokens = args.prompt_tokens

    def next(self) -> list[int]:
        low, high = self.vocab
        return [self.rng.randrange(low, high) for _ in range(self.tokens)]


async def closed_loop(
    dep: Deployment, args: argparse.Namespace, prompts: Prompts, clients: int, seconds: float
) -> float:
    """Completed requests per second with `clients` back-to-back clients."""
    conns = Connections(target(dep.port))
    deadline = time.monotonic() + seconds
    clock0 = time.perf_counter()
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            result = TurnResult(0)
            wire = build(dep.port, dep.model, prompts.next(), args.output_tokens, None)
            await send(conns, wire, result, clock0, 60)
            done += result.ok

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    conns.close()
    return done / (time.monotonic() - start)


async def sequential(dep: Deployment, args: argparse.Namespace, prompts: Prompts, n: int) -> list[float]:
    conns = Connections(target(dep.port))
    ttfts = []
    for _ in range(n):
        result = TurnResult(0)
        wire = build(dep.port, dep.model, prompts.next(), args.output_tokens, HIGH_PRIORITY)
        await send(conns, wire, result, time.perf_counter(), 60)
        if result.ok:
            ttfts.append(result.ttft)
    conns.close()
    return ttfts


async def open_loop(
    dep: Deployment, args: argparse.Namespace, prompts: Prompts, rate: float
) -> list[tuple[bool, TurnResult]]:
    """Poisson arrivals at `rate` for `--seconds`; (high priority?, result) per request."""
    rng = random.Random(f"{args.seed}:arrivals")
    conns = Connections(target(dep.port))
    out: list[tuple[bool, TurnResult]] = []
    tasks = []
    clock0 = time.perf_counter()
    end = time.monotonic() + args.seconds
    next_at = time.monotonic()
    while next_at < end:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        high = rng.random() < args.high_share
        result = TurnResult(len(out))
        out.append((high, result))
        request = build(dep.port, dep.model, prompts.next(), args.output_tokens, HIGH_PRIORITY if high else 0)
        tasks.append(asyncio.create_task(send(conns, request, result, clock0, args.request_timeout)))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    conns.close()
    return out


def deployment(args: argparse.Namespace, setting: str, run_dir: Path, vocab: tuple[int, int]) -> Deployment:
    point = argparse.Namespace(**vars(args))
    point.kv_router_args = []
    if setting != "no-queue":
        point.kv_router_args = [
            "--router-queue-threshold", str(args.threshold),
            "--router-max-queue-size", str(args.max_queue),
            "--router-queue-policy", "fcfs" if setting == "queue-fcfs" else "priority",
        ]  # fmt: skip
    point_dir = run_dir / setting
    point_dir.mkdir()
    dep = Deployment(point, "kv", 0, point_dir)
    warm_up(dep, point, vocab)
    return dep


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1) if values else 0.0


def summarize(setting: str, results: list[tuple[bool, TurnResult]], unloaded_p90: float) -> dict:
    refused = [r for _, r in results if r.error.startswith(("HTTP 529", "HTTP 503"))]
    ok = [(h, r) for h, r in results if r.ok]
    lost = len(results) - len(ok) - len(refused)
    high = [r.ttft for h, r in ok if h]
    low = [r.ttft for h, r in ok if not h]
    high_p90 = ms(high, 90)
    return {
        "setting": setting,
        "requests": len(results),
        "completed": len(ok),
        "refused_529_503": len(refused),
        "lost": lost,
        "lost_examples": sorted({r.error[:120] for _, r in results if not r.ok and r not in refused})[:3],
        "high_completed": len(high),
        "high_ttft_p50_ms": ms(high, 50),
        "high_ttft_p90_ms": high_p90,
        "low_ttft_p50_ms": ms(low, 50),
        "low_ttft_p90_ms": ms(low, 90),
        "high_p90_over_unloaded_p90": round(high_p90 / unloaded_p90, 2) if unloaded_p90 else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--capacity-concurrency", type=int, default=24)
    parser.add_argument("--capacity-seconds", type=float, default=12.0)
    parser.add_argument("--unloaded-requests", type=int, default=20)
    parser.add_argument("--overload", type=float, default=1.5, help="arrival rate / sustainable rate")
    parser.add_argument("--high-share", type=float, default=0.2)
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals for this long, per setting")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--threshold", type=int, default=0, help="--router-queue-threshold (tokens)")
    parser.add_argument("--max-queue", type=int, default=64, help="--router-max-queue-size")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=4096)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument("--router-debug", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overload.json"))
    args = parser.parse_args()
    vocab = vocab_range(Path(args.model))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    rows = []
    try:
        (run_dir / "reference").mkdir()
        dep = deployment(args, "no-queue", run_dir / "reference", vocab)
        try:
            unloaded = asyncio.run(
                sequential(dep, args, Prompts(args, vocab, "unloaded"), args.unloaded_requests)
            )
            capacity = asyncio.run(
                closed_loop(
                    dep,
                    args,
                    Prompts(args, vocab, "capacity"),
                    args.capacity_concurrency,
                    args.capacity_seconds,
                )
            )
        finally:
            dep.close()
        unloaded_p90 = ms(unloaded, 90)
        rate = args.overload * capacity
        print(
            json.dumps(
                {
                    "capacity_rps": round(capacity, 2),
                    "unloaded_ttft_p90_ms": unloaded_p90,
                    "rate_rps": round(rate, 2),
                }
            )
        )
        for setting in args.settings.split(","):
            dep = deployment(args, setting, run_dir, vocab)
            try:
                results = asyncio.run(open_loop(dep, args, Prompts(args, vocab, "overload"), rate))
            finally:
                dep.close()
            rows.append(summarize(setting, results, unloaded_p90))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    saved = write_json(
        Path(args.out),
        {
            "benchmark": "overload_priority",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {
                "workers": args.workers,
                "mocker": mocker_settings(args),
                "prompt_tokens": args.prompt_tokens,
                "output_tokens": args.output_tokens,
                "overload": args.overload,
                "high_share": args.high_share,
                "seconds": args.seconds,
                "threshold_tokens": args.threshold,
                "max_queue": args.max_queue,
            },
            "capacity_rps": round(capacity, 2),
            "arrival_rps": round(rate, 2),
            "unloaded_ttft_p90_ms": unloaded_p90,
            "target": "queue-priority: high-priority TTFT p90 <= 2x unloaded p90, lost == 0",
            "rows": rows,
        },
    )
    print(f"wrote {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
