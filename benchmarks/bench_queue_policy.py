"""The router queue's order on a backlog of mixed prompt lengths (issue 17): fcfs, priority, wspt.

    .venv/bin/python benchmarks/bench_queue_policy.py            # ~2 minutes

Fresh processes per setting (bench_routing.py's `Deployment`: `--workers` mocker workers and one
kv-routing frontend on 127.0.0.1). A backlog arrives at once, in a shuffled order, a few ms
apart: `--requests` unique random prompts (no prefix sharing), `--long-share` of them
`--long-tokens` long, the rest `--short-tokens`; `--output-tokens` out, streamed from
/v1/completions, no priorities. Settings: `no-queue` (every request goes straight to a worker,
whose own scheduler takes them in arrival order) and one per `--router-queue-policy`, with
`--router-queue-threshold` `--threshold` (a fraction of each worker's max_num_batched_tokens).

Per setting: TTFT mean, p50 and p90 of all requests, and the mean of the short and the long
ones, and the ratio of fcfs's mean TTFT to the setting's, measured in the same run (wspt serves
the most uncached tokens' worth of waiting per token first: by Smith's rule the mean falls, and
the long prompts wait longer). Results: benchmarks/results/queue_policy.json.
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
from statistics import fmean

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

SETTINGS = ("no-queue", "fcfs", "priority", "wspt")
BASELINE = "fcfs"


def backlog(args: argparse.Namespace, vocab: tuple[int, int]) -> list[list[int]]:
    """The same prompts, in the same order, for every setting."""
    rng = random.Random(args.seed)
    longs = round(args.requests * args.long_share)
    lengths = [args.long_tokens] * longs + [args.short_tokens] * (args.requests - longs)
    rng.shuffle(lengths)
    return [[rng.randrange(*vocab) for _ in range(n)] for n in lengths]


async def burst(dep: Deployment, args: argparse.Namespace, prompts: list[list[int]]) -> list[TurnResult]:
    target = Target("127.0.0.1", dep.port, "/v1/completions")
    conns = Connections(target)
    clock0 = time.perf_counter()
    results, tasks = [], []
    for i, prompt in enumerate(prompts):
        result = TurnResult(i)
        results.append(result)
        wire = encode_request(target, completion_body(dep.model, prompt, args.output_tokens))
        tasks.append(asyncio.create_task(send(conns, wire, result, clock0, args.request_timeout)))
        await asyncio.sleep(args.stagger_ms / 1000)
    await asyncio.gather(*tasks)
    conns.close()
    return results


def summarize(
    setting: str, prompts: list[list[int]], results: list[TurnResult], args: argparse.Namespace
) -> dict:
    failed = [r.error for r in results if not r.ok]
    ttft = {"all": [], "short": [], "long": []}
    for prompt, result in zip(prompts, results, strict=True):
        if result.ok:
            ttft["all"].append(result.ttft)
            ttft["long" if len(prompt) == args.long_tokens else "short"].append(result.ttft)
    row: dict = {"setting": setting, "requests": len(results), "failed": len(failed), "errors": failed[:3]}
    for name, values in ttft.items():
        row[f"{name}_ttft_mean_ms"] = round(fmean(values) * 1000, 1) if values else None
    row["ttft_p50_ms"] = round(percentile(ttft["all"], 50) * 1000, 1) if ttft["all"] else None
    row["ttft_p90_ms"] = round(percentile(ttft["all"], 90) * 1000, 1) if ttft["all"] else None
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--long-tokens", type=int, default=6144)
    parser.add_argument("--short-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--stagger-ms", type=float, default=3.0, help="between arrivals of the backlog")
    parser.add_argument("--threshold", type=float, default=0.0, help="--router-queue-threshold (fraction)")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=8192)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument("--router-debug", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "queue_policy.json"))
    args = parser.parse_args()
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: {', '.join(unknown)} not among {', '.join(SETTINGS)}")
    vocab = vocab_range(Path(args.model))
    prompts = backlog(args, vocab)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-queue-policy-"))
    rows = []
    try:
        for setting in settings:
            point = argparse.Namespace(**vars(args))
            point.kv_router_args = []
            if setting != "no-queue":
                point.kv_router_args = [
                    "--router-queue-threshold", f"{args.threshold:g}",
                    "--router-queue-policy", setting,
                    "--router-max-queue-size", str(4 * args.requests),
                ]  # fmt: skip
            point_dir = run_dir / setting
            point_dir.mkdir()
            dep = Deployment(point, "kv", 0, point_dir)
            try:
                warm_up(dep, point, vocab)
                results = asyncio.run(burst(dep, args, prompts))
            finally:
                dep.close()
            rows.append(summarize(setting, prompts, results, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    base = next((r for r in rows if r["setting"] == BASELINE and r["all_ttft_mean_ms"]), None)
    for row in rows:
        mean = row["all_ttft_mean_ms"]
        row[f"{BASELINE}_mean_over_this"] = (
            round(base["all_ttft_mean_ms"] / mean, 2) if base and mean else None
        )
    saved = write_json(
        Path(args.out),
        {
            "benchmark": "queue_policy",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {
                "workers": args.workers,
                "mocker": mocker_settings(args),
                "requests": args.requests,
                "long_share": args.long_share,
                "long_tokens": args.long_tokens,
                "short_tokens": args.short_tokens,
                "output_tokens": args.output_tokens,
                "threshold": args.threshold,
            },
            "rows": rows,
        },
    )
    for row in rows:
        print(
            f"{row['setting']:>9}: mean {row['all_ttft_mean_ms']} ms (short {row['short_ttft_mean_ms']}, "
            f"long {row['long_ttft_mean_ms']}), p90 {row['ttft_p90_ms']} ms, "
            f"{BASELINE}/this {row[f'{BASELINE}_mean_over_this']}, failed {row['failed']}"
        )
    print(f"wrote {saved}")
    return 0 if all(not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
