"""What mutual TLS costs on the request plane: frontend -> one echo_core worker (delay 0) over
tcp, plain and with the graph's certificates (graph/tls.py, runtime/tls.py), in the same run.

Streamed chat, 64 output tokens, keep-alive between the client and the frontend (the frontend
keeps one TLS connection per worker, so the handshake is paid once; the cost measured is the
encryption of every frame). Reports requests/s, TTFT p50/p99 and CPU-ms per request of the
frontend and the worker; the modes alternate over `--rounds` (the machine may be shared), and TLS
is given against plain at each concurrency as the ratio of the rounds' means.

    python benchmarks/bench_tls.py --model .cache/tiny-model
Results: benchmarks/results/tls.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import STREAM_BODY, free_port, measure
from bench_request_plane import load_arguments, wait_for_model

from dynamo_graph.bench.provenance import git_of, provenance
from dynamo_graph.bench.report import write_json
from dynamo_graph.graph.tls import ca_file, cert_files, issue_all

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-m", "dynamo_graph", "run"]


def tls_env(folder: Path, process: str) -> dict[str, str]:
    cert, key = cert_files(folder, process)
    return {"DYN_TLS_CA_FILE": ca_file(folder), "DYN_TLS_CERT_FILE": cert, "DYN_TLS_KEY_FILE": key}


def one_mode(tls: bool, args: argparse.Namespace, levels: list[int], tmp: Path) -> list[dict]:
    """Start a worker and a frontend (with TLS or without), measure each level, stop them."""
    env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0", "DYN_LOG": "warn", "DYN_FILE_KV": str(tmp / "kv")}
    env["DYN_REQUEST_PLANE"] = "tcp"
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    worker_env = {**env, **tls_env(tmp / "tls", "worker")} if tls else env
    frontend_env = {**env, **tls_env(tmp / "tls", "frontend")} if tls else env
    procs = [
        subprocess.Popen(
            [*RUN, "in=dyn://bench.backend.generate", "out=echo_core", args.model, "--model-name", "bench"],
            env=worker_env,
            **quiet,
        )
    ]
    procs.append(
        subprocess.Popen([*RUN, "in=http", "out=auto", "--http-port", str(port)], env=frontend_env, **quiet)
    )
    try:
        wait_for_model(port, "bench")
        rows = []
        for c in levels:
            row = measure(
                procs[1].pid,
                port,
                STREAM_BODY,
                concurrency=c,
                requests=args.requests // 3 if c == 1 else args.requests,
                keep_alive=True,
                max_seconds=args.max_seconds,
                extra_pids={"worker": procs[0].pid},
            )
            row = {"tls": tls, **row}
            row["total_cpu_ms_per_request"] = round(
                row["server_cpu_ms_per_request"] + row["worker_cpu_ms_per_request"], 3
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=15)


MEANS = ("total_cpu_ms_per_request", "ttft_p50_ms", "ttft_p99_ms", "rps")


def mean_of(rows: list[dict], tls: bool, concurrency: int) -> dict:
    """The mean over the rounds of one mode at one concurrency."""
    mine = [r for r in rows if r["tls"] == tls and r["concurrency"] == concurrency]
    return {key: sum(r[key] for r in mine) / len(mine) for key in MEANS}


def ratios(rows: list[dict], levels: list[int]) -> list[dict]:
    """TLS against plain at each concurrency, each the mean of its rounds."""
    out = []
    for c in levels:
        on, off = mean_of(rows, True, c), mean_of(rows, False, c)
        out.append(
            {
                "concurrency": c,
                "cpu_ms_per_request_off": round(off["total_cpu_ms_per_request"], 3),
                "cpu_ms_per_request_on": round(on["total_cpu_ms_per_request"], 3),
                "cpu_ratio_tls_to_plain": round(
                    on["total_cpu_ms_per_request"] / off["total_cpu_ms_per_request"], 3
                ),
                "ttft_p50_ms_off": round(off["ttft_p50_ms"], 2),
                "ttft_p50_ms_on": round(on["ttft_p50_ms"], 2),
                "ttft_p50_ratio_tls_to_plain": round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3),
                "ttft_p99_ratio_tls_to_plain": round(on["ttft_p99_ms"] / off["ttft_p99_ms"], 3),
                "rps_ratio_tls_to_plain": round(on["rps"] / off["rps"], 3),
            }
        )
    return out


def main() -> int:
    parser = load_arguments(__doc__, concurrency="1,32", requests=600, max_seconds=20.0, out="tls.json")
    parser.add_argument("--rounds", type=int, default=2, help="plain and TLS runs each, alternating")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        issue_all(Path(tmp) / "tls", "bench", {"worker": [], "frontend": []})
        for round_ in range(args.rounds):  # alternating, so drift on a shared machine hits both modes
            for tls in (False, True) if round_ % 2 == 0 else (True, False):
                rows += one_mode(tls, args, levels, Path(tmp))
    result = {
        "benchmark": "tls_on_the_request_plane_frontend_to_one_echo_core_worker",
        **provenance(),
        "git": git_of(Path(__file__)),
        "workload": {"output_tokens": 64, "stream": True, "keep_alive": True, "DYN_TOKEN_ECHO_DELAY_MS": 0},
        "rows": rows,
        "rounds": args.rounds,
        "tls_vs_plain": ratios(rows, levels),
    }
    print(json.dumps(result["tls_vs_plain"], indent=2))
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
