"""Frontend CPU for chats that share a long prefix: segment-cached tokenization vs whole prompts.

    .venv/bin/python benchmarks/bench_long_prompts.py --model .cache/tiny-model
    .venv/bin/python benchmarks/bench_long_prompts.py --modes kv,round-robin --rounds 3
    .venv/bin/python benchmarks/bench_long_prompts.py --modes kv --workloads one_message \
        --tokenize segments,no-reuse,whole --rounds 2

Workloads (`--workloads`), every request a streamed chat answered with 64 tokens:
- `long_prefix`: the system message is the same ~`--prefix-tokens` (4096) token document, the
  user message a question of ~24 tokens that names the request's number (so it is new to every
  cache; with the template's tokens around it, a new suffix of ~32);
- `one_message`: the same document and question in *one* user message, so the text between
  the template's special tokens is new on every request (issue 27): only the reuse of a cached
  prefix inside a segment (llm/prefix_reuse.py) avoids tokenizing the document again;
- `short`: bench_frontend.py's message, numbered the same way, to show the caches cost nothing.
Tokenization (`--tokenize`): `segments` (the default: the segment cache with prefix reuse),
`no-reuse` (the segment cache without it: `DYN_TOKENIZE_PREFIX_REUSE=0`) and `whole` (the
cache off, `DYN_TOKENIZE_CACHE_MB=0`, every prompt tokenized whole); the frontend process's
CPU-ms per request is compared. The issues' target (17 and 27): <= 1.5 CPU-ms per long-prefix
request at c=8 behind kv routing.

Modes (`--modes`, all by default), each point on fresh processes:
- `in-process`: `dyngraph run in=http out=echo_core`, the engine in the frontend's process
  (its CPU counts too: it is the smallest engine there is);
- `round-robin`, `kv`: a frontend `dyngraph run in=http out=auto --router-mode ...` over two
  mocker workers (bench_routing.py's `Deployment`: file discovery, tcp, zmq KV events), so
  the frontend's CPU includes the request plane and, with `kv`, block hashing, the index's
  KV events and the router's cost. Only the frontend's CPU is the figure.
`--rounds` repeats the whole matrix, so that load from others on the machine falls on every
point alike; the summary gives each point's median. Results: benchmarks/results/long_prompts.json.

`--checkouts A,B` instead compares source trees (e.g. main's and a branch's) on issue 27's point:
the `one_message` workload at c=8 with a new connection per request, one kv frontend per
checkout (run with that tree first on PYTHONPATH) over the same two mocker workers at speedup
10000 (bench_frontend.mocker_workers), measured in turns over `--rounds` (each round starting
with the next checkout); every request's question is new across the whole run. Reported: each
checkout's frontend CPU-ms per request per round, their median and range.

    .venv/bin/python benchmarks/bench_long_prompts.py --checkouts /work/main,. --rounds 6 \
        --out benchmarks/results/long_prompts_checkouts.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import (
    PROMPT,
    STREAM_BODY,
    alternate,
    embedded_planes,
    free_port,
    measure,
    mocker_workers,
    start,
    stop_all,
)
from bench_routing import Deployment

from dynamo_graph.bench.provenance import git_of, provenance
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
TOKENIZE = {
    "segments": {},
    "no-reuse": {"DYN_TOKENIZE_PREFIX_REUSE": "0"},
    "whole": {"DYN_TOKENIZE_CACHE_MB": "0"},
}
WORKLOADS = ("long_prefix", "one_message", "short")


def long_body(prefix_tokens: int, model: str = "bench", *, one_message: bool = False) -> Body:
    """Request number -> body: the shared document, then a question of ~24 tokens of its own,
    as a system and a user message, or (`one_message`) both in one user message."""
    rng = random.Random(4096)
    # About two tokens a word with the tiny model's tokenizer.
    document = "Answer from this document.\n\n" + " ".join(
        rng.choice(WORDS) for _ in range(prefix_tokens // 2)
    )

    def body(number: int) -> dict:
        question = f"Request {number}: which three words of the document come up most, and why?"
        if one_message:
            messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
        else:
            messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
        return {**STREAM_BODY, "model": model, "messages": messages}

    return body


def workload_body(args: argparse.Namespace, workload: str, model: str = "bench") -> Body:
    if workload == "short":
        return short_body(model)
    return long_body(args.prefix_tokens, model, one_message=workload == "one_message")


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
        body = workload_body(args, workload, dep.model)
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


def point(args: argparse.Namespace, mode: str, workload: str, env: dict[str, str], run_dir: Path) -> dict:
    if mode != "in-process":
        return routed_point(args, mode, workload, env, run_dir)
    return in_process_point(args, workload_body(args, workload), env)


def summarize(rows: list[dict], modes: list[str], workloads: list[str], tokenize: list[str]) -> list[dict]:
    """Each (mode, workload)'s median CPU per request over the rounds, per tokenization, and
    each one's ratio over `segments` (the default)."""
    summary = []
    for mode in modes:
        for workload in workloads:
            cpu = {
                how: statistics.median(
                    r["server_cpu_ms_per_request"]
                    for r in rows
                    if (r["mode"], r["workload"], r["tokenize"]) == (mode, workload, how)
                )
                for how in tokenize
            }
            entry: dict = {"mode": mode, "workload": workload, "cpu_ms_per_request_median": cpu}
            if "segments" in cpu:
                entry |= {f"{how}_over_segments": round(cpu[how] / cpu["segments"], 2) for how in cpu}
            summary.append(entry)
            print(
                f"median {mode:11s} {workload:11s} "
                + "  ".join(f"{h} {v:.3f}" for h, v in cpu.items())
                + " CPU-ms"
            )
    return summary


