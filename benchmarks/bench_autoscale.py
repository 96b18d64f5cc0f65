"""What autoscaling buys: one load profile (open-loop streamed chats, low -> high -> low), run
against the same mocker pool three ways in one run — `autoscale` between min and max replicas,
static at min, static at max — and compared on SLA attainment (the share of requests whose
TTFT met the target), TTFT percentiles, replica-seconds and lost requests.

The mocker (`max_num_seqs: 2`, 60-token answers at speedup 1) makes a replica serve about 4
requests/s within a 250 ms TTFT target, so the profile's high phase needs about four.

    python benchmarks/bench_autoscale.py [--model .cache/tiny-model] [--phases 6:2,30:16,24:2]
        [--target-ms 250] [--min 1] [--max 4] [--router round-robin|random|kv]
        [--out benchmarks/results/autoscale.json]
Results: benchmarks/results/autoscale.json (+ autoscale.png with the plot extra)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from dynamo_graph.bench.loadgen import Target, run_open
from dynamo_graph.bench.plots import PlotsUnavailable, pyplot
from dynamo_graph.bench.provenance import git_of, provenance
from dynamo_graph.bench.replicas import ReplicaSampler, parse_phases, phased
from dynamo_graph.bench.stats import percentile
from dynamo_graph.graph.paths import state_dir

ROOT = Path(__file__).resolve().parents[1]
DYNGRAPH = [sys.executable, "-m", "dynamo_graph"]
MODEL = "tiny-model"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a long story about the sea"}],
    "max_tokens": 60,
    "stream": True,
    "nvext": {"ignore_eos": True},
}
ENGINE_ARGS = {"max_num_seqs": 2, "speedup_ratio": 1.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def graph(model: Path, port: int, replicas: int, autoscale: dict | None, router: str) -> dict:
    backend: dict = {
        "kind": "worker",
        "model": MODEL,
        "engine": "mocker",
        "replicas": replicas,
        "engine_args": ENGINE_ARGS,
    }
    if autoscale is not None:
        backend["autoscale"] = autoscale
    return {
        "name": "bench-autoscale",
        "models": {MODEL: {"path": str(model)}},
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": port}, "router": {"mode": router}},
            "backend": backend,
        },
    }


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DYNGRAPH, *args], capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )


def wait_serving(port: int, timeout_s: float = 60.0) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise SystemExit(f"the graph did not answer within {timeout_s:g} s")


def run_variant(
    name: str, spec: dict, folder: Path, phases: list[tuple[float, float]], target_ms: float
) -> dict:
    """Bring the graph up, send the profile, sample its replicas, bring it down."""
    file = folder / name / "graph.yaml"
    file.parent.mkdir(parents=True)
    file.write_text(yaml.safe_dump(spec, sort_keys=False))
    port = spec["components"]["frontend"]["http"]["port"]
    up = cli("up", "-d", str(file))
    if up.returncode != 0:
        raise SystemExit(f"{name}: up failed:\n{up.stdout}\n{up.stderr}")
    try:
        wait_serving(port)
        sampler = ReplicaSampler(state_dir(file), "backend")
        sampler.start()
        started = time.monotonic()
        target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=False)
        run = asyncio.run(run_open(target, phased(BODY, phases), max_seconds=sum(s for s, _ in phases) + 5))
        samples = sampler.stop()
    finally:
        cli("down", str(file))
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    met = sum(t <= target_ms for t in ttfts)
    figures = {
        "requests": len(run.results),
        "lost": len(run.results) - len(ok),
        "sla_attainment": round(met / len(run.results), 4) if run.results else 0.0,
        "ttft_ms": {q: round(percentile(ttfts, q), 1) for q in (50, 90, 99)},
        "replica_seconds": round(sampler.replica_seconds(), 1),
        "seconds": round(sampler.elapsed(), 1),
        "max_ready": max((n for _, n in samples), default=0),
        "replicas": [[round(t - started, 2), n] for t, n in samples],
        "ttft_by_start": [[round(r.start, 2), round(r.ttft * 1000, 1)] for r in ok],
    }
    print(
        f"{name:>12}: {figures['requests']} requests, {figures['lost']} lost, "
        f"SLA {figures['sla_attainment']:.1%}, TTFT p90 {figures['ttft_ms'][90]} ms, "
        f"{figures['replica_seconds']} replica-s (max {figures['max_ready']} ready)",
        flush=True,
    )
    return figures


def plot(
    results: dict[str, dict], phases: list[tuple[float, float]], target_ms: float, out: Path
) -> Path | None:
    try:
        plt = pyplot()
    except PlotsUnavailable as err:
        print(err)
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, figures in results.items():
        times, counts = zip(*figures["replicas"], strict=True) if figures["replicas"] else ((), ())
        top.step(times, counts, where="post", label=f"{name} ({figures['replica_seconds']} replica-s)")
        starts, ttfts = zip(*figures["ttft_by_start"], strict=True) if figures["ttft_by_start"] else ((), ())
        bottom.scatter(starts, ttfts, s=3, label=f"{name} (SLA {figures['sla_attainment']:.0%})")
    edge = 0.0
    for seconds, rate in phases:
        top.axvspan(edge, edge + seconds, alpha=0.08 * rate / max(r for _, r in phases), color="grey")
        edge += seconds
    bottom.axhline(target_ms, color="red", linewidth=1, label="TTFT target")
    top.set_ylabel("ready replicas")
    bottom.set_ylabel("TTFT (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds (shade: request rate)")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8, markerscale=3)
    fig.suptitle("autoscale vs static pools, one load profile")
    fig.tight_layout()
    fig.savefig(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=Path(os.environ.get("DYNGRAPH_TINY_MODEL", ROOT / ".cache/tiny-model"))
    )
    parser.add_argument("--phases", default="6:2,30:16,24:2", help="SECONDS:REQUESTS_PER_S,...")
    parser.add_argument("--target-ms", type=float, default=250.0)
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=4)
    parser.add_argument("--router", default="round-robin", choices=("round-robin", "random", "kv"))
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--scale-down-delay-s", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/autoscale.json")
    args = parser.parse_args()
    phases = parse_phases(args.phases)
    autoscale = {
        "min_replicas": args.min,
        "max_replicas": args.max,
        "target": {"ttft_p90_ms": args.target_ms},
        "interval_s": args.interval_s,
        "scale_down_delay_s": args.scale_down_delay_s,
    }
    variants = {
        "autoscale": (args.min, autoscale),
        f"static-{args.min}": (args.min, None),
        f"static-{args.max}": (args.max, None),
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        for name, (replicas, scale) in variants.items():
            spec = graph(args.model.resolve(), free_port(), replicas, scale, args.router)
            results[name] = run_variant(name, spec, Path(tmp), phases, args.target_ms)
    report = {
        "benchmark": "autoscale vs static pools on one load profile",
        **provenance(),
        "source": git_of(Path(__file__)),
        "config": {
            "graph": f"frontend (router {args.router}) + mocker pool; file discovery, tcp request plane",
            "engine_args": ENGINE_ARGS,
            "request": {"max_tokens": BODY["max_tokens"], "stream": True, "new_connections": True},
            "phases": [{"seconds": s, "requests_per_s": r} for s, r in phases],
            "ttft_target_ms": args.target_ms,
            "autoscale": autoscale,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")
    if (image := plot(results, phases, args.target_ms, args.out.with_suffix(".png"))) is not None:
        print(f"plot: {image}")


if __name__ == "__main__":
    main()
