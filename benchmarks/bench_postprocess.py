"""Micro-benchmark: frontend CPU per streamed token for detokenize + postprocess (and, for
scale, one chat preprocess), against a budget of ~1.2 CPU-ms per 64-token request.

Run: .venv/bin/python benchmarks/bench_postprocess.py [--iterations N]
Writes benchmarks/results/postprocess.json. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from dynamo_graph.backend.protocol import LLMEngineOutput, StopConditions
from dynamo_graph.bench.stats import cpu_us_per_call
from dynamo_graph.dev.tiny_tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    END_OF_TEXT_ID,
    EOT_ID,
    SPECIAL_TOKENS,
    write_tokenizer_files,
)
from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.detokenizer import DetokenizerFactory
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.postprocessor import Postprocessor
from dynamo_graph.llm.preprocessor import Preprocessor

TOKENS = 64
RESULT = Path(__file__).parent / "results" / "postprocess.json"
OUTPUT_TEXT = (
    "Sure! Here is a short answer about the weather in Paris: it is sunny, 24°C, with a light "
    "breeze from the west. 中文 works too 😀, and so does naïve café text. Anything else?"
)
PROMPT = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."},
    {"role": "user", "content": "What is the weather like in Paris today, and should I bring an umbrella?"},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="64-token streams per round")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer_files(Path(tmp), 4096)
    factory = DetokenizerFactory(tokenizer)
    ids = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False).ids
    ids = (ids * (TOKENS // len(ids) + 1))[:TOKENS]
    # As the frontend gets them: one msgpack frame per token, decoded into LLMEngineOutput.
    frames = [msgspec.msgpack.encode(LLMEngineOutput(token_ids=[i])) for i in ids]
    frames[-1] = msgspec.msgpack.encode(LLMEngineOutput(token_ids=[ids[-1]], finish_reason="length"))
    decoder = msgspec.msgpack.Decoder(LLMEngineOutput)
    chunks = [decoder.decode(f) for f in frames]
    eos = [EOT_ID, END_OF_TEXT_ID]

    def stream(stop: StopConditions, *, decode_frames: bool = False) -> Callable[[], object]:
        def run() -> object:
            pp = Postprocessor(factory.new(skip_special_tokens=False), stop)
            outs = [decoder.decode(f) for f in frames] if decode_frames else chunks
            for out in outs:
                pp.process(out)
            return pp

        return run

    plain = StopConditions(max_tokens=TOKENS, stop_token_ids_hidden=eos)
    with_stops = StopConditions(max_tokens=TOKENS, stop_token_ids_hidden=eos, stop=["</answer>", "\n\nUser:"])

    def detokenize() -> object:
        detok = factory.new(skip_special_tokens=False)
        return [detok.add(c.token_ids) for c in chunks]

    results: dict[str, float] = {}
    for name, fn in {
        "detokenize_only": detokenize,
        "postprocess": stream(plain),
        "postprocess_2_stop_strings": stream(with_stops),
        "msgpack_decode_and_postprocess": stream(plain, decode_frames=True),
    }.items():
        results[f"{name}_us_per_token"] = round(cpu_us_per_call(fn, args.iterations) / TOKENS, 3)

    template = ChatTemplate(CHAT_TEMPLATE, SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOT_ID])
    pre = Preprocessor(tokenizer, template, eos, 4096, "tiny")
    request = msgspec.convert(
        {"model": "tiny", "messages": PROMPT, "max_tokens": TOKENS}, ChatCompletionRequest
    )
    prompt_tokens = len(pre.preprocess_chat(request).token_ids)
    results["preprocess_chat_us_per_request"] = round(
        cpu_us_per_call(lambda: pre.preprocess_chat(request), args.iterations), 1
    )
    results["request_us_total"] = round(
        results["preprocess_chat_us_per_request"] + results["postprocess_us_per_token"] * TOKENS, 1
    )
    report = {
        "benchmark": "bench_postprocess",
        "tokens_per_stream": TOKENS,
        "prompt_tokens": prompt_tokens,
        "iterations": args.iterations,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **results,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
