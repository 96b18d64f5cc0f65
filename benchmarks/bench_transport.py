"""Micro-benchmark of the request plane: one worker process streams 64 small frames (~30 B) per
request to a client (this process) at concurrency 1/32/128, over tcp and nats. "burst": the
worker's handler yields all frames without awaiting (they leave in one write); "paced": it
yields to the event loop between frames, one write per frame, like a real engine's tokens.

Reports requests/s, request latency p50/p99, and CPU-ms per request of the client process,
of the worker process and (nats) of nats-server, from /proc/<pid>/stat. The client's figure
is the request plane's share of the frontend's budget (~1.2 CPU-ms for a
whole 64-token streamed request).

    .venv/bin/python benchmarks/bench_transport.py [--seconds 3] [--kinds tcp,nats]
Writes benchmarks/results/transport.json. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_graph.runtime.context import Context  # noqa: E402
from dynamo_graph.runtime.transport import RequestPlaneClient, create_client  # noqa: E402

SUBJECT = "test.echo.generate"  # served by tests/support/scripts/transport_worker.py
FRAMES = 64
CONCURRENCY = (1, 32, 128)
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    """User + system CPU time of a process so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def start_nats(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("nats-server")
    if binary is None:
        raise SystemExit("nats-server not found (apt-get install -y nats-server), or pass --kinds tcp")
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", str(tmp)])
    ports = tmp / f"nats-server_{proc.pid}.ports"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if ports.exists() and ports.read_text().strip():
            return proc, json.loads(ports.read_text())["nats"][0]
        time.sleep(0.01)
    proc.kill()
    raise SystemExit("nats-server did not start")


def start_worker(kind: str, tmp: Path, nats_url: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    record_file = tmp / f"{kind}-record.json"
    cmd = [sys.executable, "-m", "tests.support.scripts.transport_worker", kind, str(record_file)]
    if kind == "nats":
        cmd += ["--nats-url", nats_url]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 15
    while not record_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{kind} worker did not start")
        time.sleep(0.01)
    return proc, json.loads(record_file.read_text())["record"]


async def load(
    client: RequestPlaneClient, record: dict[str, Any], concurrency: int, seconds: float, *, paced: bool
) -> list[float]:
    """Closed loop: `concurrency` callers issue requests back to back for `seconds`."""
    body = json.dumps({"n": FRAMES, "tag": "x" * 24, "paced": paced}).encode()
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            frames = 0
            async for _ in client.stream(record, SUBJECT, body, {}, Context()):
                frames += 1
            assert frames == FRAMES
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_kind(
    kind: str, record: dict[str, Any], pids: dict[str, int], nats_url: str, seconds: float
) -> list[dict[str, Any]]:
    client = create_client(kind, **({"url": nats_url} if kind == "nats" else {}))
    await load(client, record, 8, 0.5, paced=False)  # warm up: connections, caches
    rows = []
    for paced, concurrency in itertools.product((False, True), CONCURRENCY):
        before = {name: cpu_ms(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        latencies = await load(client, record, concurrency, seconds, paced=paced)
        wall = time.perf_counter() - started
        spent = {name: cpu_ms(pid) - before[name] for name, pid in pids.items()}
        n = len(latencies)
        row = {
            "transport": kind,
            "worker_frames": "paced" if paced else "burst",
            "concurrency": concurrency,
            "requests": n,
            "requests_per_s": round(n / wall, 1),
            "frames_per_s": round(n * FRAMES / wall),
            "latency_ms_p50": round(percentile(latencies, 0.50) * 1000, 3),
            "latency_ms_p99": round(percentile(latencies, 0.99) * 1000, 3),
            **{f"cpu_ms_per_request_{name}": round(ms / n, 3) for name, ms in spent.items()},
        }
        rows.append(row)
        cpu = "  ".join(f"{name} {ms / n:.3f}" for name, ms in spent.items())
        print(
            f"{kind:4} {row['worker_frames']:5} c={concurrency:<4} {row['requests_per_s']:>8.0f} req/s  "
            f"p50 {row['latency_ms_p50']:7.2f} ms  p99 {row['latency_ms_p99']:7.2f} ms  CPU-ms/req: {cpu}",
            flush=True,
        )
    await client.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement time per concurrency level")
    parser.add_argument("--kinds", default="tcp,nats")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/transport.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        nats_proc, nats_url = start_nats(tmp) if "nats" in args.kinds else (None, "")
        try:
            for kind in args.kinds.split(","):
                worker, record = start_worker(kind, tmp, nats_url)
                pids = {"client": os.getpid(), "worker": worker.pid}
                if kind == "nats" and nats_proc is not None:
                    pids["nats_server"] = nats_proc.pid
                try:
                    rows += await bench_kind(kind, record, pids, nats_url, args.seconds)
                finally:
                    worker.terminate()
                    worker.wait(timeout=10)
        finally:
            if nats_proc is not None:
                nats_proc.terminate()
                nats_proc.wait(timeout=10)
    result = {
        "benchmark": "request plane: 64 frames of ~30 B per request, closed loop, burst and paced",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "event_loop": "uvloop"},
        "seconds_per_level": args.seconds,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
