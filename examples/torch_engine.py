"""A custom engine that runs a Hugging Face causal LM with PyTorch, on the GPU its replica was given.

    dyngraph run in=http out=examples/torch_engine.py --model-path MODEL_DIR
    # in a graph: `engine: ../examples/torch_engine.py` with `gpus: {per_replica: 1}`

It shows what a graph does for a GPU worker without any engine knowing about graphs: the
supervisor sets `CUDA_VISIBLE_DEVICES` from the placement, so the engine just uses `cuda:0`,
which is the GPU the graph gave its replica. Greedy or sampled decoding, one request at a time
(a lock: the point is placement and the backend contract, not batching; use vLLM for serving).
It needs `torch` and `transformers` in the worker's Python; on a machine without CUDA it runs on
the CPU and says so at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.run import run
from dynamo_graph.runtime.context import Context

log = logging.getLogger("torch_engine")


class TorchEngine(LLMEngine):
    def __init__(self, model_path: str) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise RuntimeError(f"torch_engine.py needs torch and transformers installed: {e}") from e
        self.torch = torch
        self.device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path).to(self.device).eval()
        self.lock = asyncio.Lock()
        where = torch.cuda.get_device_name(0) if self.device != "cpu" else "the CPU (no CUDA device)"
        log.info("model on %s (CUDA_VISIBLE_DEVICES=%s)", where, os.environ.get("CUDA_VISIBLE_DEVICES"))

    @classmethod
    def from_config(cls, cfg, model) -> TorchEngine:  # type: ignore[no-untyped-def]
        return cls(cfg.model_path)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        return EngineConfig(model_input="tokens")

    def _step(self, ids: Any, past: Any, temperature: float) -> tuple[int, Any]:
        with self.torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
            logits = out.logits[0, -1].float()
            if temperature > 0:
                probs = self.torch.softmax(logits / temperature, dim=-1)
                token = int(self.torch.multinomial(probs, 1))
            else:
                token = int(logits.argmax())
        return token, out.past_key_values

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        limit = request.stop_conditions.max_tokens or 16
        temperature = request.sampling_options.temperature or 0.0
        eos = set(request.eos_token_ids)
        sent, reason = 0, "length"
        async with self.lock:
            ids = self.torch.tensor([request.token_ids], device=self.device)
            past = None
            while sent < limit:
                if context.is_stopped():
                    reason = "cancelled"
                    break
                token, past = await asyncio.to_thread(self._step, ids, past, temperature)
                if token in eos and not request.stop_conditions.ignore_eos:
                    reason = "eos"
                    break
                yield LLMEngineOutput(token_ids=[token])
                sent += 1
                ids = self.torch.tensor([[token]], device=self.device)
        usage = CompletionUsage(prompt_tokens=len(request.token_ids), completion_tokens=sent)
        yield LLMEngineOutput(finish_reason=reason, completion_usage=usage)  # type: ignore[arg-type]

    async def cleanup(self) -> None:
        return None


if __name__ == "__main__":
    run(TorchEngine)
