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

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import bench_frontend as compare  # noqa: E402

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
    args = compare.variants_args(__doc__ or "", "tracing.json")
    scratch = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    receiver = OtlpReceiver()
    planes = compare.embedded_planes(scratch)
    traced = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    }
    variants = {
        "off": {},
        "on_sampled_out": {**traced, "OTEL_TRACES_SAMPLER_ARG": "0"},
        "on_exported": {**traced, "OTEL_TRACES_SAMPLER_ARG": "1.0"},
    }
    # The workers follow the frontend's decision (parent-based sampling), exporting what it keeps.
    workers = compare.mocker_workers(
        args.model, scratch, {**planes, **traced, "OTEL_TRACES_SAMPLER_ARG": "0"}
    )
    run = [sys.executable, "-m", "dynamo_graph", "run"]
    frontends: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name, otel in variants.items():
            port = compare.free_port()
            argv = [*run, "in=http", "out=auto", "--http-port", str(port), "--router-mode", "round-robin"]
            frontends[name] = (compare.start(argv, port, 0, {**planes, **otel}), port)
        load = {"concurrency": args.concurrency, "requests": args.requests, "keep_alive": True}
        cpu = compare.alternate(frontends, compare.STREAM_BODY, args.rounds, max_seconds=60, **load)
        time.sleep(1)  # the last batches reach the receiver
    finally:
        compare.stop_all([*(p for p, _ in frontends.values()), *workers])
        receiver.stop()
    off_ns = time_off_sites()
    traces = {s.trace_id for s in receiver.spans}
    result = compare.variants_result("tracing_frontend_cpu", args, cpu)
    off_ms = result["median_cpu_ms_per_request"]["off"]
    result |= {
        "spans_received": len(receiver.spans),
        "traces_received": len(traces),
        "off_span_sites_ns_per_request": round(off_ns, 1),
        "off_span_sites_share_of_request_cpu": round(off_ns / (off_ms * 1e6), 5),
    }
    print(json.dumps(result["ratio_to_off"]), f"({len(traces)} traces, {len(receiver.spans)} spans received)")
    print(f"tracing off: {off_ns:.0f} ns of span sites per request")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
