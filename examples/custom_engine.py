"""A custom engine behind the unified `LLMEngine` contract, served with `dynamo_graph.backend.run`.

    python examples/custom_engine.py in=dyn://custom.backend.generate --model-path MODEL_DIR \
        -- --delay-ms 5 --max-prompt-tokens 256
    dyngraph run in=http out=auto          # in another shell: the frontend finds the worker

It is a Backend-type (tokens-input) model: the frontend applies the chat template, tokenizes,
and detokenizes what the engine streams. The toy engine streams the prompt's token ids back in
reverse order (the model's eos ids left out). `run()` does everything else: the runtime and its
lease, the model card, serving, cancellation, typed errors (the InvalidArgument below reaches
the client as HTTP 400), finish-reason normalisation (this engine says "eos"; clients see
"stop") and graceful shutdown on SIGTERM. The same file also runs in-process or as a graph
worker: `dyngraph run in=http out=examples/custom_engine.py --model-path MODEL_DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.run import run
from dynamo_graph.runtime.context import Context


class ReverseEngine(LLMEngine):
    def __init__(self, delay_s: float = 0.0, max_prompt_tokens: int = 4096) -> None:
        self.delay_s = delay_s
        self.max_prompt_tokens = max_prompt_tokens

    @classmethod
    def from_config(cls, cfg, model) -> ReverseEngine:  # type: ignore[no-untyped-def]
        # The engine's own flags come after `--` on the command line.
        parser = argparse.ArgumentParser(prog="custom_engine.py", add_help=False)
        parser.add_argument("--delay-ms", type=float, default=0.0)
        parser.add_argument("--max-prompt-tokens", type=int, default=4096)
        args = parser.parse_args(cfg.engine_argv)
        return cls(delay_s=args.delay_ms / 1000.0, max_prompt_tokens=args.max_prompt_tokens)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        return EngineConfig(model_input="tokens")

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        prompt = request.token_ids
        if len(prompt) > self.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt has {len(prompt)} tokens; this engine takes at most {self.max_prompt_tokens}",
                param="messages",
            )
        eos = set(request.eos_token_ids)
        answer = [t for t in reversed(prompt) if t not in eos]
        limit = request.stop_conditions.max_tokens
        if limit is not None:
            answer = answer[:limit]
        sent = 0
        for token_id in answer:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if context.is_stopped():
                break
            yield LLMEngineOutput(token_ids=[token_id])
            sent += 1
        usage = CompletionUsage(prompt_tokens=len(prompt), completion_tokens=sent)
        if context.is_stopped():
            reason = "cancelled"
        else:
            reason = "length" if limit is not None and sent == limit else "eos"
        yield LLMEngineOutput(finish_reason=reason, completion_usage=usage)  # type: ignore[arg-type]

    async def cleanup(self) -> None:
        return None


if __name__ == "__main__":
    run(ReverseEngine)
