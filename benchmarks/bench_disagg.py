"""Aggregated vs disaggregated serving on a mixed workload: does decode stop stalling behind long prefills?

    .venv/bin/python benchmarks/bench_disagg.py              # both deployments, ~2 minutes
    .venv/bin/python benchmarks/bench_disagg.py --seconds 20 --rate 3

Setup. Each deployment gets fresh processes on 127.0.0.1 over the embedded planes (file
discovery, tcp request plane, zmq events) and a frontend with kv routing:
- agg: `--workers` (4) mocker workers doing whole requests;
- disagg: half of them as prefill workers (`--disaggregation-mode prefill`), half as decode
  workers (`--disaggregation-mode decode`); prompts go to the prefill pool, their KV (simulated:
  `kv_bytes_per_token` bytes a token at `kv_transfer_gb_per_s`) to a decode worker.

Workload (seeded): open-loop Poisson arrivals at `--rate` (14) requests/s for `--seconds` (40);
a share `--long-share` (0.3) of them carry `--long-tokens` (6144) prompt tokens, the rest
`--short-tokens` (256); every prompt is distinct (no prefix reuse, so the comparison is about
where prefill runs, not cache hits); each asks for `--max-tokens` (128) tokens with ignore_eos.
Every request is sent as token ids to /v1/completions and streamed.

Mocker settings: `--speedup-ratio` 0.5 (passes take twice the perf model's time: ~12 ms a
decode step, ~250 ms a 6k-token prefill), chunked prefill with the default 8192-token budget,
so an aggregated worker's decode step that takes in a long prompt lasts as long as that
prefill: the stall disaggregation removes. `--num-gpu-blocks` 32768 keeps KV usage (which the
perf model's decode time grows with) low on both. Why this load: a stall shows in ITL p99 only
when more than 1% of all token gaps are stalled, i.e. long prompts x decoders per worker must be
frequent; at 3 requests/s on 4 workers, the stalls were 0.2% of gaps and p99 could not see them.

`--engine llamacpp` runs the same comparison with real llama.cpp workers on the tiny model's
GGUF (its 512-token context needs small prompts: see --help), where the KV really moves from the
prefill worker to the decode worker: the figures then show what the extra hop costs per request
(TTFT and end-to-end latency against the aggregated workers, KV bytes per transfer).

Measured per deployment: TTFT p50/p99, ITL p50/p99 (gaps between streamed tokens), output
tokens/s, errors; and the ratio disagg/agg of each, written to benchmarks/results/disagg.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import completion_body, free_port, stop

from dynamo_graph.bench.loadgen import Request, Run, Target, run_open
from dynamo_graph.bench.report import write_json
from dynamo_graph.bench.stats import percentile
from dynamo_graph.bench.stream import Result
from dynamo_graph.bench.workload import vocab_range

ROOT = Path(__file__).resolve().parents[1]


def mocker_settings(args: argparse.Namespace) -> dict:
    return {
        "block_size": 64,
        "num_gpu_blocks": args.num_gpu_blocks,
        "speedup_ratio": args.speedup_ratio,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "kv_transfer_gb_per_s": args.kv_transfer_gb_per_s,
    }


class Deployment:
    """A frontend and mocker workers (`prefill` of them as prefill workers), fresh planes."""

    def __init__(self, args: argparse.Namespace, name: str, prefill: int, run_dir: Path) -> None:
        self.name = name
        self.model = Path(args.model).name
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        planes = {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(run_dir / f"kv-{name}"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_LEASE_TTL": "2",
        }
        env = {**os.environ, **planes, "DYN_LOG": "warn"}
        engine_args = run_dir / f"{args.engine}.json"
        settings = mocker_settings(args) if args.engine == "mocker" else {"n_threads": 1}
        engine_args.write_text(json.dumps(settings))
        engine = [
            f"out={args.engine}",
            "--model-path",
            str(args.model),
            "--extra-engine-args",
            str(engine_args),
        ]
        if args.engine == "mocker":
            engine += ["--context-length", str(args.context_length)]
        decode_mode = "decode" if prefill else "agg"
        roles = ["prefill"] * prefill + [decode_mode] * (args.workers - prefill)
        try:
            for i, role in enumerate(roles):
                component = "prefill" if role == "prefill" else "backend"
                argv = [
                    sys.executable, "-m", "dynamo_graph", "run", f"in=dyn://bench.{component}.generate",
                    *engine, "--disaggregation-mode", role,
                ]  # fmt: skip
                log = (run_dir / f"{name}-{role}{i}.log").open("wb")
                self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
            frontend_argv = [
                sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=auto", "--router-mode", "kv",
                "--http-port", str(self.port),
                # llama.cpp publishes no KV events: the router predicts from its own decisions.
                "--use-kv-events", "true" if args.engine == "mocker" else "false",
            ]  # fmt: skip
            log = (run_dir / f"{name}-frontend.log").open("wb")
            self.frontend = subprocess.Popen(frontend_argv, env=env, stdout=log, stderr=log)
            self.procs.append(self.frontend)
            self._wait_ready(args.workers - prefill, prefill, 90.0)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, decode: int, prefill: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[:7]} exited with {proc.returncode}")
            try:
                health = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()
                details = health.get("details", {}).get(self.model) or {}
                if (
                    len(details.get("instances", [])) >= decode
                    and len(details.get("prefill_instances", [])) >= prefill
                ):
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: workers not discovered after {timeout}s")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        wanted = (
            "dynamo_frontend_disagg_prefill_total",
            "dynamo_frontend_kv_transfer_bytes_sum",
            "dynamo_frontend_kv_transfer_seconds_sum",
            "dynamo_frontend_kv_transfer_seconds_count",
        )
        out: dict[str, float] = {}
        for line in text.splitlines():
            for name in wanted:
                if line.startswith(name):
                    key = line.split(" ", 1)[0]
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)


def workload(args: argparse.Namespace, vocab: tuple[int, int]) -> list[tuple[float, list[int]]]:
    """(arrival time, prompt) for every request, the same for both deployments."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.seconds:
            return out
        n = args.long_tokens if rng.random() < args.long_share else args.short_tokens
        out.append((t, [rng.randrange(*vocab) for _ in range(n)]))


