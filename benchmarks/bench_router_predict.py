"""Routing under load (issue 17): random, round-robin, Dynamo's cost and the predictive cost, in one run.

    .venv/bin/python benchmarks/bench_router_predict.py                       # the default matrix
    .venv/bin/python benchmarks/bench_router_predict.py --workloads prefix32x4k --workers 2 --concurrency 8

Every point (workload, workers, concurrency, mode) runs on fresh processes (bench_routing.py's
`Deployment`: mocker workers and one frontend on 127.0.0.1, file discovery, tcp, zmq KV events),
so caches and the router start cold. Modes: `random`, `round-robin`, `kv-dynamo` (kv routing
with `--router-cost dynamo`) and `kv` (kv routing with the default predictive cost).

Workloads (seeded; prompts are token ids sent to /v1/completions, streamed, `ignore_eos`):

- `prefixPxL` (e.g. prefix32x4k): P shared prefixes of L tokens; each request is one prefix
  (drawn uniformly) + a unique suffix of `--suffix-tokens` (+-50%), `--output-tokens` (+-50%)
  out. `--requests` requests, `c` clients back to back (closed loop); c=1 runs `--c1-requests`.
- `multiturn`: bench_routing.py's conversations over shared documents (16 documents of 4k
  tokens, 4 conversations each, 8 turns), `c` conversations at once.

Reported per point: TTFT mean/p50/p90, the cached-token fraction (usage.cached_tokens over
prompt tokens) and the share of the oracle's cache hits reached. The oracle is one worker with
an unbounded cache that has seen every earlier request: a request's oracle hit is the longest
full-block prefix it shares with any request sent before it (for single-turn prompts: its
prefix, unless it is the prefix's first use). Its hits are what routing could recover at best.
Targets (the issue's): at c=8, mean TTFT >= 1.25x better than round-robin and >= 85% of the
oracle's hits, p90 never worse than round-robin's; at c=1, the oracle's hits.

Mocker settings: block size 64, `--num-gpu-blocks` (1024) per worker, `--speedup-ratio` (3): a
4k-token prefill takes ~30 ms of wall time. Results: benchmarks/results/router_predict.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import (  # noqa: E402
    Conversation,
    Deployment,
    make_conversations,
    mocker_settings,
    run_point,
    summarize,
    vary,
    vocab_range,
    warm_up,
)

from dynamo_graph.bench.report import write_json  # noqa: E402
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes  # noqa: E402

MODES = ("random", "round-robin", "kv-dynamo", "kv")
_PREFIX = re.compile(r"prefix(\d+)x(\d+)(k?)")


def prefix_workload(
    args: argparse.Namespace, name: str, c: int, vocab: tuple[int, int]
) -> list[Conversation]:
    match = _PREFIX.fullmatch(name)
    if match is None:
        raise SystemExit(f"unknown workload {name!r}: prefixPxL (e.g. prefix32x4k) or multiturn")
    count, length = int(match.group(1)), int(match.group(2)) * (1024 if match.group(3) else 1)
    rng = random.Random(f"{args.seed}:{name}:{c}")
    low, high = vocab

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefixes = [ids(length) for _ in range(count)]
    n = args.c1_requests if c == 1 else args.requests
    convs = []
    for i in range(n):
        doc = rng.randrange(count)
        prompt = prefixes[doc] + ids(vary(rng, args.suffix_tokens))
        convs.append(Conversation(i, doc, [prompt], [vary(rng, args.output_tokens)]))
    return convs


def oracle_hits(convs: list[Conversation], done: set[tuple[int, int]], block_size: int) -> int:
    """Cached tokens of one unbounded cache that has seen every earlier request (send order:
    conversations in list order, each one's turns in order)."""
    seen: set[int] = set()
    hits = 0
    for conv in convs:
        for turn, prompt in enumerate(conv.prompts):
            if (conv.index, turn) not in done:
                continue
            seq = sequence_hashes(local_block_hashes(prompt, block_size))
            depth = 0
            while depth < len(seq) and seq[depth] in seen:
                depth += 1
            hits += depth * block_size
            seen.update(seq)
    return hits


def run_one(
    args: argparse.Namespace,
    workload: str,
    workers: int,
    c: int,
    mode: str,
    run_dir: Path,
    vocab: tuple[int, int],
) -> dict:
    point_args = argparse.Namespace(**{**vars(args), "workers": workers})
    if workload == "multiturn":
        convs = make_conversations(point_args, c, vocab)
        if c == 1:
            convs = convs[: args.c1_conversations]
    else:
        convs = prefix_workload(args, workload, c, vocab)
    point_dir = run_dir / f"{workload}-w{workers}"
    point_dir.mkdir(exist_ok=True)
    dep = Deployment(point_args, mode, c, point_dir)
    try:
        warm_up(dep, point_args, vocab)
        results, wall = asyncio.run(run_point(dep.port, dep.model, convs, c, args.max_seconds))
    finally:
        dep.close()
    ok = [r for r in results if r.ok]
    oracle = oracle_hits(convs, {(r.conv, r.turn) for r in ok}, args.block_size)
    summary = summarize(results, wall)
    row = {
        "workload": workload,
        "workers": workers,
        "concurrency": c,
        "mode": mode,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "ttft_mean_ms": summary["ttft_mean_ms"],
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p90_ms": summary["ttft_p90_ms"],
        "cached_fraction": summary["cache_hit_rate"],
        "oracle_cached_fraction": round(oracle / summary["prompt_tokens"], 3)
        if summary["prompt_tokens"]
        else 0,
        "oracle_share": round(summary["cached_tokens"] / oracle, 3) if oracle else None,
        "wall_s": summary["wall_s"],
    }
    print(json.dumps(row), flush=True)
    return row


def compare(rows: list[dict]) -> list[dict]:
    """Per (workload, workers, c): each kv mode against round-robin, and the targets at c=8."""
    out = []
    for row in rows:
        if not row["mode"].startswith("kv"):
            continue
        rr = next(
            (
                r
                for r in rows
                if r["mode"] == "round-robin"
                and (r["workload"], r["workers"], r["concurrency"])
                == (row["workload"], row["workers"], row["concurrency"])
            ),
            None,
        )
        if rr is None or not row["ttft_mean_ms"]:
            continue
        entry = {
            "workload": row["workload"],
            "workers": row["workers"],
            "concurrency": row["concurrency"],
            "mode": row["mode"],
            "rr_over_mode_ttft_mean": round(rr["ttft_mean_ms"] / row["ttft_mean_ms"], 2),
            "rr_over_mode_ttft_p90": round(rr["ttft_p90_ms"] / row["ttft_p90_ms"], 2)
            if row["ttft_p90_ms"]
            else None,
            "oracle_share": row["oracle_share"],
        }
        if row["concurrency"] == 8:
            entry["meets_c8_targets"] = bool(
                entry["rr_over_mode_ttft_mean"] >= 1.25
                and (row["oracle_share"] or 0) >= 0.85
                and row["ttft_p90_ms"] <= rr["ttft_p90_ms"]
            )
        out.append(entry)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--workloads", default="prefix32x4k,prefix8x1k,multiturn")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--requests", type=int, default=192, help="per point, prefix workloads")
    parser.add_argument("--c1-requests", type=int, default=48)
    parser.add_argument("--suffix-tokens", type=int, default=64, help="mean unique suffix (+-50%%)")
    parser.add_argument("--output-tokens", type=int, default=32, help="mean output (+-50%%)")
    # multiturn (bench_routing.py's workload)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--convs-per-doc", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--c1-conversations", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=1024)
    parser.add_argument("--speedup-ratio", type=float, default=3.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="no new request after this, per point"
    )
    parser.add_argument("--router-debug", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_predict.json"))
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    vocab = vocab_range(Path(args.model))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-router-predict-"))
    rows: list[dict] = []
    try:
        for workload in workloads:
            for w in workers:
                for c in concurrency:
                    for mode in modes:
                        rows.append(run_one(args, workload, w, c, mode, run_dir, vocab))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    comparison = compare(rows)
    for entry in comparison:
        print(json.dumps(entry))
    saved = write_json(
        Path(args.out),
        {
            "benchmark": "router_predict",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {
                "mocker": mocker_settings(args),
                "requests": args.requests,
                "c1_requests": args.c1_requests,
                "suffix_tokens": args.suffix_tokens,
                "output_tokens": args.output_tokens,
                "max_seconds_per_point": args.max_seconds,
                "seed": args.seed,
            },
            "targets": "c=8: rr/kv TTFT mean >= 1.25, oracle share >= 0.85, p90 <= rr's; c=1: oracle hits",
            "rows": rows,
            "comparison": comparison,
        },
    )
    print(f"wrote {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
