"""Frontend CPU for chats that share a long prefix: segment-cached tokenization vs whole prompts.

    .venv/bin/python benchmarks/bench_long_prompts.py --model .cache/tiny-model
    .venv/bin/python benchmarks/bench_long_prompts.py --modes kv,round-robin --rounds 3

Every request is a streamed chat whose system message is the same ~`--prefix-tokens` (4096)
token document and whose user message is a question of ~24 tokens that names the request's
number (so it is new to every cache; with the template's tokens around it, a new suffix of ~32),
answered with 64 tokens. The same load runs with the
frontend's segment cache (the default) and with it off (`DYN_TOKENIZE_CACHE_MB=0`, every
prompt tokenized whole), and the frontend process's CPU-ms per request is compared. Short
prompts (bench_frontend.py's message, numbered the same way) are measured too, to show the
cache costs nothing there. The issue's target: <= 1.5 CPU-ms per long-prefix request at c=8.

Modes (`--modes`, all by default), each point on fresh processes:
- `in-process`: `dyngraph run in=http out=echo_core`, the engine in the frontend's process
  (its CPU counts too: it is the smallest engine there is);
- `round-robin`, `kv`: a frontend `dyngraph run in=http out=auto --router-mode ...` over two
  mocker workers (bench_routing.py's `Deployment`: file discovery, tcp, zmq KV events), so
  the frontend's CPU includes the request plane and, with `kv`, block hashing, the index's
  KV events and the router's cost. Only the frontend's CPU is the figure.
`--rounds` repeats the whole matrix, so that load from others on the machine falls on every
point alike; the summary gives each point's median. Results: benchmarks/results/long_prompts.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import PROMPT, STREAM_BODY, free_port, measure, start
from bench_routing import Deployment

from dynamo_graph.bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]
MODES = ("in-process", "round-robin", "kv")
WORDS = [
    "serving",
    "router",
    "prefix",
    "cache",
    "token",
    "model",
    "worker",
    "decode",
    "prefill",
    "batch",
    "stream",
    "latency",
]
Body = Callable[[int], dict]
NO_CACHE = {"DYN_TOKENIZE_CACHE_MB": "0"}


def long_body(prefix_tokens: int, model: str = "bench") -> Body:
    """Request number -> body: the shared document, then a question of ~24 tokens of its own."""
    rng = random.Random(4096)
    # About two tokens a word with the tiny model's tokenizer.
    document = "Answer from this document.\n\n" + " ".join(
        rng.choice(WORDS) for _ in range(prefix_tokens // 2)
    )

    def body(number: int) -> dict:
        question = f"Request {number}: which three words of the document come up most, and why?"
        return {
            **STREAM_BODY,
            "model": model,
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
        }

    return body


def short_body(model: str = "bench") -> Body:
    """Request number -> bench_frontend.py's short chat, numbered."""

    def body(number: int) -> dict:
        return {
            **STREAM_BODY,
            "model": model,
            "messages": [{"role": "user", "content": f"{number}. {PROMPT}"}],
        }

    return body


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in os.environ while processes are started (they inherit it), then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def in_process_point(args: argparse.Namespace, body: Body, env: dict[str, str]) -> dict:
    port = free_port()
    argv = [
        sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=echo_core", args.model,
        "--model-name", "bench", "--http-port", str(port), "--context-length", "16384",
    ]  # fmt: skip
    proc = start(argv, port, 0.0, env)
    try:
        return measure(
            proc.pid,
            port,
            body,
            concurrency=args.concurrency,
            requests=args.requests,
            keep_alive=True,
            max_seconds=args.max_seconds,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def routed_point(
    args: argparse.Namespace, mode: str, workload: str, env: dict[str, str], run_dir: Path
) -> dict:
    settings = argparse.Namespace(
        model=args.model,
        workers=2,
        context_length=16384,
        block_size=64,
        num_gpu_blocks=16384,
        speedup_ratio=args.speedup_ratio,
        kv_overlap_score_weight=1.0,
        router_temperature=0.0,
        router_debug=False,
    )
    with environment({**env, "DYN_TOKEN_ECHO_DELAY_MS": "0"}):
        dep = Deployment(settings, mode, args.concurrency, run_dir)
    try:
        body = (
            long_body(args.prefix_tokens, dep.model) if workload == "long_prefix" else short_body(dep.model)
        )
        workers = {f"worker{i}": p.pid for i, p in enumerate(dep.procs) if p is not dep.frontend}
        return measure(
            dep.frontend.pid,
            dep.port,
            body,
            concurrency=args.concurrency,
            requests=args.requests,
            keep_alive=True,
            max_seconds=args.max_seconds,
            extra_pids=workers,
        )
    finally:
        dep.close()


POINTS = [(w, t, env) for w in ("long_prefix", "short") for t, env in (("segments", {}), ("whole", NO_CACHE))]


def point(args: argparse.Namespace, mode: str, workload: str, env: dict[str, str], run_dir: Path) -> dict:
    if mode != "in-process":
        return routed_point(args, mode, workload, env, run_dir)
    body = long_body(args.prefix_tokens) if workload == "long_prefix" else short_body()
    return in_process_point(args, body, env)


def summarize(rows: list[dict], modes: list[str]) -> list[dict]:
    """Each (mode, workload)'s median CPU per request over the rounds, segments and whole."""
    summary = []
    for mode in modes:
        for workload in ("long_prefix", "short"):
            cpu = {
                tokenize: statistics.median(
                    r["server_cpu_ms_per_request"]
                    for r in rows
                    if (r["mode"], r["workload"], r["tokenize"]) == (mode, workload, tokenize)
                )
                for tokenize in ("segments", "whole")
            }
            ratio = round(cpu["whole"] / cpu["segments"], 2)
            summary.append(
                {
                    "mode": mode,
                    "workload": workload,
                    "cpu_ms_per_request_median": cpu,
                    "whole_over_segments": ratio,
                }
            )
            print(
                f"median {mode:11s} {workload:11s} segments {cpu['segments']:.3f}  "
                f"whole {cpu['whole']:.3f} CPU-ms  ({ratio}x)"
            )
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1, help="times the whole matrix runs")
    parser.add_argument("--speedup-ratio", type=float, default=100.0, help="the mocker workers'")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_prompts.json"))
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}: use {', '.join(MODES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-long-prompts-") as tmp:
        for round_, mode, (workload, tokenize, env) in itertools.product(range(args.rounds), modes, POINTS):
            run_dir = Path(tmp) / f"{round_}-{mode}-{workload}-{tokenize}"
            run_dir.mkdir()
            row = point(args, mode, workload, env, run_dir)
            rows.append({"round": round_, "mode": mode, "workload": workload, "tokenize": tokenize, **row})
            print(
                f"round {round_} {mode:11s} {workload:11s} {tokenize:8s} ok {row['ok']}/{row['requests']}  "
                f"frontend {row['server_cpu_ms_per_request']:6.3f} CPU-ms/request  "
                f"TTFT p50 {row['ttft_p50_ms']:7.2f} ms  {row['rps']:6.1f} req/s",
                flush=True,
            )
    path = write_json(
        Path(args.out),
        {
            "benchmark": "long_prompts",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "target": "issue 17: <= 1.5 frontend CPU-ms per long-prefix request at c=8",
            "summary": summarize(rows, modes),
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
