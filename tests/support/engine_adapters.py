"""What the fake-backed engine adapter tests (test_sglang_adapter.py, test_trtllm_adapter.py) share:
the tiny local model, a KV event sink that records what it is told, and request/collect helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, StopConditions
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.runtime.context import Context

EOS = [4, 1]


def tiny_local_model(tmp_path: Path) -> LocalModel:
    """A LocalModel for an hf folder holding only an empty config.json."""
    (tmp_path / "config.json").write_text("{}")
    return LocalModel(
        source=str(tmp_path),
        kind="hf",
        root=tmp_path,
        display_name="tiny",
        config_json=tmp_path / "config.json",
        eos_token_ids=list(EOS),
        context_length=4096,
    )


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, parent_hash, blocks, dp_rank=0, lora_name=None) -> None:
        adapter = () if lora_name is None else (lora_name,)  # base-model blocks: the 4-tuple
        self.events.append(("stored", parent_hash, list(blocks), dp_rank, *adapter))

    def removed(self, block_hashes, dp_rank=0) -> None:
        self.events.append(("removed", list(block_hashes), dp_rank))

    def cleared(self, dp_rank=0) -> None:
        self.events.append(("cleared", dp_rank))

    def load(self, metrics) -> None:
        self.events.append(("load", metrics))


def request(n: int | None = 5, **stop: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="tiny",
        token_ids=[0, 10, 11, 12],
        stop_conditions=StopConditions(max_tokens=n, **stop),
        eos_token_ids=list(EOS),
    )


async def collect(engine: Any, req: PreprocessedRequest, ctx: Context | None = None) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(req, ctx or Context())]


def tokens(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def sglang_pd_worker(model: str, role: str, **fields: Any) -> dict[str, Any]:
    """A graph's SGLang worker of one half of prefill/decode, its transfer backend configured."""
    args = {"disaggregation_transfer_backend": "nixl"}
    return {"kind": "worker", "model": model, "engine": "sglang", "role": role, "engine_args": args, **fields}
