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
Target: Dynamo's Rust frontend spends 1.1-1.3 CPU-ms per such request at c=32 on this machine.

With --frontend-processes 1,2,4,8 it measures instead a frontend of N processes on one port
(`dyngraph run in=http out=auto --http-processes N`, docs/frontend-scaling.md) in front of
mocker workers at speedup 10000: req/s and CPU-ms per request of all its processes together
(from /proc), each N against N=1 of the same run, with new connections and with keep-alive.
The load comes from --clients processes (a single Python client tops out near 1-2k req/s).

    python benchmarks/bench_frontend.py --model .cache/tiny-model --frontend-processes 1,2,4,8 \
        --concurrency 64 --workers 4 --clients 4 --max-seconds 15
Results: benchmarks/results/frontend_processes.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from dynamo_graph.bench.loadgen import Request, Target, run_closed
from dynamo_graph.bench.provenance import git_of, provenance
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


def variants_args(doc: str, results: str) -> argparse.Namespace:
    """The command line of a one-run comparison of frontend variants (`alternate`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=300, help="per load point")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / results)
    return parser.parse_args()


def embedded_planes(scratch: Path) -> dict[str, str]:
    """The environment that puts a comparison's frontends and workers on planes in `scratch`."""
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(scratch / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "PYTHONHASHSEED": "0",
    }


