"""Frontend benchmark: streamed chat, 64 output tokens, echo_core with no delay.

For concurrency 1/8/32/128, with a new connection per request and with keep-alive, it reports
requests/s, TTFT and ITL p50/p99 as the client sees them, and the server process's CPU-ms per
request (from /proc). The same load runs against a bare ASGI floor server (floor_server.py)
in the same run, and the frontend's CPU is given as a ratio to that floor.

    python benchmarks/bench_frontend.py --model .cache/tiny-model
    python benchmarks/bench_frontend.py --model .cache/tiny-model --apis   # Responses, Messages
Results: benchmarks/results/frontend.json (frontend_apis.json with --apis: the same 64-token stream
as a chat completion, a Responses call and a Messages call on one server, and each one's server
CPU per request as a ratio to the chat completion's; issue 19's target is at most 1.15).
Target (notes/PERF.md): Dynamo's Rust frontend spends 1.1-1.3 CPU-ms per such request at c=32 on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from dynamo_graph.bench.loadgen import Request, Target, run_closed
from dynamo_graph.bench.report import write_json
from dynamo_graph.bench.stats import percentile
from dynamo_graph.bench.stream import Result

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
# About 70 prompt tokens with the template, so echo_core can return 64 of them.
PROMPT = (
    "Benchmark the frontend: the quick brown fox jumps over the lazy dog while the "
    "serving system streams every token back as a separate server-sent event to the client."
)


# Streamed chat, 64 tokens, the template's eos ignored so echo_core returns all of them.
STREAM_BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 64,
    "stream": True,
    "nvext": {"ignore_eos": True},
}


# The same stream through the other API surfaces (frontend/openai_responses, anthropic_messages).
API_BODIES = {
    "/v1/chat/completions": STREAM_BODY,
    "/v1/responses": {
        "model": "bench",
        "input": PROMPT,
        "max_output_tokens": 64,
        "stream": True,
        "nvext": {"ignore_eos": True},
    },
    "/v1/messages": {
        "model": "bench",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
        "stream": True,
        "nvext": {"ignore_eos": True},
    },
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], port: int, delay_ms: float, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": str(delay_ms), "DYN_LOG": "warn", **(env or {})}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start: {argv}")


def measure(
    pid: int,
    port: int,
    body: dict | Callable[[int], dict],
    *,
    concurrency: int,
    requests: int,
    keep_alive: bool,
    max_seconds: float,
    extra_pids: dict[str, int] | None = None,
    path: str = "/v1/chat/completions",
) -> dict:
    """One load point. CPU is read for the server `pid` and any `extra_pids` (e.g. workers).
    `body`: every request's, or a function of the request's number (warm-up ones included)."""

    target = Target("127.0.0.1", port, path, keep_alive=keep_alive)
    numbers = itertools.count()
    make = body if callable(body) else lambda _: body

    def load(n: int, seconds: float) -> tuple[list[Result], float]:
        bodies = [Request(make(next(numbers))) for _ in range(n)]
        run = asyncio.run(run_closed(target, bodies, concurrency=concurrency, max_seconds=seconds))
        return run.results, run.wall_s

    load(min(requests, 4 * concurrency), 10)  # warm-up (connections, caches), not counted
    pids = {"server": pid, **(extra_pids or {})}
    cpu0 = {name: cpu_seconds(p) for name, p in pids.items()}
    results, wall = load(requests, max_seconds)
    cpu = {name: cpu_seconds(p) - cpu0[name] for name, p in pids.items()}
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    return {
        "concurrency": concurrency,
        "keep_alive": keep_alive,
        "requests": len(results),
        "ok": len(ok),
        "events_per_request": round(sum(r.tokens for r in ok) / max(len(ok), 1), 1),
        "rps": round(len(ok) / wall, 1),
        "ttft_p50_ms": round(percentile([r.ttft for r in ok], 50) * 1000, 2),
        "ttft_p99_ms": round(percentile([r.ttft for r in ok], 99) * 1000, 2),
        "itl_p50_ms": round(percentile(gaps, 50) * 1000, 3),
        "itl_p99_ms": round(percentile(gaps, 99) * 1000, 3),
        **{f"{name}_cpu_ms_per_request": round(c * 1000 / max(len(ok), 1), 3) for name, c in cpu.items()},
    }


def compare_apis(args: argparse.Namespace, argv: list[str], port: int) -> int:
    """Server CPU per streamed request, chat vs Responses vs Messages, on one echo_core server;
    the routes take turns for `--rounds` rounds so that load from others on the machine falls on
    all of them alike."""
    proc = start(argv, port, args.echo_delay_ms)
    rows = []
    try:
        for round_ in range(args.rounds):
            for c in (int(c) for c in args.concurrency.split(",")):
                for path, body in API_BODIES.items():
                    n = args.requests // 3 if c == 1 else args.requests
                    row = measure(
                        proc.pid,
                        port,
                        body,
                        concurrency=c,
                        requests=n,
                        keep_alive=True,
                        max_seconds=args.max_seconds,
                        path=path,
                    )
                    rows.append({"round": round_, "path": path, **row})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    summary = []
    for c in sorted({r["concurrency"] for r in rows}):
        cpu = {
            path: percentile(
                [r["server_cpu_ms_per_request"] for r in rows if r["path"] == path and r["concurrency"] == c],
                50,
            )
            for path in API_BODIES
        }
        chat = cpu["/v1/chat/completions"]
        summary.append(
            {
                "concurrency": c,
                "cpu_ms_per_request_median": cpu,
                "ratio_to_chat": {path: round(v / max(chat, 1e-9), 3) for path, v in cpu.items()},
            }
        )
    result = {
        "benchmark": "frontend_streaming_apis_echo_core",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {"output_tokens": 64, "engine": "echo_core", "keep_alive": True},
        "target": "issue 19: a streamed Responses or Messages request costs at most 1.15x a chat completion",
        "summary": summary,
        "rows": rows,
    }
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model folder for echo_core (the tiny model)")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--requests", type=int, default=1500, help="requests per point (c=1 uses a third)")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="time cap per point")
    parser.add_argument(
        "--echo-delay-ms",
        type=float,
        default=0.0,
        help="echo_core pacing; 0 sends each response in one burst, >0 makes every token its own write",
    )
    parser.add_argument("--apis", action="store_true", help="compare chat, Responses and Messages instead")
    parser.add_argument("--rounds", type=int, default=3, help="with --apis: rounds of taking turns")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/...)")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    if args.out is None:
        args.out = str(results / ("frontend_apis.json" if args.apis else "frontend.json"))
    levels = [int(c) for c in args.concurrency.split(",")]
    body = STREAM_BODY

    servers = {
        "dyngraph": lambda port: [
            sys.executable,
            "-m",
            "dynamo_graph",
            "run",
            "in=http",
            "out=echo_core",
            args.model,
            "--model-name",
            "bench",
            "--http-port",
            str(port),
        ],
        "floor_bare_asgi": lambda port: [
            sys.executable,
            str(ROOT / "benchmarks" / "floor_server.py"),
            str(port),
        ],
    }
    if args.apis:
        port = free_port()
        return compare_apis(args, servers["dyngraph"](port), port)
    rows = []
    for name, argv in servers.items():
        port = free_port()
        proc = start(argv(port), port, args.echo_delay_ms)
        try:
            for keep_alive in (False, True):
                for c in levels:
                    n = args.requests // 3 if c == 1 else args.requests
                    row = {
                        "server": name,
                        **measure(
                            proc.pid,
                            port,
                            body,
                            concurrency=c,
                            requests=n,
                            keep_alive=keep_alive,
                            max_seconds=args.max_seconds,
                        ),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    ratios = []
    for row in rows:
        if row["server"] != "dyngraph":
            continue
        floor = next(
            r
            for r in rows
            if r["server"] == "floor_bare_asgi"
            and r["concurrency"] == row["concurrency"]
            and r["keep_alive"] == row["keep_alive"]
        )
        ratios.append(
            {
                "concurrency": row["concurrency"],
                "keep_alive": row["keep_alive"],
                "cpu_ratio_to_floor": round(
                    row["server_cpu_ms_per_request"] / max(floor["server_cpu_ms_per_request"], 1e-9), 2
                ),
            }
        )
    result = {
        "benchmark": "frontend_streaming_chat_echo_core",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {
            "output_tokens": 64,
            "engine": "echo_core",
            "DYN_TOKEN_ECHO_DELAY_MS": args.echo_delay_ms,
        },
        "target": "Dynamo 1.6.1 Rust frontend: 1.1-1.3 server CPU-ms per request at c=32",
        "rows": rows,
        "ratios_to_floor": ratios,
    }
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
