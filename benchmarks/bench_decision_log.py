"""What the routing decision log (and the request recording) cost the frontend: CPU-ms per
request with them on against off, in one run.

Two mocker workers (speedup 10000, KV events on zmq) and three kv-routing frontends in front of
them: one plain, one with `--router-decision-log`, one with that and `--record`. The same
streamed chat load (64 tokens, keep-alive, concurrency 8) goes to each in turn, `--rounds` times
in alternation so that the shared machine's drift falls on all three; each frontend's CPU comes
from /proc (bench_frontend.measure), each round starting with the next variant. Reported: the
median CPU-ms per request of each, and the ratio of the logging ones to the plain one. /proc
counts CPU in 10 ms ticks and the machine is shared, so the ratio moves by several percent
between runs; the same script also times the router's part in-process (a kv decision on two
workers with and without its explanation, and handing the line to the writer, whose encoding
and writing run on its own thread), which does not.

    python benchmarks/bench_decision_log.py --model .cache/tiny-model
Results: benchmarks/results/decision_log.json (with the commit and the machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import (
    STREAM_BODY,
    alternate,
    embedded_planes,
    free_port,
    mocker_workers,
    start,
    stop_all,
    variants_args,
    variants_result,
)

from dynamo_graph.bench.report import write_json
from dynamo_graph.llm.protocol import PreprocessedRequest
from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.decisions import DecisionLog
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.runtime.context import Context

ROOT = Path(__file__).resolve().parents[1]


def time_decisions(path: Path, n: int = 30000) -> dict[str, float]:
    """Microseconds of a kv routing decision (two workers, a 70-token prompt) without and with
    its explanation, of recording the line (the caller's part), interleaved, and of encoding
    it (the writer thread's part)."""
    config = RouterConfig(mode="kv", decision_log=str(path))
    log = DecisionLog(config)
    pool = log.pool("bench", prefill=False, kv=True)
    router = KvRouter(16, config, seed=0)
    prompt = list(range(70))
    request = PreprocessedRequest("bench", prompt)
    context = Context("bench")
    plain = explained = recorded = 0.0
    clock = time.perf_counter
    for _ in range(n):
        start = clock()
        router.route("a", prompt, [1, 2])
        router.free("a")
        plain += clock() - start
        start = clock()
        terms: list[dict] = []
        choice = router.route("b", prompt, [1, 2], explain=terms)
        router.free("b")
        explained += clock() - start
        start = clock()
        pool.record(context, request, terms, *choice.key)
        recorded += clock() - start
    log.close()
    line = json.loads(path.read_text().splitlines()[0])
    encode = msgspec.json.Encoder().encode
    start = clock()
    for _ in range(n):
        encode(line)
    return {
        "route": round(plain / n * 1e6, 2),
        "route_explained": round(explained / n * 1e6, 2),
        "record": round(recorded / n * 1e6, 2),
        "writer_encode": round((clock() - start) / n * 1e6, 2),
    }


def main() -> int:
    args = variants_args(__doc__ or "", "decision_log.json")
    scratch = Path(tempfile.mkdtemp(prefix="bench-decisions-"))
    env = embedded_planes(scratch)
    workers = mocker_workers(args.model, scratch, env)
    run = [sys.executable, "-m", "dynamo_graph", "run"]
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
    try:
        for name, extra in variants.items():
            port = free_port()
            argv = [*run, "in=http", "out=auto", "--http-port", str(port), "--router-mode", "kv", *extra]
            frontends[name] = (start(argv, port, 0, env), port)
        load = {"concurrency": args.concurrency, "requests": args.requests, "keep_alive": True}
        cpu = alternate(frontends, STREAM_BODY, args.rounds, max_seconds=60, **load)
    finally:
        stop_all([*(p for p, _ in frontends.values()), *workers])
    logged = sum(1 for _ in (scratch / "decisions.jsonl").open())
    in_process = time_decisions(scratch / "micro.jsonl")
    print(json.dumps(in_process))
    result = variants_result("decision_log_frontend_cpu", args, cpu)
    result |= {
        "decision_lines_written": logged,
        "in_process_us_per_decision": in_process,
    }
    print(json.dumps(result["ratio_to_off"]), f"({logged} decision lines)")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