def run_load(port: int, model: str, plan: list[tuple[float, list[int]]], max_tokens: int) -> Run:
    """The plan's requests at their arrival times (open loop), each on its own connection."""
    target = Target("127.0.0.1", port, "/v1/completions", keep_alive=False)
    requests = [Request(completion_body(model, prompt, max_tokens), at) for at, prompt in plan]
    return asyncio.run(run_open(target, requests, max_seconds=float("inf"), request_timeout_s=120.0))


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    ms = 1000.0
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "first_errors": sorted({r.error for r in results if not r.ok})[:3],
        "ttft_p50_ms": round(percentile([r.ttft for r in ok], 50) * ms, 2),
        "ttft_p99_ms": round(percentile([r.ttft for r in ok], 99) * ms, 2),
        "itl_p50_ms": round(percentile(gaps, 50) * ms, 2),
        "itl_p99_ms": round(percentile(gaps, 99) * ms, 2),
        "itl_p999_ms": round(percentile(gaps, 99.9) * ms, 2),
        "itl_max_ms": round(max(gaps, default=0.0) * ms, 2),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0,
        "latency_p50_ms": round(percentile([r.total for r in ok], 50) * ms, 2),
    }


def run_deployment(args: argparse.Namespace, name: str, prefill: int, run_dir: Path, plan) -> dict:
    dep = Deployment(args, name, prefill, run_dir)
    try:
        warm = [(0.05 * i, p) for i, (_, p) in enumerate(plan[: args.workers])]
        run_load(dep.port, dep.model, warm, 4)  # imports, connections; not measured
        run = run_load(dep.port, dep.model, plan, args.max_tokens)
        return {**summarize(run.results, run.wall_s), "metrics": dep.metrics()}
    finally:
        dep.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument(
        "--engine",
        choices=("mocker", "llamacpp"),
        default="mocker",
        help="llamacpp: real KV transfer on the tiny model's GGUF (use small prompts: --long-tokens 384 "
        "--short-tokens 64 --max-tokens 32 --rate 2 --workers 2)",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=14.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--long-share", type=float, default=0.3)
    parser.add_argument("--long-tokens", type=int, default=6144)
    parser.add_argument("--short-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--num-gpu-blocks", type=int, default=32768)
    parser.add_argument("--speedup-ratio", type=float, default=0.5)
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072)
    parser.add_argument("--kv-transfer-gb-per-s", type=float, default=25.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/disagg[-ENGINE].json")
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.engine == "mocker" else f"-{args.engine}"
        args.out = str(ROOT / "benchmarks" / "results" / f"disagg{suffix}.json")
    vocab = vocab_range(Path(args.model))
    plan = workload(args, vocab)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    points = {}
    for name, prefill in (("agg", 0), ("disagg", args.workers // 2)):
        points[name] = run_deployment(args, name, prefill, run_dir, plan)
        p = points[name]
        print(
            f"{name:7s} ok {p['ok']}/{p['requests']}  "
            f"TTFT p50 {p['ttft_p50_ms']:8.1f} p99 {p['ttft_p99_ms']:8.1f} ms  "
            f"ITL p50 {p['itl_p50_ms']:6.1f} p99 {p['itl_p99_ms']:7.1f} ms  "
            f"{p['output_tokens_per_s']:7.1f} tok/s"
        )
    agg, dis = points["agg"], points["disagg"]
    ratios = {
        key: round(dis[key] / agg[key], 3) if agg[key] else None
        for key in (
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "output_tokens_per_s",
            "latency_p50_ms",
        )
    }
    print("disagg/agg: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))
    metrics = dis["metrics"]
    transfers = sum(
        v for k, v in metrics.items() if k.startswith("dynamo_frontend_kv_transfer_seconds_count")
    )
    moved = sum(v for k, v in metrics.items() if k.startswith("dynamo_frontend_kv_transfer_bytes_sum"))
    fetch_s = sum(v for k, v in metrics.items() if k.startswith("dynamo_frontend_kv_transfer_seconds_sum"))
    if transfers:
        dis["kv_bytes_per_transfer"] = round(moved / transfers)
        dis["kv_fetch_ms_per_transfer"] = round(fetch_s / transfers * 1000, 3)
        print(
            f"KV transfers {transfers:.0f}: {dis['kv_bytes_per_transfer']} bytes and "
            f"{dis['kv_fetch_ms_per_transfer']} ms (decode worker's fetch) each"
        )
    result = {
        "benchmark": "disagg",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "points": points,
        "disagg_over_agg": ratios,
    }
    print(f"wrote {write_json(Path(args.out), result)}")


if __name__ == "__main__":
    main()
