"""What the routing decision log (and the request recording) cost the frontend: CPU-ms per
request with them on against off, in one run.

Two mocker workers (speedup 10000, KV events on zmq) and three kv-routing frontends in front of
them: one plain, one with `--router-decision-log`, one with that and `--record`. The same
streamed chat load (64 tokens, keep-alive, concurrency 8) goes to each in turn, `--rounds` times
in alternation so that the shared machine's drift falls on all three; each frontend's CPU comes
from /proc (bench_frontend.measure). Reported: the median CPU-ms per request of each, and the
ratio of the logging ones to the plain one.

    python benchmarks/bench_decision_log.py --model .cache/tiny-model
Results: benchmarks/results/decision_log.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import STREAM_BODY, free_port, measure, start

from dynamo_graph.bench.provenance import provenance
from dynamo_graph.bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=300, help="per load point")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decision_log.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-decisions-"))
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(scratch / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "PYTHONHASHSEED": "0",
    }
    engine_args = scratch / "mocker.json"
    engine_args.write_text(json.dumps({"speedup_ratio": 10000, "block_size": 16, "num_gpu_blocks": 65536}))
    run = [sys.executable, "-m", "dynamo_graph", "run"]
    worker_argv = [*run, "in=dyn://bench.mocker.generate", "out=mocker", args.model]
    worker_argv += ["--model-name", "bench", "--extra-engine-args", str(engine_args)]
    workers = [
        subprocess.Popen(worker_argv, env={**os.environ, **env, "DYN_LOG": "warn"}, stdout=subprocess.DEVNULL)
        for _ in range(2)
    ]
    variants = {
        "off": [],
        "decision_log": ["--router-decision-log", str(scratch / "decisions.jsonl")],
        "decision_log_and_record": [
            "--router-decision-log",
            str(scratch / "decisions2.jsonl"),
            "--record",
            str(scratch / "recorded.jsonl"),
        ],
    }
    frontends: dict[str, tuple[subprocess.Popen, int]] = {}
    body = STREAM_BODY
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for name, extra in variants.items():
            port = free_port()
            argv = [*run, "in=http", "out=auto", "--http-port", str(port), "--router-mode", "kv", *extra]
            frontends[name] = (start(argv, port, 0, env), port)
        for _ in range(args.rounds):
            for name, (proc, port) in frontends.items():
                point = measure(
                    proc.pid,
                    port,
                    body,
                    concurrency=args.concurrency,
                    requests=args.requests,
                    keep_alive=True,
                    max_seconds=60,
                )
                assert point["ok"] == point["requests"], point
                cpu[name].append(point["server_cpu_ms_per_request"])
                ms = point["server_cpu_ms_per_request"]
                print(f"{name:>24}: {ms:.3f} CPU-ms/request, {point['rps']} req/s")
    finally:
        for proc, _ in frontends.values():
            proc.terminate()
        for worker in workers:
            worker.terminate()
        for proc in [*(p for p, _ in frontends.values()), *workers]:
            proc.wait(30)
    logged = sum(1 for _ in (scratch / "decisions.jsonl").open())
    median = {name: statistics.median(values) for name, values in cpu.items()}
    result = {
        "benchmark": "decision_log_frontend_cpu",
        "provenance": provenance(),
        "load": {"concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds},
        "cpu_ms_per_request": cpu,
        "median_cpu_ms_per_request": median,
        "ratio_to_off": {name: round(value / median["off"], 3) for name, value in median.items()},
        "decision_lines_written": logged,
    }
    print(json.dumps(result["ratio_to_off"]), f"({logged} decision lines)")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