def mocker_workers(
    model: str, scratch: Path, env: dict[str, str], count: int = 2, extra: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    """`count` mocker workers at speedup 10000 serving `model` as "bench" (`env`: their planes
    and whatever else they need; `extra`: more of their arguments)."""
    engine_args = scratch / "mocker.json"
    engine_args.write_text(json.dumps({"speedup_ratio": 10000, "block_size": 16, "num_gpu_blocks": 65536}))
    argv = [sys.executable, "-m", "dynamo_graph", "run", "in=dyn://bench.mocker.generate", "out=mocker"]
    argv += [model, "--model-name", "bench", "--extra-engine-args", str(engine_args), *extra]
    full_env = {**os.environ, **env, "DYN_LOG": "warn"}
    return [subprocess.Popen(argv, env=full_env, stdout=subprocess.DEVNULL) for _ in range(count)]


def alternate(
    frontends: dict[str, tuple[subprocess.Popen, int]], body: dict, rounds: int, **load: object
) -> dict[str, list[float]]:
    """Server CPU-ms per request of each of `frontends` (name -> process, port) under the same
    load (`measure`'s keywords), `rounds` times in alternation, each round starting with the
    next one, so that a shared machine's drift falls on all of them alike."""
    names = list(frontends)
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            proc, port = frontends[name]
            point = measure(proc.pid, port, body, **load)  # type: ignore[arg-type]
            assert point["ok"] == point["requests"], point
            ms = point["server_cpu_ms_per_request"]
            cpu[name].append(ms)
            print(f"{name:>24}: {ms:.3f} CPU-ms/request, {point['rps']} req/s", flush=True)
    return cpu


def variants_result(benchmark: str, args: argparse.Namespace, cpu: dict[str, list[float]]) -> dict:
    """What a comparison of frontend variants reports: each one's CPU-ms per request, their
    medians, and each median's ratio to the first variant's (the baseline)."""
    median = {name: statistics.median(values) for name, values in cpu.items()}
    base = next(iter(median.values()))
    return {
        "benchmark": benchmark,
        "provenance": provenance(),
        "load": {"concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds},
        "cpu_ms_per_request": cpu,
        "median_cpu_ms_per_request": median,
        "ratio_to_off": {name: round(value / base, 3) for name, value in median.items()},
    }


def stop_all(processes: list[subprocess.Popen], timeout_s: float = 30) -> None:
    """Terminate every process, then wait for each."""
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.wait(timeout_s)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (a frontend of N processes: its group and their children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(child) for child in task.read_text().split()]
    return found


def _client_share(port: int, keep_alive: bool, concurrency: int, requests: int, max_seconds: float) -> dict:
    """One client process's part of a load point (run in a process pool)."""
    target = Target("127.0.0.1", port, "/v1/chat/completions", keep_alive=keep_alive)
    bodies = [Request(STREAM_BODY) for _ in range(requests)]
    run = asyncio.run(run_closed(target, bodies, concurrency=concurrency, max_seconds=max_seconds))
    ok = [r for r in run.results if r.ok]
    return {
        "requests": len(run.results),
        "ok": len(ok),
        "wall_s": run.wall_s,
        "tokens": sum(r.tokens for r in ok),
        "ttft": [r.ttft for r in ok],
        "errors": sorted({r.error for r in run.results if not r.ok})[:3],
    }


def _wait_for_processes(port: int, processes: int, timeout_s: float = 120.0) -> set[int]:
    """Until `processes` distinct frontend processes answered /health 200 (each found the model)."""
    answered: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(answered) < processes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(answered)} of {processes} frontend processes are ready")
        with contextlib.suppress(httpx.TransportError):
            resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # a new connection each
            if resp.status_code == 200:
                answered.add(int(resp.headers["x-dyngraph-pid"]))
                continue
        time.sleep(0.1)
    return answered


class _LoadPoint:
    """One load point, split over the client processes of `pool`."""

    def __init__(
        self, pool: concurrent.futures.Executor, clients: int, port: int, keep_alive: bool, concurrency: int
    ) -> None:
        self.pool, self.clients, self.port = pool, clients, port
        self.keep_alive, self.concurrency = keep_alive, concurrency

    def run(self, requests: int, seconds: float) -> list[dict]:
        each = max(self.concurrency // self.clients, 1), max(requests // self.clients, 1)
        share = (self.port, self.keep_alive, *each, seconds)
        jobs = [self.pool.submit(_client_share, *share) for _ in range(self.clients)]
        return [job.result() for job in jobs]


def _processes_row(
    processes: int, load: _LoadPoint, parts: list[dict], process_cpu: list[float], workers_cpu: float
) -> dict:
    """`process_cpu`: CPU seconds of each frontend process (the group's parent too)."""
    frontend_cpu = sum(process_cpu)
    ok = sum(part["ok"] for part in parts)
    wall = max(part["wall_s"] for part in parts)
    ttft = [t for part in parts for t in part["ttft"]]
    return {
        "frontend_processes": processes,
        "keep_alive": load.keep_alive,
        "concurrency": load.concurrency,
        "clients": load.clients,
        "requests": sum(part["requests"] for part in parts),
        "ok": ok,
        "errors": sorted({e for part in parts for e in part["errors"]})[:3],
        "events_per_request": round(sum(p["tokens"] for p in parts) / max(ok, 1), 1),
        "rps": round(ok / wall, 1),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 2),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 2),
        "frontend_cpu_ms_per_request": round(frontend_cpu * 1000 / max(ok, 1), 3),
        "workers_cpu_ms_per_request": round(workers_cpu * 1000 / max(ok, 1), 3),
        "frontend_cpu_cores_busy": round(frontend_cpu / wall, 2),
        # Each process's share: an even split says the kernel spreads connections over the port.
        "frontend_cpu_share_per_process": sorted(
            (round(c / max(frontend_cpu, 1e-9), 3) for c in process_cpu), reverse=True
        ),
    }


def _print_processes_summary(rows: list[dict]) -> None:
    print(
        f"\n{'procs':>5} {'conn':>10} {'c':>4} {'req/s':>8} {'x':>5} {'fe CPU-ms/req':>13} {'x':>5} "
        f"{'fe cores':>8} {'wk CPU-ms/req':>13} {'TTFT p50':>9} ok/sent"
    )
    for r in rows:
        conn = "keep-alive" if r["keep_alive"] else "new"
        print(
            f"{r['frontend_processes']:>5} {conn:>10} {r['concurrency']:>4} {r['rps']:>8} "
            f"{r['rps_ratio_to_first']:>5} {r['frontend_cpu_ms_per_request']:>13} "
            f"{r['cpu_ratio_to_first']:>5} {r['frontend_cpu_cores_busy']:>8} "
            f"{r['workers_cpu_ms_per_request']:>13} {r['ttft_p50_ms']:>7}ms {r['ok']}/{r['requests']}"
        )


