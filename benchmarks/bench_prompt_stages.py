"""Where the frontend's CPU goes for one chat request, stage by stage, long prompt vs short.

    .venv/bin/python benchmarks/bench_prompt_stages.py --model .cache/tiny-model

Runs the frontend's own per-request code in this process, without HTTP, on bench_long_prompts.py's
bodies (a ~4k-token shared system document + a short question, and the two in one user
message: `one_message`) and bench_frontend.py's short chat, each stage many times after a
warm-up (so the segment cache, the router's prefix-hash cache and its index hold the shared
prefix, as they do under load). Every call is a request of its own number, whose question no
cache has seen, and the figure is process CPU (every thread's: a tokenizer's thread pool
counts) in microseconds per call:

- `decode`: the JSON body into a `ChatCompletionRequest` (the chat route's decoder);
- `render`: the chat template over the request's messages;
- `tokenize`: the rendered prompt's ids and named prefixes (segment_tokenizer.py);
- `preprocess`: all of `Preprocessor.preprocess_chat` (the three above and the rest);
- `request_plane`: msgpack of the `PreprocessedRequest` as the request plane sends it;
- `route_kv`: `KvRouter.route` + `free` (block hashes from the prefix-hash cache, the index's
  overlaps, the predicted TTFT) with one of two workers holding the prefix;
- `postprocessor`: the response path's per-request set-up (detokenizer, stop conditions).

Results: benchmarks/results/prompt_stages.json. The HTTP layer and the 64-token response
stream, which cost the same for both prompts, are bench_frontend.py's subject.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_long_prompts import long_body, short_body

from dynamo_graph.bench.report import write_json
from dynamo_graph.frontend.openai_chat.protocol import DECODER
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.chat_template import messages_from_request
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.pipeline import TokensPipeline, tokens_pipeline
from dynamo_graph.llm.postprocessor import Postprocessor
from dynamo_graph.llm.segment_tokenizer import SegmentTokenizer
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.protocols import KvCacheEvent, KvStored, StoredBlock
from dynamo_graph.router.kv.router import KvRouter

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 64


def per_call_us(fn: Callable[[int], object], calls: int) -> float:
    """Process CPU (all threads) per call of `fn(i)`, i new to every call, after a warm-up."""
    warm = max(calls // 10, 10)
    for i in range(warm):
        fn(i)
    start = time.process_time()
    for i in range(warm, warm + calls):
        fn(i)
    return round((time.process_time() - start) * 1e6 / calls, 2)


def stages(pipeline: TokensPipeline, body: Callable[[int], dict], calls: int) -> dict[str, float]:
    """Each stage's CPU per call on requests numbered 0, 1, ...: each its own question."""
    pre = pipeline.preprocessor
    template = pre.chat_template
    assert template is not None
    n = calls + max(calls // 10, 10)
    raws = [msgspec.json.encode(body(i)) for i in range(n)]
    requests = [DECODER.decode(raw) for raw in raws]
    prompts = [template.render(messages_from_request(r)) for r in requests]
    prepared = pre.preprocess_chat(requests[0])
    router = KvRouter(BLOCK_SIZE, seed=0)
    local = local_block_hashes(prepared.token_ids, BLOCK_SIZE)
    blocks = [StoredBlock(s, h) for s, h in zip(sequence_hashes(local), local, strict=True)]
    router.indexer.apply_event(KvCacheEvent(0, 1, KvStored(blocks)))
    detokenizers = pipeline.detokenizers
    segments = SegmentTokenizer(pre.tokenizer)  # cold, then warm with the shared prefix only
    cpu = {
        "decode": per_call_us(lambda i: DECODER.decode(raws[i]), calls),
        "render": per_call_us(lambda i: template.render(messages_from_request(requests[i])), calls),
        "tokenize": per_call_us(lambda i: segments.encode_prefixed(prompts[i]), calls),
        "preprocess": per_call_us(lambda i: pre.preprocess_chat(requests[i]), calls),
    }
    preprocessed = [pre.preprocess_chat(r) for r in requests]

    def route(i: int) -> None:
        req = preprocessed[i]
        prefixes = req.routing.prefixes if req.routing is not None else None
        router.route(str(i), req.token_ids, (1, 2), prefixes=prefixes)
        router.free(str(i))

    return {
        "prompt_tokens": len(prepared.token_ids),
        **cpu,
        "request_plane": per_call_us(lambda i: msgspec.msgpack.encode(preprocessed[i]), calls),
        "route_kv": per_call_us(route, calls),
        "postprocessor": per_call_us(
            lambda i: Postprocessor.for_request(detokenizers, preprocessed[i]), calls
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000, help="calls per stage")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prompt_stages.json"))
    args = parser.parse_args()
    model = resolve_model(args.model)
    card = ModelDeploymentCard(
        display_name="bench", slug="bench", source_path=args.model, context_length=16384
    )
    pipeline = tokens_pipeline(card, model, backend=None)  # type: ignore[arg-type]
    rows = {}
    workloads = (
        ("long_prefix", long_body(args.prefix_tokens)),
        ("one_message", long_body(args.prefix_tokens, one_message=True)),
        ("short", short_body()),
    )
    for workload, body in workloads:
        rows[workload] = stages(pipeline, body, args.calls)
        print(f"{workload:11s} " + "  ".join(f"{k} {v}" for k, v in rows[workload].items()))
    path = write_json(
        Path(args.out),
        {
            "benchmark": "prompt_stages",
            "unit": "process CPU microseconds per call",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
