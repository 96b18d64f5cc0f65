"""What the request plane adds: frontend -> one echo_core worker (delay 0) over tcp and over nats,
against the in-process echo of `dyngraph run in=http out=echo_core` in the same run.

Streamed chat, 64 output tokens, keep-alive, concurrency 1/32/128. Reports requests/s, TTFT
(p50/p99), total latency, and CPU-ms per request of the frontend, the worker and nats-server.

    python benchmarks/bench_request_plane.py --model .cache/tiny-model
Results: benchmarks/results/request_plane.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import STREAM_BODY, free_port, measure

ROOT = Path(__file__).resolve().parents[1]
DYNGRAPH = [sys.executable, "-m", "dynamo_graph", "run"]


def start_nats(tmp: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("nats-server")
    if exe is None:
        raise SystemExit("nats-server is not installed (apt-get install nats-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(0.3)
    return proc, f"nats://127.0.0.1:{port}"


def wait_for_model(port: int, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).json()["data"]
            if any(m["id"] == name for m in models):
                return
        except (httpx.TransportError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the frontend never listed the model")


def run_topology(
    topology: str, args: argparse.Namespace, body: dict, levels: list[int], tmp: Path
) -> list[dict]:
    env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0", "DYN_LOG": "warn", "DYN_FILE_KV": str(tmp / "kv")}
    procs: dict[str, subprocess.Popen] = {}
    port = free_port()
    try:
        if topology == "in_process":
            procs["server"] = subprocess.Popen(
                [
                    *DYNGRAPH,
                    "in=http",
                    "out=echo_core",
                    args.model,
                    "--model-name",
                    "bench",
                    "--http-port",
                    str(port),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            plane = topology.removeprefix("worker_")
            env["DYN_REQUEST_PLANE"] = plane
            if plane == "nats":
                procs["nats"], env["NATS_SERVER"] = start_nats(tmp)
            procs["worker"] = subprocess.Popen(
                [
                    *DYNGRAPH,
                    "in=dyn://bench.backend.generate",
                    "out=echo_core",
                    args.model,
                    "--model-name",
                    "bench",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs["server"] = subprocess.Popen(
                [*DYNGRAPH, "in=http", "out=auto", "--http-port", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        wait_for_model(port, "bench")
        extra = {name: p.pid for name, p in procs.items() if name != "server"}
        rows = []
        for c in levels:
            n = args.requests // 3 if c == 1 else args.requests
            row = {
                "topology": topology,
                **measure(
                    procs["server"].pid,
                    port,
                    body,
                    concurrency=c,
                    requests=n,
                    keep_alive=True,
                    max_seconds=args.max_seconds,
                    extra_pids=extra,
                ),
            }
            row["total_cpu_ms_per_request"] = round(
                sum(v for k, v in row.items() if k.endswith("_cpu_ms_per_request")), 3
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        for proc in reversed(list(procs.values())):
            proc.terminate()
            proc.wait(timeout=15)


def load_arguments(
    description: str | None, *, concurrency: str, requests: int, max_seconds: float, out: str
) -> argparse.ArgumentParser:
    """The options of a frontend -> worker load run (this benchmark's and bench_tls.py's)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default=concurrency)
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--max-seconds", type=float, default=max_seconds)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out))
    return parser


def main() -> int:
    parser = load_arguments(
        __doc__, concurrency="1,32,128", requests=1500, max_seconds=30.0, out="request_plane.json"
    )
    parser.add_argument("--topologies", default="in_process,worker_tcp,worker_nats")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    body = STREAM_BODY
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies.split(","):
            rows += run_topology(topology, args, body, levels, Path(tmp))
    added = []
    for row in rows:
        if row["topology"] == "in_process":
            continue
        base = next(
            r for r in rows if r["topology"] == "in_process" and r["concurrency"] == row["concurrency"]
        )
        added.append(
            {
                "topology": row["topology"],
                "concurrency": row["concurrency"],
                "added_total_cpu_ms_per_request": round(
                    row["total_cpu_ms_per_request"] - base["total_cpu_ms_per_request"], 3
                ),
                "total_cpu_ratio_to_in_process": round(
                    row["total_cpu_ms_per_request"] / base["total_cpu_ms_per_request"], 2
                ),
                "rps_ratio_to_in_process": round(row["rps"] / base["rps"], 2),
            }
        )
    result = {
        "benchmark": "request_plane_frontend_to_one_echo_core_worker",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": {"output_tokens": 64, "stream": True, "keep_alive": True, "DYN_TOKEN_ECHO_DELAY_MS": 0},
        "rows": rows,
        "added_cost_vs_in_process": added,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(added, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
