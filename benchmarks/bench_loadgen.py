"""The load generator's own cost: is `dyngraph bench` light enough not to be what it measures?

    .venv/bin/python benchmarks/bench_loadgen.py

Against the bare ASGI floor server (floor_server.py: 64 pre-built SSE chunks per request, the
cheapest server this stack can be), streamed requests in a closed loop at concurrency 1, 8 and
32 with kept-alive connections, by dyngraph.bench.loadgen in this process. Reported per point:
requests/s, the client's CPU-ms per request (this process) and the server's (from /proc), and
the ratio client/server — the baseline measured in the same run. Below 1, the client costs less
than the lightest possible server; a dyngraph frontend costs several times the floor
(bench_frontend.py), so the client is a small share of any real measurement.
Results: benchmarks/results/loadgen.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench_frontend import STREAM_BODY, cpu_seconds, free_port, start

from dynamo_graph.bench.loadgen import Request, Target, run_closed
from dynamo_graph.bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]


def point(port: int, concurrency: int, requests: int, max_seconds: float, server_pid: int) -> dict:
    target = Target("127.0.0.1", port, "/v1/chat/completions")
    batch = [Request(STREAM_BODY)] * requests
    asyncio.run(run_closed(target, batch[: 4 * concurrency], concurrency=concurrency, max_seconds=10))  # warm
    server0, client0 = cpu_seconds(server_pid), time.process_time()
    run = asyncio.run(run_closed(target, batch, concurrency=concurrency, max_seconds=max_seconds))
    client, server = time.process_time() - client0, cpu_seconds(server_pid) - server0
    ok = sum(r.ok for r in run.results)
    return {
        "concurrency": concurrency,
        "requests": len(run.results),
        "ok": ok,
        "events_per_request": round(sum(r.tokens for r in run.results) / max(ok, 1), 1),
        "rps": round(ok / run.wall_s, 1),
        "client_cpu_ms_per_request": round(client * 1000 / max(ok, 1), 3),
        "server_cpu_ms_per_request": round(server * 1000 / max(ok, 1), 3),
        "client_over_server": round(client / max(server, 1e-9), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loadgen.json"))
    args = parser.parse_args()
    port = free_port()
    server = start([sys.executable, str(ROOT / "benchmarks" / "floor_server.py"), str(port)], port, 0.0)
    try:
        rows = []
        for c in (int(c) for c in args.concurrency.split(",")):
            rows.append(point(port, c, args.requests, args.max_seconds, server.pid))
            print(rows[-1], flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    result = {
        "benchmark": "loadgen_client_cost",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {"events_per_request": 64, "server": "floor_server.py (bare ASGI)", "keep_alive": True},
        "rows": rows,
    }
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
