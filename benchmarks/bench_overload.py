"""Overload (issue 17): 1.5x the request rate the workers sustain, 20% of requests high priority.

    .venv/bin/python benchmarks/bench_overload.py                        # ~5 minutes
    .venv/bin/python benchmarks/bench_overload.py --repeats 3 --threshold 0,0.5

Fresh processes per phase (bench_routing.py's `Deployment`: `--workers` mocker workers and one
kv-routing frontend on 127.0.0.1). Requests: unique random prompts of `--prompt-tokens` token
ids (no prefix sharing, so routing cannot help), `--output-tokens` out, streamed from
/v1/completions; high-priority ones carry `x-dynamo-request-priority: 10`.

1. Capacity: a closed loop of `--capacity-concurrency` clients for `--capacity-seconds`; the
   completed requests per second are the sustainable rate R.
2. Unloaded TTFT: `--unloaded-requests` requests one at a time; its p90 is the reference.
3. Overload, one deployment per setting: Poisson arrivals at `--overload` x R (1.5) for
   `--seconds`, each request high priority with probability `--high-share` (0.2). A setting is
   the frontend's router queue and the workers' scheduling policy (the mocker's
   `scheduling_policy`, as vLLM's):

   | setting | router queue | workers |
   |---|---|---|
   | no-queue | none: every request goes straight to a worker | fcfs |
   | queue-fcfs | fcfs | fcfs |
   | queue-priority | priority | fcfs |
   | engine-priority | none | priority (our workers' default) |
   | queue+engine-priority | priority | priority |
   | queue-reserve | priority, `--router-queue-reserve` `--reserve` (1) | priority |

   The first three are the settings before engines scheduled by priority, kept for comparison.
   A router queue runs with --router-queue-threshold set to each value of `--threshold` (a
   comma-separated list of fractions of the mocker's max_num_batched_tokens, as Dynamo's) and
   --router-max-queue-size `--max-queue`.

`--repeats N` runs all of it N times (each run measures its own capacity and unloaded TTFT).
`--max-num-batched-tokens` sets the mocker's token budget per forward pass (its default 8192).

Per setting: completed, refused (529 or 503 before any output: the client may retry) and lost
(anything else: an error mid-stream, a timeout, a dropped connection) requests; TTFT p50/p90 of
high- and low-priority requests, and high-priority p90 / unloaded p90 (target: <= 2 in every
run, with nothing lost), and the machine's load average before each point.
Results: benchmarks/results/overload.json.

Findings (`--repeats 3 --threshold 0,0.5`; measured when the threshold counted prompt tokens, as
0 and 4096, which are the same backlogs as the fractions 0 and 0.5 of 8192; unloaded
p90 89-98 ms; nothing lost anywhere): high-priority p90 / unloaded p90 was 35-45x without a
queue; 5.5x, 5.5x, 11.6x with engine priority alone (an urgent request is admitted at the next
pass, but shares it with the running prompts' chunks, which vLLM schedules first, in passes of up
to 8192 tokens: ~185 ms); 2.12x, 2.25x, 6.44x with the router's priority queue at threshold 0
and 2.39x, 2.30x, 5.55x with engine priority added (at threshold 0 the workers hold no waiting
requests, so engine priority has nothing to reorder); ~3.3x at threshold 0.5. The third run
overlapped other jobs on the 2 cores (load average 4-5.6). Why ~2x is the floor here: with the
queue, an urgent request waits for the sooner of the two workers to end its prefill pass (~100
ms a pass; p90 of the sooner ~68 ms), then takes its own pass, which under load also costs the
decode of every running sequence (~15 ms): 68 + 86 + 15 + ~8 ms of serving = ~177 ms = 1.9x the
unloaded ~94 ms before any CPU contention. A forward pass cannot be preempted (vLLM's semantics).
What-ifs: `--max-num-batched-tokens 2048` 2.73x (overload_mnbt2048.json: two passes, each with
the decode cost, and a lower capacity), `--workers 4` 2.16x (overload_w4.json: the sooner of
four ends earlier, but the frontend's CPU at 39 req/s eats it on 2 cores). Reserving a worker's
prefill slot for urgent requests would take the wait out: that is `--router-queue-reserve`.

With it (`--settings queue+engine-priority,queue-reserve --threshold 0 --repeats 2`,
results/overload_reserve.json, unloaded p90 ~90 ms): high-priority p90 1.48x and 1.40x the
unloaded (p50 102-103 ms), against 2.35x and 2.27x without it in the same runs; nothing lost.
The price: one of the two workers takes no ordinary prefill while the queue is full, so 304-305
requests completed instead of 397-398 and 173-174 of ~478 were answered 529 (79-82 without).
With the reserve held only while urgent requests come (as it is now): 1.58x in one more run
(results/overload_reserve_window.json).
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
# setting -> (the frontend's --router-queue-policy, or None for no router queue; the workers'
# scheduling_policy)
SETTINGS: dict[str, tuple[str | None, str]] = {
    "no-queue": (None, "fcfs"),
    "queue-fcfs": ("fcfs", "fcfs"),
    "queue-priority": ("priority", "fcfs"),
    "engine-priority": (None, "priority"),
    "queue+engine-priority": ("priority", "priority"),
    "queue-reserve": ("priority", "priority"),  # and --router-queue-reserve `--reserve`
}


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


def deployment(
    args: argparse.Namespace,
    setting: str,
    threshold: str | None,
    run_dir: Path,
    vocab: tuple[int, int],
) -> Deployment:
    queue, engine = SETTINGS[setting]
    point = argparse.Namespace(**vars(args))
    point.scheduling_policy = engine
    point.kv_router_args = []
    if queue is not None:
        point.kv_router_args = [
            "--router-queue-threshold", str(threshold),
            "--router-max-queue-size", str(args.max_queue),
            "--router-queue-policy", queue,
        ]  # fmt: skip
    if setting == "queue-reserve":
        point.kv_router_args += ["--router-queue-reserve", str(args.reserve)]
    point_dir = run_dir / (setting if threshold is None else f"{setting}@{threshold}")
    point_dir.mkdir()
    dep = Deployment(point, "kv", 0, point_dir)
    warm_up(dep, point, vocab)
    return dep


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1) if values else 0.0


def summarize(
    setting: str, threshold: str | None, results: list[tuple[bool, TurnResult]], unloaded_p90: float
) -> dict:
    refused = [r for _, r in results if r.error.startswith(("HTTP 529", "HTTP 503"))]
    ok = [(h, r) for h, r in results if r.ok]
    lost = len(results) - len(ok) - len(refused)
    high = [r.ttft for h, r in ok if h]
    low = [r.ttft for h, r in ok if not h]
    high_p90 = ms(high, 90)
    queue, engine = SETTINGS[setting]
    return {
        "setting": setting,
        "router_queue": queue,
        "threshold": threshold,
        "engine_policy": engine,
        "requests": len(results),
        "completed": len(ok),
        "refused_529_503": len(refused),
        "lost": lost,
        "lost_examples": sorted({r.error[:120] for _, r in results if not r.ok and r not in refused})[:3],
        "high_completed": len(high),
        "high_ttft_p50_ms": ms(high, 50),
        "high_ttft_p90_ms": high_p90,
        "high_ttft_p99_ms": ms(high, 99),
        "low_ttft_p50_ms": ms(low, 50),
        "low_ttft_p90_ms": ms(low, 90),
        "high_p90_over_unloaded_p90": round(high_p90 / unloaded_p90, 2) if unloaded_p90 else None,
    }


def reference(args: argparse.Namespace, run_dir: Path, vocab: tuple[int, int]) -> tuple[float, list[float]]:
    """(sustainable requests per second, unloaded TTFTs) on one fresh deployment."""
    (run_dir / "reference").mkdir()
    dep = deployment(args, "engine-priority", None, run_dir / "reference", vocab)
    try:
        prompts = Prompts(args, vocab, "unloaded")
        unloaded = asyncio.run(sequential(dep, args, prompts, args.unloaded_requests))
        capacity = asyncio.run(
            closed_loop(
                dep, args, Prompts(args, vocab, "capacity"), args.capacity_concurrency, args.capacity_seconds
            )
        )
    finally:
        dep.close()
    return capacity, unloaded


def points(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(setting, router queue threshold) in run order: each queued setting at every threshold."""
    thresholds = [t.strip() for t in args.threshold.split(",") if t.strip()]
    out: list[tuple[str, str | None]] = []
    for setting in args.settings.split(","):
        if SETTINGS[setting][0] is None:
            out.append((setting, None))
        else:
            out += [(setting, t) for t in thresholds]
    return out


