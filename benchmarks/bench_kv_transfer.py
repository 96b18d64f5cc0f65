"""llama.cpp KV transfer on the tiny model: handoff size, export and import time, against the
prefill they replace.

For prompts of 64, 256 and 1024 tokens: the handoff's bytes (llama.cpp's sequence state of the
prompt, plus its token ids) and bytes per token; the time to export it after the prompt was
evaluated (`llamacpp_state.export_sequence`) and to check and load it into another context
(`check_handoff` + `import_sequence`), each on its own `Llama` as two workers would hold them;
the time to evaluate the prompt, which the import saves the decode worker; and, through the
engine contract (two `LlamaCppEngine`s), the decode worker's time to its first token from a
handoff against an aggregated engine's time to first token for the same prompt. Medians over
`--repeats` runs. The transfer between the two workers (the request plane, kv_fetch) is not in
these figures.

    .venv/bin/python benchmarks/bench_kv_transfer.py [--model DIR] [--repeats N]

Writes benchmarks/results/kv_transfer_llamacpp.json. Not a test: numbers depend on the machine.

Last figures (2-core machine shared with other jobs, 1 thread per context, 20 repeats), for 64 /
256 / 1024 prompt tokens: handoffs of 66.6 kB / 266 kB / 1.07 MB, 1040 B per token (the tiny
model's f16 KV is 1024 B per token: 2 layers x K and V x 2 heads x 64; the rest is llama.cpp's
per-cell positions and our token ids); export 0.02 / 0.06 / 0.16 ms and import 0.04 / 0.08 /
0.31 ms, against 3.1 / 11 / 67 ms to evaluate the prompt. Through the engines, the decode
worker's first token came 0.7 / 1.0 / 1.8 ms after it was given the handoff, where an aggregated
engine took 3.2 / 15 / 72 ms. On this model, moving the bytes (a MB per 1k tokens) is what
disaggregation costs, not packing or loading them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_graph.backend.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402
from dynamo_graph.dev.tiny_model import GGUF_NAME, ensure_tiny_model  # noqa: E402
from dynamo_graph.engines.llamacpp.args import LlamaCppArgs  # noqa: E402
from dynamo_graph.engines.llamacpp.engine import LlamaCppEngine  # noqa: E402
from dynamo_graph.engines.llamacpp.state import (  # noqa: E402
    check_handoff,
    export_sequence,
    import_sequence,
    state_format,
)
from dynamo_graph.router.migration import continuation  # noqa: E402
from dynamo_graph.runtime.context import Context  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "kv_transfer_llamacpp.json"
LENGTHS = (64, 256, 1024)
N_CTX = 2048
N_THREADS = 1  # the machine's other core serves the other engine / the harness


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 3)


def prompt_of(n: int) -> list[int]:
    return [0] + [6 + (i * 37) % 2000 for i in range(n - 1)]  # bos, then ordinary tokens


def state_figures(gguf: Path, repeats: int) -> list[dict[str, Any]]:
    """Export and import with llama.cpp's calls directly, on two contexts of the same model."""
    import llama_cpp

    fmt = state_format(gguf, llama_cpp.__version__)
    kwargs = {"n_ctx": N_CTX, "n_threads": N_THREADS, "n_threads_batch": N_THREADS, "verbose": False}
    a = llama_cpp.Llama(model_path=str(gguf), **kwargs)
    b = llama_cpp.Llama(model_path=str(gguf), **kwargs)
    rows = []
    try:
        for n in LENGTHS:
            prompt = prompt_of(n)

            def evaluate(llm: Any = a, prompt: list[int] = prompt) -> None:
                llm.reset()
                llm.eval(prompt)

            prefill_ms = median_ms(evaluate, repeats)  # leaves `a` holding the prompt's KV
            handoff = export_sequence(llama_cpp, a.ctx, fmt, prompt, 0)
            export_ms = median_ms(lambda p=prompt: export_sequence(llama_cpp, a.ctx, fmt, p, 0), repeats)

            def load(h: Any = handoff, p: list[int] = prompt) -> None:
                check_handoff(h, fmt, [*p, 7])
                import_sequence(llama_cpp, b.ctx, h, 0)

            import_ms = median_ms(load, repeats)
            rows.append(
                {
                    "prompt_tokens": n,
                    "handoff_bytes": handoff.size,
                    "bytes_per_token": round(handoff.size / n, 1),
                    "export_ms": export_ms,
                    "import_ms": import_ms,
                    "prompt_eval_ms": prefill_ms,
                }
            )
    finally:
        a.close()
        b.close()
    return rows


def request(prompt: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="tiny",
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens),
        sampling_options=SamplingOptions(temperature=0.0),
    )


async def engine_figures(gguf: Path, repeats: int) -> dict[int, dict[str, float]]:
    """Through the engine contract: prefill on one engine, first token from the handoff on
    another, against an aggregated engine's first token (prefix reuse off: every run computes)."""
    args = LlamaCppArgs.from_dict({"n_threads": N_THREADS, "prefix_reuse": False})
    engines = [LlamaCppEngine(gguf, args, default_n_ctx=N_CTX) for _ in range(3)]
    prefill, decode, aggregated = engines
    for engine in engines:
        await engine.start()
    out: dict[int, dict[str, float]] = {}
    try:
        for n in LENGTHS:
            req = request(prompt_of(n), 2)
            prefill_s, kv_ttft_s, agg_ttft_s = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                first, handoff = await prefill.prefill(req, Context())
                prefill_s.append(time.perf_counter() - start)
                assert handoff is not None
                follow = continuation(req, first.token_ids)
                start = time.perf_counter()
                async for _ in decode.generate_from_kv(follow, handoff, Context()):
                    kv_ttft_s.append(time.perf_counter() - start)
                    break
                start = time.perf_counter()
                async for _ in aggregated.generate(req, Context()):
                    agg_ttft_s.append(time.perf_counter() - start)
                    break
            out[n] = {
                "engine_prefill_with_export_ms": round(statistics.median(prefill_s) * 1000, 3),
                "engine_decode_first_token_from_kv_ms": round(statistics.median(kv_ttft_s) * 1000, 3),
                "engine_aggregated_first_token_ms": round(statistics.median(agg_ttft_s) * 1000, 3),
            }
    finally:
        for engine in engines:
            await engine.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    gguf = ensure_tiny_model(opts.model) / GGUF_NAME
    rows = state_figures(gguf, opts.repeats)
    through_engine = asyncio.run(engine_figures(gguf, opts.repeats))
    for row in rows:
        row.update(through_engine[row["prompt_tokens"]])
    import llama_cpp

    report = {
        "benchmark": "bench_kv_transfer",
        "engine": "llamacpp",
        "llama_cpp_python": llama_cpp.__version__,
        "model": "tiny (2 layers, 2 KV heads x 64, f16 KV cache)",
        "n_ctx": N_CTX,
        "n_threads": N_THREADS,
        "repeats": opts.repeats,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "results": rows,
    }
    print(json.dumps(report, indent=2))
    RESULT.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