def compare_processes(args: argparse.Namespace) -> int:
    """1 vs N frontend processes on one port, mocker workers behind (see the module docstring)."""
    load_before = os.getloadavg()  # others' work on the machine shows in every figure: recorded
    counts = [int(n) for n in args.frontend_processes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    clients = args.clients or max(1, (os.cpu_count() or 1) // 4)
    planes = tempfile.mkdtemp(prefix="bench-frontend-")
    env = {
        **os.environ,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": f"{planes}/discovery",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "PYTHONHASHSEED": "0",
        "DYN_LOG": "warn",
    }
    engine_args = Path(planes) / "mocker.json"
    engine_args.write_text(
        json.dumps({"speedup_ratio": args.speedup, "block_size": 16, "num_gpu_blocks": 65536})
    )
    dyngraph = [sys.executable, "-m", "dynamo_graph", "run"]
    worker_argv = [*dyngraph, "in=dyn://bench.mocker.generate", "out=mocker", args.model]
    worker_argv += ["--model-name", "bench", "--extra-engine-args", str(engine_args)]
    workers = [subprocess.Popen(worker_argv, env=env, stdout=subprocess.DEVNULL) for _ in range(args.workers)]
    rows: list[dict] = []
    pool = concurrent.futures.ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        list(pool.map(time.sleep, [0.0] * clients))  # the client processes exist before any timing
        for n in counts:
            port = free_port()
            frontend_argv = [*dyngraph, "in=http", "out=auto", "--http-port", str(port)]
            frontend_argv += ["--http-processes", str(n), "--router-mode", args.router_mode]
            frontend = subprocess.Popen(frontend_argv, env=env, stdout=subprocess.DEVNULL)
            try:
                _wait_for_processes(port, n)
                pids = descendants(frontend.pid)
                for keep_alive in (False, True):
                    for c in levels:
                        load = _LoadPoint(pool, clients, port, keep_alive, c)
                        load.run(min(args.requests, 4 * c), 10)  # warm-up: connections, caches; not counted
                        cpu0 = {p: cpu_seconds(p) for p in pids + [w.pid for w in workers]}
                        parts = load.run(args.requests, args.max_seconds)
                        cpu = {p: cpu_seconds(p) - cpu0[p] for p in cpu0}
                        fe_cpu = [cpu[p] for p in pids]
                        row = _processes_row(n, load, parts, fe_cpu, sum(cpu[w.pid] for w in workers))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                frontend.terminate()
                frontend.wait(timeout=60)
    finally:
        pool.shutdown()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)
        shutil.rmtree(planes, ignore_errors=True)
    for row in rows:
        base = next(
            r
            for r in rows
            if r["frontend_processes"] == counts[0]
            and (r["keep_alive"], r["concurrency"]) == (row["keep_alive"], row["concurrency"])
        )
        row["rps_ratio_to_first"] = round(row["rps"] / max(base["rps"], 1e-9), 2)
        row["cpu_ratio_to_first"] = round(
            row["frontend_cpu_ms_per_request"] / max(base["frontend_cpu_ms_per_request"], 1e-9), 2
        )
    result = {
        "benchmark": "frontend_processes_streaming_chat_mocker",
        **provenance(),
        "git": git_of(Path(__file__)),
        "workload": {
            "output_tokens": 64,
            "engine": "mocker",
            "speedup_ratio": args.speedup,
            "workers": args.workers,
            "router_mode": args.router_mode,
            "client_processes": clients,
        },
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }
    _print_processes_summary(rows)
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


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
    parser.add_argument(
        "--frontend-processes",
        default=None,
        help="e.g. 1,2,4,8: measure a frontend of that many processes against mocker workers instead",
    )
    parser.add_argument("--workers", type=int, default=2, help="with --frontend-processes: mocker workers")
    parser.add_argument(
        "--speedup", type=float, default=10000.0, help="with --frontend-processes: mocker speedup"
    )
    parser.add_argument(
        "--clients", type=int, default=0, help="with --frontend-processes: load processes (default cores/4)"
    )
    parser.add_argument("--router-mode", default="round-robin", choices=["round-robin", "random", "kv"])
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/...)")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    if args.out is None:
        name = (
            "frontend_apis" if args.apis else "frontend_processes" if args.frontend_processes else "frontend"
        )
        args.out = str(results / f"{name}.json")
    if args.frontend_processes:
        return compare_processes(args)
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
