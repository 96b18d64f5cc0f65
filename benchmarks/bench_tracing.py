"""What distributed tracing costs the frontend: CPU-ms per request with tracing off, on but
sampled out, and on with every request traced and exported, in one run.

Two mocker workers (speedup 10000) and three round-robin frontends in front of them: one with no
OTLP endpoint (tracing off: nothing of OpenTelemetry imported), one with an endpoint and
`OTEL_TRACES_SAMPLER_ARG=0` (spans made but dropped), one at sample ratio 1.0 exporting over
OTLP/HTTP to a local receiver (tests/support/otlp.py, decoding every batch). The workers trace
too (they follow the frontend's sampling). The same streamed chat load (64 tokens, keep-alive,
concurrency 8) goes to each in turn, `--rounds` times in alternation so the shared machine's
drift falls on all three; each frontend's CPU comes from /proc (bench_frontend.measure).
Reported: the median CPU-ms per request of each and its ratio to off. /proc counts CPU in 10 ms
ticks on a shared machine, so a ratio moves by several percent between runs; what tracing off
adds to a request (its span sites, each a no-op) is also timed in-process, which does not.

    python benchmarks/bench_tracing.py --model .cache/tiny-model
Results: benchmarks/results/tracing.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from bench_frontend import STREAM_BODY, free_port, measure, start  # noqa: E402

from dynamo_graph.bench.provenance import provenance  # noqa: E402
from dynamo_graph.bench.report import write_json  # noqa: E402
from dynamo_graph.runtime import tracing  # noqa: E402
from dynamo_graph.runtime.context import Context  # noqa: E402
from tests.support.otlp import OtlpReceiver  # noqa: E402

# The span sites one streamed request passes while tracing is off: frontend (server, preprocess,
# the request-plane call), worker (generate).
SPAN_SITES = 4


def time_off_sites(n: int = 200_000) -> float:
    """Nanoseconds that one request's span sites cost with tracing off (each a no-op span)."""
    assert not tracing.ON
    context = Context("bench")
    clock = time.perf_counter_ns
    start_ns = clock()
    for _ in range(n):
        for _ in range(SPAN_SITES):
            with tracing.span("x", context) as span:
                span.set("k", 1)
    return (clock() - start_ns) / n


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=300, help="per load point")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tracing.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    receiver = OtlpReceiver()
    planes = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(scratch / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "PYTHONHASHSEED": "0",
    }
    traced = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    }
    variants = {
        "off": {},
        "on_sampled_out": {**traced, "OTEL_TRACES_SAMPLER_ARG": "0"},
        "on_exported": {**traced, "OTEL_TRACES_SAMPLER_ARG": "1.0"},
    }
    engine_args = scratch / "mocker.json"
    engine_args.write_text(json.dumps({"speedup_ratio": 10000, "block_size": 16, "num_gpu_blocks": 65536}))
    run = [sys.executable, "-m", "dynamo_graph", "run"]
    worker_argv = [*run, "in=dyn://bench.mocker.generate", "out=mocker", args.model]
    worker_argv += ["--model-name", "bench", "--extra-engine-args", str(engine_args)]
    worker_env = {**os.environ, **planes, **traced, "OTEL_TRACES_SAMPLER_ARG": "0", "DYN_LOG": "warn"}
    workers = [subprocess.Popen(worker_argv, env=worker_env, stdout=subprocess.DEVNULL) for _ in range(2)]
    frontends: dict[str, tuple[subprocess.Popen, int]] = {}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for name, otel in variants.items():
            port = free_port()
            argv = [*run, "in=http", "out=auto", "--http-port", str(port), "--router-mode", "round-robin"]
            frontends[name] = (start(argv, port, 0, {**planes, **otel}), port)
        names = list(frontends)
        load = {
            "concurrency": args.concurrency,
            "requests": args.requests,
            "keep_alive": True,
            "max_seconds": 60,
        }
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                proc, port = frontends[name]
                point = measure(proc.pid, port, STREAM_BODY, **load)
                assert point["ok"] == point["requests"], point
                ms = point["server_cpu_ms_per_request"]
                cpu[name].append(ms)
                print(f"{name:>16}: {ms:.3f} CPU-ms/request, {point['rps']} req/s", flush=True)
        time.sleep(1)  # the last batches reach the receiver
    finally:
        for proc, _ in frontends.values():
            proc.terminate()
        for worker in workers:
            worker.terminate()
        for proc in [*(p for p, _ in frontends.values()), *workers]:
            proc.wait(30)
        receiver.stop()
    off_ns = time_off_sites()
    median = {name: statistics.median(values) for name, values in cpu.items()}
    traces = {s.trace_id for s in receiver.spans}
    result = {
        "benchmark": "tracing_frontend_cpu",
        "provenance": provenance(),
        "load": {"concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds},
        "cpu_ms_per_request": cpu,
        "median_cpu_ms_per_request": median,
        "ratio_to_off": {name: round(value / median["off"], 3) for name, value in median.items()},
        "spans_received": len(receiver.spans),
        "traces_received": len(traces),
        "off_span_sites_ns_per_request": round(off_ns, 1),
        "off_span_sites_share_of_request_cpu": round(off_ns / (median["off"] * 1e6), 5),
    }
    print(json.dumps(result["ratio_to_off"]), f"({len(traces)} traces, {len(receiver.spans)} spans received)")
    print(f"tracing off: {off_ns:.0f} ns of span sites per request")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