def compare_checkouts(args: argparse.Namespace, checkouts: list[str]) -> dict:
    """Frontend CPU-ms per request of each checkout on the one_message point (module docstring)."""
    numbers = itertools.count()
    body = long_body(args.prefix_tokens, one_message=True)

    def numbered(_: int) -> dict:
        return body(next(numbers))

    scratch = Path(tempfile.mkdtemp(prefix="bench-long-checkouts-"))
    env = embedded_planes(scratch)
    processes = mocker_workers(args.model, scratch, env, extra=("--context-length", "16384"))
    frontends = {}
    sources = {}  # label (the checkout's folder name) -> its path and commit
    try:
        for checkout in checkouts:
            source = str(Path(checkout).resolve())
            label = Path(source).name
            sources[label] = {"path": source, **(git_of(Path(source) / "dynamo_graph") or {})}
            port = free_port()
            # -P: the working directory (a checkout itself) must not come before PYTHONPATH
            argv = [sys.executable, "-P", "-m", "dynamo_graph", "run", "in=http", "out=auto"]
            argv += ["--http-port", str(port), "--router-mode", "kv"]
            frontend = start(argv, port, 0.0, {**env, "PYTHONPATH": source})
            processes.append(frontend)
            frontends[label] = (frontend, port)
        cpu = alternate(
            frontends,
            numbered,  # type: ignore[arg-type]
            args.rounds,
            concurrency=args.concurrency,
            requests=args.requests,
            keep_alive=False,
            max_seconds=args.max_seconds,
        )
    finally:
        stop_all(processes)
    summary = {label: {"median": statistics.median(v), "range": [min(v), max(v)]} for label, v in cpu.items()}
    for label, entry in summary.items():
        print(f"{label}: median {entry['median']:.3f} CPU-ms/request, range {entry['range']}")
    return {"checkouts": sources, "cpu_ms_per_request": cpu, "summary": summary}


def save(args: argparse.Namespace, benchmark: str, **fields: object) -> None:
    """The results JSON at --out: `fields`, with the machine, the commit and the settings."""
    document = {"benchmark": benchmark, **provenance(), "source": git_of(Path(__file__))}
    document["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    print(f"wrote {write_json(Path(args.out), document | fields)}")


def choices(
    parser: argparse.ArgumentParser, raw: str, allowed: tuple[str, ...] | dict, what: str
) -> list[str]:
    picked = [m.strip() for m in raw.split(",") if m.strip()]
    if unknown := set(picked) - set(allowed):
        parser.error(f"unknown {what} {', '.join(sorted(unknown))}: use {', '.join(allowed)}")
    return picked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {', '.join(WORKLOADS)}")
    parser.add_argument("--tokenize", default="segments,whole", help=f"some of {', '.join(TOKENIZE)}")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1, help="times the whole matrix runs")
    parser.add_argument("--speedup-ratio", type=float, default=100.0, help="the mocker workers'")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--checkouts", default="", help="source trees to compare (module docstring)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_prompts.json"))
    args = parser.parse_args()
    if args.checkouts:
        save(
            args,
            "long_prompts_checkouts",
            point="one_message, c=8, new connections, kv frontend, 2 mockers at speedup 10000",
            target="issue 27: <= 1.5 frontend CPU-ms per request",
            **compare_checkouts(args, [c for c in args.checkouts.split(",") if c]),
        )
        return 0
    modes = choices(parser, args.modes, MODES, "mode(s)")
    workloads = choices(parser, args.workloads, WORKLOADS, "workload(s)")
    tokenize = choices(parser, args.tokenize, TOKENIZE, "tokenization(s)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-long-prompts-") as tmp:
        matrix = itertools.product(range(args.rounds), modes, workloads, tokenize)
        for round_, mode, workload, tokenize_ in matrix:
            run_dir = Path(tmp) / f"{round_}-{mode}-{workload}-{tokenize_}"
            run_dir.mkdir()
            row = point(args, mode, workload, TOKENIZE[tokenize_], run_dir)
            rows.append({"round": round_, "mode": mode, "workload": workload, "tokenize": tokenize_, **row})
            print(
                f"round {round_} {mode:11s} {workload:11s} {tokenize_:8s} ok {row['ok']}/{row['requests']}  "
                f"frontend {row['server_cpu_ms_per_request']:6.3f} CPU-ms/request  "
                f"TTFT p50 {row['ttft_p50_ms']:7.2f} ms  {row['rps']:6.1f} req/s",
                flush=True,
            )
    save(
        args,
        "long_prompts",
        target="issues 17 and 27: <= 1.5 frontend CPU-ms per long-prefix request at c=8 behind kv",
        summary=summarize(rows, modes, workloads, tokenize),
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
