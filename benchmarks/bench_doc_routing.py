"""Routing on documents asked about in one message: how much of the cache kv routing captures.

    .venv/bin/python benchmarks/bench_doc_routing.py                 # round-robin, kv (~2 minutes)
    .venv/bin/python benchmarks/bench_doc_routing.py --modes round-robin,kv,kv-own-ttft --seeds 1

The workload of issue 27: `--docs` (24) shared documents of ~`--doc-tokens` (4096) tokens of
text, each request one user message holding a document (drawn uniformly) and then a question of
~32 tokens of its own, sent as a streamed chat (so the frontend templates and tokenizes it: the
document and the question are one segment between the template's special tokens) on a new
connection (`Connection: close`), `c` (8) requests at once back to back, `--requests` (192) in
all; 2 mocker workers at speedup 1 (a 4k-token prefill takes ~80 ms), `--num-gpu-blocks` (1024)
each: the documents' 1,536 blocks fit in two workers' caches, not in one. Every point starts on
fresh processes (cold caches and a cold router).

The oracle is one worker with an unbounded cache that has seen every earlier request: a
request's oracle hit is the longest full-block prefix it shares with any request sent before it
(bench_router_predict.py's `oracle_hits`, over the token ids the frontend makes of each chat:
the model's chat template, then its tokenizer). Reported per mode: TTFT mean/p50/p90, the cached
fraction (usage.cached_tokens over prompt tokens), and for kv modes the ratio of round-robin's
mean TTFT to the mode's and the *capture*: the share of the cache hits the oracle adds over
round-robin that the mode adds, (mode - rr) / (oracle - rr) in cached tokens. Targets (the
issue's): >= 1.25x and >= 85%.

Modes: `round-robin`, `kv` (the default predictive cost) and `kv-own-ttft` (the predictive cost
ranking by the request's own predicted TTFT only, `--router-prefill-penalty 0`: the behaviour
before issue 27). `--rounds` runs every seed's modes that many times, in turns (each round
starting with the next mode), so that load from others on the shared machine falls on every mode
alike; the comparison is per round, and the summary gives each seed's median and spread.

Each row also splits the mean TTFT into what its requests contributed (`ttft_share_ms`, summing
to the mean): the opening burst (the first `c` requests, sent at once to cold caches), each
document's first use (which no policy can serve from cache), later requests that missed (less
than half the prompt cached: a policy's own misses) and those that hit. Results:
benchmarks/results/doc_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router_predict import oracle_hits  # noqa: E402
from bench_routing import Conversation, Deployment, run_point, summarize, vocab_range, warm_up  # noqa: E402

from dynamo_graph.bench.provenance import git_of, provenance  # noqa: E402
from dynamo_graph.bench.report import write_json  # noqa: E402
from dynamo_graph.llm.chat_template import ChatTemplate  # noqa: E402
from dynamo_graph.llm.model_source import resolve_model  # noqa: E402

MODES = ("round-robin", "kv", "kv-own-ttft")  # bench_routing.py's
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
    "document",
    "question",
    "answer",
    "memory",
    "block",
    "hash",
    "event",
    "queue",
    "engine",
]


def documents_workload(args: argparse.Namespace, seed: int) -> list[Conversation]:
    """`args.requests` one-message chats over `args.docs` documents, with their token ids."""
    model = resolve_model(args.model)
    tokenizer = model.load_tokenizer()
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    rng = random.Random(f"docs:{seed}")
    # About two tokens a word with the tiny model's tokenizer.
    docs = [
        f"Document {d}.\n\n" + " ".join(rng.choice(WORDS) for _ in range(args.doc_tokens // 2))
        for d in range(args.docs)
    ]
    convs = []
    for i in range(args.requests):
        doc = rng.randrange(args.docs)
        question = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"
        messages = [{"role": "user", "content": f"{docs[doc]}\n\n{question}"}]
        prompt = template.render(messages, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        max_tokens = rng.randint(16, 48)
        convs.append(Conversation(i, doc, [ids], [max_tokens], messages=[messages]))
    return convs


def run_mode(args: argparse.Namespace, mode: str, convs: list[Conversation], run_dir: Path) -> dict:
    point_args = argparse.Namespace(**{**vars(args), "workers": 2, "seed": 0})
    run_dir.mkdir(parents=True)
    dep = Deployment(point_args, mode, args.concurrency, run_dir)
    try:
        warm_up(dep, point_args, vocab_range(Path(args.model)))
        results, wall = asyncio.run(
            run_point(dep.port, dep.model, convs, args.concurrency, args.max_seconds, keep_alive=False)
        )
    finally:
        dep.close()
    ok = [r for r in results if r.ok]
    summary = summarize(results, wall)
    oracle = oracle_hits(convs, {(r.conv, r.turn) for r in ok}, args.block_size)
    return {
        "ttft_share_ms": ttft_shares(ok, convs, args.concurrency),
        "mode": mode,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "ttft_mean_ms": summary["ttft_mean_ms"],
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p90_ms": summary["ttft_p90_ms"],
        "prompt_tokens": summary["prompt_tokens"],
        "cached_tokens": summary["cached_tokens"],
        "oracle_cached_tokens": oracle,
        "cached_fraction": summary["cache_hit_rate"],
        "wall_s": summary["wall_s"],
    }


def ttft_shares(ok: list, convs: list[Conversation], concurrency: int) -> dict[str, float]:
    """What each kind of request adds to the mean TTFT (ms; the kinds sum to the mean)."""
    shares = dict.fromkeys(("burst", "first_use", "miss", "hit"), 0.0)
    seen: set[int] = set()
    for rank, r in enumerate(sorted(ok, key=lambda r: r.start)):
        doc = convs[r.conv].doc
        if rank < concurrency:
            kind = "burst"
        elif doc not in seen:
            kind = "first_use"
        else:
            kind = "miss" if 2 * r.cached_tokens < r.prompt_tokens else "hit"
        seen.add(doc)
        shares[kind] += r.ttft
    return {kind: round(total * 1000 / max(len(ok), 1), 2) for kind, total in shares.items()}


def compare(rows: list[dict]) -> list[dict]:
    """Each kv mode against round-robin of the same seed: TTFT ratio and capture."""
    out = []
    for row in rows:
        rr = next(
            (
                r
                for r in rows
                if r["mode"] == "round-robin" and (r["seed"], r["round"]) == (row["seed"], row["round"])
            ),
            None,
        )
        if rr is None or not row["mode"].startswith("kv") or not row["ttft_mean_ms"]:
            continue

        # per token of prompt, as the runs may finish different numbers of requests
        def frac(r: dict, key: str) -> float:
            return r[key] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0

        room = frac(row, "oracle_cached_tokens") - frac(rr, "cached_tokens")
        capture = (frac(row, "cached_tokens") - frac(rr, "cached_tokens")) / room if room > 0 else None
        out.append(
            {
                "seed": row["seed"],
                "round": row["round"],
                "mode": row["mode"],
                "rr_over_mode_ttft_mean": round(rr["ttft_mean_ms"] / row["ttft_mean_ms"], 2),
                "rr_over_mode_ttft_p90": round(rr["ttft_p90_ms"] / row["ttft_p90_ms"], 2),
                "capture": round(capture, 3) if capture is not None else None,
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--modes", default="round-robin,kv", help=f"some of {', '.join(MODES)}")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every seed's modes, in turns")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=1024)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument(
        "--max-seconds", type=float, default=40.0, help="no new request after this, per point"
    )
    parser.add_argument("--router-debug", action="store_true", help="frontend logs every routing decision")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (path printed)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "doc_routing.json"))
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}: use {', '.join(MODES)}")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-doc-routing-"))
    rows = []
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            convs = documents_workload(args, seed)
            for round_ in range(args.rounds):
                for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
                    point = run_dir / f"{seed}-{round_}-{mode}"
                    row = {"seed": seed, "round": round_, **run_mode(args, mode, convs, point)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        if args.keep_logs:
            print(f"logs: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    comparison = compare(rows)
    for entry in comparison:
        print(json.dumps(entry))
    summary = []
    for mode in sorted({c["mode"] for c in comparison}):
        for seed in sorted({c["seed"] for c in comparison}):
            mine = [c for c in comparison if (c["mode"], c["seed"]) == (mode, seed)]
            ratios = [c["rr_over_mode_ttft_mean"] for c in mine]
            captures = [c["capture"] for c in mine if c["capture"] is not None]
            entry = {
                "mode": mode,
                "seed": seed,
                "rr_over_mode_ttft_mean_median": statistics.median(ratios),
                "rr_over_mode_ttft_mean_range": [min(ratios), max(ratios)],
                "capture_median": statistics.median(captures) if captures else None,
            }
            summary.append(entry)
            print(json.dumps(entry))
    saved = write_json(
        Path(args.out),
        {
            "benchmark": "doc_routing",
            **provenance(),
            "source": git_of(Path(__file__)),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "targets": "rr/kv TTFT mean >= 1.25, capture of the oracle's extra hits over rr >= 0.85",
            "rows": rows,
            "comparison": comparison,
            "summary": summary,
        },
    )
    print(f"wrote {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
