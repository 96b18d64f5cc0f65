"""Frontend CPU for chats that share a long prefix: segment-cached tokenization vs whole prompts.

    .venv/bin/python benchmarks/bench_long_prompts.py --model .cache/tiny-model

Every request is a streamed chat whose system message is the same ~`--prefix-tokens` (4096)
token document and whose user message is a short question (~32 tokens, different per request
id), answered with 64 tokens by echo_core (no delay) in one `dyngraph run in=http` process.
The same load runs twice in one run: with the frontend's segment cache (the default) and with
it off (`DYN_TOKENIZE_CACHE_MB=0`, every prompt tokenized whole), and the server's CPU-ms per
request is compared. Short prompts are measured too, to show the cache costs nothing there.
Results: benchmarks/results/long_prompts.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import STREAM_BODY, free_port, measure, start

from dynamo_graph.bench.report import write_json

ROOT = Path(__file__).resolve().parents[1]
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


def long_body(prefix_tokens: int) -> dict:
    rng = random.Random(4096)
    # About two tokens a word with the tiny model's tokenizer.
    document = " ".join(rng.choice(WORDS) for _ in range(prefix_tokens // 2))
    return {
        **STREAM_BODY,
        "messages": [
            {"role": "system", "content": "Answer from this document.\n\n" + document},
            {"role": "user", "content": "Which three words of the document come up most, and why?"},
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_prompts.json"))
    args = parser.parse_args()
    rows = []
    for workload, body in (("long_prefix", long_body(args.prefix_tokens)), ("short", STREAM_BODY)):
        for tokenize, env in (("segments", {}), ("whole", {"DYN_TOKENIZE_CACHE_MB": "0"})):
            port = free_port()
            argv = [
                sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=echo_core", args.model,
                "--model-name", "bench", "--http-port", str(port), "--context-length", "16384",
            ]  # fmt: skip
            proc = start(argv, port, 0.0, env)
            try:
                row = measure(
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
            rows.append({"workload": workload, "tokenize": tokenize, **row})
            print(
                f"{workload:11s} {tokenize:8s} ok {row['ok']}/{row['requests']}  "
                f"server {row['server_cpu_ms_per_request']:6.3f} CPU-ms/request  "
                f"TTFT p50 {row['ttft_p50_ms']:7.2f} ms  {row['rps']:6.1f} req/s"
            )
    by = {(r["workload"], r["tokenize"]): r["server_cpu_ms_per_request"] for r in rows}
    ratios = {w: round(by[(w, "whole")] / by[(w, "segments")], 2) for w in ("long_prefix", "short")}
    print("whole/segments server CPU per request: " + ", ".join(f"{w} {v}x" for w, v in ratios.items()))
    path = write_json(
        Path(args.out),
        {
            "benchmark": "long_prompts",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
            "whole_over_segments_cpu": ratios,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