def one_run(args: argparse.Namespace, run: int, vocab: tuple[int, int]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    try:
        load_before = round(os.getloadavg()[0], 2)
        capacity, unloaded = reference(args, run_dir, vocab)
        unloaded_p90 = ms(unloaded, 90)
        rate = args.overload * capacity
        head = {
            "run": run,
            "capacity_rps": round(capacity, 2),
            "arrival_rps": round(rate, 2),
            "unloaded_ttft_p50_ms": ms(unloaded, 50),
            "unloaded_ttft_p90_ms": unloaded_p90,
            "loadavg_1m_before": load_before,
        }
        print(json.dumps(head), flush=True)
        rows = []
        for setting, threshold in points(args):
            load = round(os.getloadavg()[0], 2)
            dep = deployment(args, setting, threshold, run_dir, vocab)
            try:
                results = asyncio.run(open_loop(dep, args, Prompts(args, vocab, "overload"), rate))
            finally:
                dep.close()
            rows.append({**summarize(setting, threshold, results, unloaded_p90), "loadavg_1m_before": load})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**head, "rows": rows}


def verdicts(runs: list[dict]) -> dict[str, dict]:
    """Per setting@threshold: the high-priority p90 ratio of every run and whether the target
    (<= 2, nothing lost) held in all of them."""
    out: dict[str, dict] = {}
    for run in runs:
        for row in run["rows"]:
            name = row["setting"] if row["threshold"] is None else f"{row['setting']}@{row['threshold']}"
            entry = out.setdefault(name, {"ratios": [], "lost": [], "refused": []})
            entry["ratios"].append(row["high_p90_over_unloaded_p90"])
            entry["lost"].append(row["lost"])
            entry["refused"].append(row["refused_529_503"])
    for entry in out.values():
        entry["target_met_every_run"] = all(
            r is not None and r <= 2.0 and lost == 0
            for r, lost in zip(entry["ratios"], entry["lost"], strict=True)
        )
    return out


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
    parser.add_argument(
        "--threshold",
        default="0",
        help="--router-queue-threshold value(s): fractions of max_num_batched_tokens, comma-separated",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="--router-max-queue-size")
    parser.add_argument("--reserve", type=int, default=1, help="--router-queue-reserve of queue-reserve")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=1, help="whole runs, each with its own reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="mocker; default 8192")
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument("--router-debug", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overload.json"))
    args = parser.parse_args()
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    vocab = vocab_range(Path(args.model))
    runs = [one_run(args, run, vocab) for run in range(args.repeats)]
    summary = verdicts(runs)
    print(json.dumps(summary), flush=True)
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
                "router_queue_thresholds": args.threshold,
                "max_queue": args.max_queue,
            },
            "target": "high-priority TTFT p90 <= 2x unloaded p90 in every run, lost == 0",
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"wrote {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
