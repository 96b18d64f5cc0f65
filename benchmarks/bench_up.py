"""Time from invoking `dyngraph up -d graphs/hello.yaml` to the model's first chat completion:
frontend + 1 worker, and frontend + 4 workers (`components.backend.replicas=4`).

The graph is copied into a temp dir (its state dir goes there) and its port overridden to a free
one. A client polls /v1/chat/completions every 5 ms from the moment `up -d` is launched; the
graph is brought `down` after every run. Also recorded: when `up -d` itself returned, and the
cost of loading + validating + compiling the graph alone (`dyngraph validate`).

    python benchmarks/bench_up.py [--model .cache/tiny-model] [--runs 3]
Results: benchmarks/results/up.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DYNGRAPH = [sys.executable, "-m", "dynamo_graph"]
BODY = {
    "model": "tiny-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "nvext": {"ignore_eos": True},
}
TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(graph: Path, model: Path, replicas: int) -> dict[str, float]:
    port = free_port()
    overrides = [
        f"components.frontend.http.port={port}",
        f"models.tiny-model.path={model}",
        f"++components.backend.replicas={replicas}",
    ]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    start = time.perf_counter()
    up = subprocess.Popen(
        [*DYNGRAPH, "up", "-d", str(graph), *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    answered = None
    try:
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() - start < TIMEOUT_S:
                try:
                    if client.post(url, json=BODY).status_code == 200:
                        answered = time.perf_counter() - start
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.005)
        output, _ = up.communicate(timeout=TIMEOUT_S)
        up_returned = time.perf_counter() - start
        if answered is None or up.returncode != 0:
            raise SystemExit(f"up failed (rc {up.returncode}):\n{output.decode(errors='replace')}")
    finally:
        down = subprocess.run([*DYNGRAPH, "down", str(graph)], capture_output=True, text=True, timeout=120)
        if down.returncode != 0:
            print(down.stdout, down.stderr, file=sys.stderr)
    return {"first_answer_s": round(answered, 3), "up_returned_s": round(up_returned, 3)}


def validate_cost(graph: Path, model: Path) -> float:
    start = time.perf_counter()
    argv = [*DYNGRAPH, "validate", str(graph), f"models.tiny-model.path={model}"]
    subprocess.run(argv, check=True, capture_output=True)
    return round(time.perf_counter() - start, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "up.json")
    args = parser.parse_args()
    model = args.model.resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-up-") as tmp:
        graph = Path(tmp) / "hello.yaml"
        shutil.copy(ROOT / "graphs" / "hello.yaml", graph)
        validate_s = validate_cost(graph, model)
        for replicas in (1, 4):
            runs = [one_run(graph, model, replicas) for _ in range(args.runs)]
            row = {
                "topology": f"frontend + {replicas} worker{'s' if replicas > 1 else ''}",
                "runs": runs,
                "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs),
                "median_up_returned_s": statistics.median(r["up_returned_s"] for r in runs),
            }
            print(json.dumps(row))
            rows.append(row)
    result = {
        "benchmark": "dyngraph_up_to_first_answer",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "graph": "graphs/hello.yaml (echo_core, file discovery, tcp)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "validate_alone_s": validate_s,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
